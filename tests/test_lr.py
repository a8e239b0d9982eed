"""Learning-rate scaling rules and the warm-up schedule, with exact expected values."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from batchfit import ConfigError
from batchfit.advice.lr import (
    LrScaling,
    is_adam_type,
    lr_scaling,
    optimizer_class_of,
    resolve_rule,
    scale_lr,
    warmup_schedule,
)


def _opt(cls: type, **kw) -> torch.optim.Optimizer:
    return cls([torch.nn.Parameter(torch.zeros(1))], **kw)


def test_linear_rule_multiplies_by_the_batch_ratio() -> None:
    assert scale_lr(0.1, 256, 1024, rule="linear") == 0.4
    assert scale_lr(0.1, 256, 8192, rule="linear") == 3.2  # Goyal et al. 2017, ResNet-50 at 8k
    assert scale_lr(0.4, 1024, 256, rule="linear") == 0.1  # scaling down works the same way
    assert scale_lr(0.1, 256, 256, rule="linear") == 0.1


def test_sqrt_rule_multiplies_by_the_square_root_of_the_ratio() -> None:
    assert scale_lr(1e-3, 256, 1024, rule="sqrt") == 2e-3
    assert scale_lr(3e-4, 64, 576, rule="sqrt") == pytest.approx(9e-4, rel=1e-15)
    assert scale_lr(1e-3, 100, 200, rule="sqrt") == 1e-3 * math.sqrt(2)


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (_opt(torch.optim.AdamW), 2e-3),
        (torch.optim.Adam, 2e-3),
        ("adamw", 2e-3),
        ("NAdam", 2e-3),
        (torch.optim.RMSprop, 2e-3),
        (partial(torch.optim.AdamW, lr=1e-3), 2e-3),
        (_opt(torch.optim.SGD, lr=0.1), 4e-3),
        ("sgd", 4e-3),
        (torch.optim.Adagrad, 4e-3),
    ],
)
def test_auto_picks_sqrt_for_adam_type_and_linear_otherwise(optimizer, expected) -> None:
    assert scale_lr(1e-3, 256, 1024, optimizer=optimizer) == pytest.approx(expected, rel=1e-15)


def test_a_subclass_of_adamw_is_adam_type() -> None:
    class MyOptimizer(torch.optim.AdamW):
        pass

    assert is_adam_type(MyOptimizer)
    assert is_adam_type(_opt(MyOptimizer))
    assert not is_adam_type(torch.optim.SGD)


def test_auto_without_an_optimizer_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="needs the optimizer: pass optimizer="):
        scale_lr(1e-3, 256, 1024)
    with pytest.raises(ConfigError, match="unknown learning-rate rule"):
        scale_lr(1e-3, 256, 1024, rule="cubic")
    with pytest.raises(ConfigError, match="optimizer must be"):
        scale_lr(1e-3, 256, 1024, optimizer=3)


@pytest.mark.parametrize(
    "args", [(0.0, 256, 512), (-1e-3, 256, 512), (1e-3, 0, 512), (1e-3, 256, 0), (1e-3, 256.0, 512), (True, 2, 4)]
)
def test_bad_inputs_raise(args) -> None:
    with pytest.raises(ConfigError):
        scale_lr(*args, rule="linear")


def test_lr_scaling_resolves_a_workload_factory() -> None:
    def factory(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    assert optimizer_class_of(factory) is torch.optim.SGD
    assert optimizer_class_of(partial(torch.optim.AdamW, lr=1e-3)) is torch.optim.AdamW
    s = lr_scaling(0.1, 256, 1024, optimizer=factory)
    assert s == LrScaling(0.1, 256, 1024, "linear", "SGD", 0.4)
    text = s.describe()
    assert "lr 0.4 for a global batch of 1024" in text and "linear rule" in text and "x4" in text
    assert resolve_rule("sqrt") == "sqrt"


def _lrs(opt: torch.optim.Optimizer, sched, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(round(opt.param_groups[0]["lr"], 12))
        opt.step()
        sched.step()
    return out


def test_warmup_rises_linearly_then_holds() -> None:
    opt = _opt(torch.optim.SGD, lr=0.4)
    assert _lrs(opt, warmup_schedule(opt, 4, start_factor=0.25), 6) == [0.1, 0.175, 0.25, 0.325, 0.4, 0.4]
    opt = _opt(torch.optim.SGD, lr=1.0)
    assert _lrs(opt, warmup_schedule(opt, 4), 5) == [0.25, 0.4375, 0.625, 0.8125, 1.0]
    opt = _opt(torch.optim.SGD, lr=1.0)
    assert _lrs(opt, warmup_schedule(opt, 0), 2) == [1.0, 1.0]


def test_warmup_then_follows_the_given_decay() -> None:
    opt = _opt(torch.optim.SGD, lr=1.0)
    sched = warmup_schedule(opt, 2, start_factor=0.5, after=lambda s: 0.5**s)
    assert _lrs(opt, sched, 5) == [0.5, 0.75, 1.0, 0.5, 0.25]


@pytest.mark.parametrize(
    "kw", [{"warmup_steps": -1}, {"warmup_steps": 3, "start_factor": 0.0}, {"warmup_steps": 3, "start_factor": 1.5}]
)
def test_bad_warmup_raises(kw) -> None:
    with pytest.raises(ConfigError):
        warmup_schedule(_opt(torch.optim.SGD, lr=0.1), **kw)
