"""BatchNorm under accumulation: detected when micro-batches are smaller than the global batch, said once."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from batchfit.advice.batchnorm import BatchNormWarning, batchnorm_advice, batchnorm_layers, warn_batchnorm
from batchfit.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8),
        nn.Linear(8, 2),
    )


class MyNorm(_BatchNorm):
    def _check_input_dim(self, x: torch.Tensor) -> None:
        return None


def test_no_batchnorm_no_advice() -> None:
    assert batchnorm_advice(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), 8, 64) is None


def test_no_advice_without_accumulation() -> None:
    assert batchnorm_advice(cnn(), 64, 64) is None


def test_advice_says_what_why_and_how() -> None:
    text = batchnorm_advice(cnn(), 16, 64)
    assert text is not None and "\n" not in text
    assert text.startswith("BatchNorm under gradient accumulation: 2 layers (1 (BatchNorm2d), 5 (BatchNorm1d))")
    assert "normalise over 16 items per forward pass, not over the global batch of 64" in text  # observed
    assert "noisier batch statistics, running averages updated 4 times per step" in text  # why it matters
    assert "a micro-batch of 64 if it fits" in text and "nn.GroupNorm or nn.LayerNorm" in text  # changes
    assert "nn.SyncBatchNorm.convert_sync_batchnorm(model)" in text


def test_every_batchnorm_subclass_is_detected() -> None:
    model = nn.Sequential(nn.BatchNorm3d(2), nn.LazyBatchNorm1d(), MyNorm(3), nn.InstanceNorm1d(3))
    assert [type(m).__name__ for _, m in batchnorm_layers(model)] == ["BatchNorm3d", "LazyBatchNorm1d", "MyNorm"]


def test_frozen_batchnorm_in_eval_mode_is_left_out() -> None:
    model = cnn().eval()
    assert batchnorm_advice(model, 8, 64) is None
    stats_free = nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False)).eval()  # always uses the batch
    assert batchnorm_advice(stats_free, 8, 64) is not None


def test_sync_batchnorm_across_ranks() -> None:
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(cnn())
    assert batchnorm_advice(synced, 16, 64, world_size=4) is None  # 16 x 4 ranks = the global batch
    text = batchnorm_advice(synced, 8, 64, world_size=4)
    assert text is not None and "normalise over 32 items per forward pass" in text
    assert "a micro-batch of 16 per rank if it fits" in text
    assert batchnorm_advice(synced, 16, 64, world_size=1) is not None  # one rank: nothing to sync with


def test_plain_batchnorm_across_ranks_suggests_sync_batchnorm() -> None:
    text = batchnorm_advice(cnn(), 16, 64, world_size=4)  # no accumulation, but 4 ranks of 16
    assert text is not None and "normalise over 16 items" in text
    assert "to normalise over 16 x 4 = 64 items across ranks" in text
    assert "running averages updated 1 times per step" in text


def test_warning_points_at_the_caller_and_is_logged(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="batchfit"), pytest.warns(BatchNormWarning) as record:
        advice = warn_batchnorm(cnn(), 16, 64)
    assert record[0].filename == __file__
    assert str(record[0].message) == advice and advice in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_batchnorm(cnn(), 64, 64) is None


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, 2, (n,), generator=gen)


def test_trainer_warns_once_at_the_users_line() -> None:
    model = cnn()
    with pytest.warns(BatchNormWarning) as record:
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch_size=16,
                          micro_batch_size=4)
    assert len(record) == 1 and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.step(images(16))
        trainer.step(images(16))


def test_trainer_warns_when_a_replan_starts_accumulation() -> None:
    model = cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch_size=16,
                          micro_batch_size=16)
    calls = iter(range(100))

    def oom_once(model: nn.Module, batch: Any) -> torch.Tensor:
        if next(calls) == 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return loss_fn(model, batch)

    trainer.loss = oom_once
    with pytest.warns(BatchNormWarning, match="normalise over 8 items") as record:
        result = trainer.step(images(16))
    assert result.micro_batch_sizes == (8, 8) and record[0].filename == __file__
