"""A user's own workload, loaded by ``batchfit.presets.load("tests.user_workload:make")`` in the tests."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from batchfit import Workload


def _batch(b: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, width), torch.randint(0, 2, (b,))  # (b, width), (b,)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def make(width: int = 4) -> Workload:
    """A linear classifier over ``width`` features."""
    return Workload(
        model=partial(nn.Linear, width, 2),
        batch=partial(_batch, width=width),
        loss=_loss,
        name="user-linear",
        config={"width": width},
    )


def not_a_workload() -> int:
    """Returns something else, to test the error."""
    return 3


WORKLOAD = make()
NUMBER = 7
