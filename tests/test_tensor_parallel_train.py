"""The Trainer under tensor (and sequence) parallelism on several ranks (gloo): the same losses and gradients
as one process, in float64.

``tests/tp_train_worker.py`` trains a tiny Llama (its published plan: column-wise q/k/v/gate/up, row-wise
o/down, the head's logits split over the vocabulary under ``loss_parallel``) with SGD at learning rate 1,
so that each parameter's change is its clipped gradient, and replays the same global batches on one
plain model by hand. Uneven splits (10 items on two groups of micro-batches of 2) exercise the
accumulation weights.

The ranks are started as torchrun would start them, but forked from a warm fork server (``tests/launch.py``):
what is tested is the training code on several ranks, not the launcher (``tests/test_distributed.py`` runs
the real torchrun). One process is ``batchfit.cli.main`` in this process (``launch.batchfit_here``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from hf_tiny import llama_config_dir
from launch import LIBRARIES, batchfit_here, run_cli, run_script
from torch import nn

from batchfit.errors import ConfigError
from batchfit.train.trainer import Trainer

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("tp_train_worker.py")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_config_dir(tmp_path_factory.mktemp("tiny-llama"), vocab_size=64, max_position_embeddings=32)


def _train(config_dir: Path, out: Path, nproc: int, tp: int, sp: bool, global_batch: int) -> dict:
    run = run_script(nproc, WORKER, str(out), str(config_dir), str(tp), "1" if sp else "0", str(global_batch), "2",
                     "2", timeout=300, preload=LIBRARIES)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _check_equal_to_one_process(report: dict) -> None:
    assert report["dtensor_params"]
    assert not report["partial_seen"]  # clipping and the optimizer read reduced gradients, on every torch
    for loss, ref in zip(report["losses"], report["ref_losses"]):
        assert abs(loss - ref) <= 1e-12 * abs(ref)
    for diff, largest in zip(report["grad_diff"], report["grad_max"]):
        assert diff <= 1e-12 * largest  # float64: summation order only


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_trains_as_one_process(config_dir: Path, tmp_path: Path, sp: bool) -> None:
    report = _train(config_dir, tmp_path / "out.json", nproc=2, tp=2, sp=sp, global_batch=8)
    _check_equal_to_one_process(report)
    assert not report["sharded"]  # one group: nothing for FSDP to shard across
    assert report["sizes"] == [[2, 2, 2, 2], [2, 2, 2, 2]]  # both ranks of the group ran the whole batch


@pytest.mark.slow
def test_tensor_parallel_with_fsdp_across_groups_trains_as_one_process(config_dir: Path, tmp_path: Path) -> None:
    report = _train(config_dir, tmp_path / "out.json", nproc=4, tp=2, sp=True, global_batch=10)
    _check_equal_to_one_process(report)
    assert report["sharded"]
    assert report["sizes"] == [[2, 2, 1], [2, 2, 1]]  # rank 0's group: 5 of the 10 items


def test_a_degree_that_does_not_divide_the_processes_is_one_line() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"degree 3 does not divide the 1 processes; valid degrees: 1$"):
        Trainer(model, torch.optim.SGD(model.parameters()), lambda m, b: m(b).sum(), global_batch_size=4,
                micro_batch_size=2, tensor_parallel=3)  # fmt: skip
    with pytest.raises(ConfigError, match="tensor_parallel must be a whole number"):
        Trainer(model, torch.optim.SGD(model.parameters()), lambda m, b: m(b).sum(), global_batch_size=4,
                micro_batch_size=2, tensor_parallel=0)  # fmt: skip


GPT = ["train", "gpt", "--set", "n_layer=2", "--set", "n_embd=16", "--set", "n_head=2", "--set", "vocab_size=32",
       "--set", "seq_len=8", "--global-batch-size", "6", "--micro-batch-size", "2", "--steps", "2",
       "--dtype", "float64", "--json"]  # fmt: skip


def _cli(capfd: pytest.CaptureFixture, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``batchfit train gpt ...``: in this process for one, else on ``nproc`` forked ranks."""
    return batchfit_here(capfd, *GPT, *args) if nproc == 1 else run_cli(nproc, *GPT, *args, timeout=300)


def test_batchfit_train_tp_splits_the_gpt_presets_feed_forward_as_one_process_trains(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    one = _cli(capfd, 1, "--save", str(tmp_path / "one.pt"))
    two = _cli(capfd, 2, "--tp", "2", "--sp", "--save", str(tmp_path / "two.pt"))
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert (b["tensor_parallel"], b["sequence_parallel"]) == (2, True)
    assert [r["loss"] for r in a["steps"]] == pytest.approx([r["loss"] for r in b["steps"]], rel=1e-12)
    whole, split = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert sorted(whole) == sorted(split)
    assert max((whole[k] - split[k]).abs().max().item() for k in whole) < 1e-12


def test_batchfit_train_tp_on_one_process_is_one_line(capfd: pytest.CaptureFixture) -> None:
    run = _cli(capfd, 1, "--tp", "2")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "batchfit: error: tensor parallel degree 2 does not divide the 1 processes; valid degrees: 1"
    )
