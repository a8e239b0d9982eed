"""Checkpoints: atomic, weights-only, refused with one line when wrong, and nothing overwritten."""

from __future__ import annotations

import os
import random

import pytest
import torch

from batchfit import CheckpointError
from batchfit.train.sampler import GlobalBatchSampler
from batchfit.train.save_resume import load_checkpoint, read_checkpoint, save_checkpoint


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.randn(4, 5)).pow(2).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_round_trip_restores_model_optimizer_scheduler_sampler_and_rng(tmp_path) -> None:
    model, opt, sched = _trained()
    sampler = GlobalBatchSampler(50, 10, rank=0, world_size=1, seed=2)
    it = iter(sampler)
    next(it)
    random.seed(11)
    torch.manual_seed(12)
    path = save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt, scheduler=sched, sampler=sampler, step=1)
    expect_torch, expect_py = torch.rand(3), random.random()

    model2, opt2, sched2 = _trained(seed=5)
    sampler2 = GlobalBatchSampler(50, 10, rank=0, world_size=2, seed=2)
    payload = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2, sampler=sampler2)
    assert payload["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert sched2.state_dict() == sched.state_dict()
    assert sampler2.position == 1
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py


def test_a_truncated_file_is_refused_and_the_good_one_kept(tmp_path) -> None:
    model, opt, _ = _trained()
    good = save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt)
    before = good.read_bytes()
    broken = tmp_path / "broken.pt"
    broken.write_bytes(before[: len(before) // 2])
    with pytest.raises(CheckpointError, match="unreadable") as info:
        read_checkpoint(broken)
    assert "\n" not in str(info.value)
    assert good.read_bytes() == before


def test_another_models_checkpoint_changes_nothing(tmp_path) -> None:
    model, opt, _ = _trained()
    path = save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt)
    other = torch.nn.Linear(6, 3)
    snapshot = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="another model"):
        load_checkpoint(path, model=other)
    assert all(torch.equal(snapshot[k], v) for k, v in other.state_dict().items())


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    model, opt, _ = _trained()
    path = save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt)
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        save_checkpoint(path, model=model, optimizer=opt, step=9)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary file left behind


def test_missing_and_foreign_files(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint"):
        read_checkpoint(tmp_path / "nope.pt")
    torch.save({"hello": 1}, tmp_path / "x.pt")
    with pytest.raises(CheckpointError, match="not a batchfit checkpoint"):
        read_checkpoint(tmp_path / "x.pt")
