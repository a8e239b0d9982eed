"""The gradient noise scale: the estimator's arithmetic, and B_simple on a problem known in closed form."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from batchfit import ConfigError
from batchfit.advice.noise_scale import GradientNoiseScale, grad_sq_norm

# NOTE [ Noise scale of linear regression in closed form ]
# x ~ N(0, I_d), y = x.w* + e, e ~ N(0, s2), per-item loss l = (x.w - y)^2 / 2. With d = w - w*, the
# per-item gradient is g = x (x.d - e), so G = E[g] = d and |G|^2 = |d|^2. By Isserlis' theorem
# E[(x.d)^2 x x^T] = |d|^2 I + 2 d d^T, so E[g g^T] = |d|^2 I + 2 d d^T + s2 I and
# tr(Sigma) = tr(E[g g^T]) - |G|^2 = (d + 1) |d|^2 + d s2 (d the dimension), hence
# B_simple = (dim + 1) + dim s2 / |d|^2.
DIM, NOISE_VAR = 10, 1.0


def _true_b_simple(delta: torch.Tensor) -> float:
    d_sq = float(delta.pow(2).sum())
    return (DIM + 1) + DIM * NOISE_VAR / d_sq


def test_b_simple_of_linear_regression_is_within_15_percent_of_the_closed_form() -> None:
    gen = torch.Generator().manual_seed(0)
    w_star = torch.randn(DIM, generator=gen, dtype=torch.float64)
    model = nn.Linear(DIM, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + torch.randn(DIM, generator=gen, dtype=torch.float64) * 0.3)[None])
    delta = model.weight.detach()[0] - w_star
    expected = _true_b_simple(delta)  # ~ 27 with |d|^2 ~ 0.6: between the two batches

    small_batch, big_batch = 16, 256  # a window of 16 micro-batches of 16, as accumulation sees it
    gns = GradientNoiseScale(ema_decay=0.995)
    for _ in range(1500):
        x = torch.randn(big_batch, DIM, generator=gen, dtype=torch.float64)  # (B, d)
        y = x @ w_star + torch.randn(big_batch, generator=gen, dtype=torch.float64) * math.sqrt(NOISE_VAR)
        # The first micro-batch's mean gradient, then the whole window's, both through autograd.
        model.zero_grad(set_to_none=True)
        (0.5 * (model(x[:small_batch]).squeeze(1) - y[:small_batch]).pow(2).mean()).backward()
        small = float(grad_sq_norm(model.parameters()))
        model.zero_grad(set_to_none=True)
        (0.5 * (model(x).squeeze(1) - y).pow(2).mean()).backward()
        big = float(grad_sq_norm(model.parameters()))
        assert gns.update(small, small_batch, big, big_batch)
    assert gns.b_simple is not None
    assert abs(gns.b_simple - expected) / expected < 0.15, (gns.b_simple, expected)
    assert abs(gns.g_sq - float(delta.pow(2).sum())) / float(delta.pow(2).sum()) < 0.15


def test_the_arithmetic_of_one_update() -> None:
    gns = GradientNoiseScale(ema_decay=0.0)
    assert gns.b_simple is None and gns.g_sq is None
    # |G|^2 = 1, tr(Sigma) = 16: E|G_8|^2 = 1 + 16/8 = 3, E|G_64|^2 = 1 + 16/64 = 1.25.
    assert gns.update(3.0, 8, 1.25, 64)
    assert gns.g_sq == pytest.approx(1.0)
    assert gns.trace_sigma == pytest.approx(16.0)
    assert gns.b_simple == pytest.approx(16.0)
    assert gns.to_dict()["steps"] == 1


def test_moving_averages_are_bias_corrected_and_tensors_are_accepted() -> None:
    gns = GradientNoiseScale(ema_decay=0.9)
    gns.update(torch.tensor(3.0, dtype=torch.float64), 8, torch.tensor(1.25), 64)
    assert gns.g_sq == pytest.approx(1.0)  # not 0.1: the first average is corrected by 1 - 0.9
    gns.update(5.0, 8, 1.5, 64)  # |G|^2 = 1, tr = 32 on its own
    assert gns.g_sq == pytest.approx(1.0)
    assert gns.trace_sigma == pytest.approx((0.9 * 0.1 * 16 + 0.1 * 32) / (1 - 0.81))


def test_skipped_steps_are_ignored() -> None:
    gns = GradientNoiseScale()
    assert not gns.update(math.inf, 8, 1.0, 64)
    assert not gns.update(1.0, 8, math.nan, 64)
    assert gns.steps == 0 and gns.b_simple is None


@pytest.mark.parametrize(
    ("args", "match"),
    [((1.0, 8, 1.0, 8), "smaller than big_batch"), ((1.0, 0, 1.0, 8), "small_batch"), ((-1.0, 4, 1.0, 8), "negative")],
)
def test_bad_updates_raise(args, match) -> None:
    with pytest.raises(ConfigError, match=match):
        GradientNoiseScale().update(*args)


def test_bad_decay_raises() -> None:
    with pytest.raises(ConfigError, match="ema_decay"):
        GradientNoiseScale(ema_decay=1.0)


def test_grad_sq_norm_sums_every_gradient_without_copying() -> None:
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(2, 2))
    c = nn.Parameter(torch.zeros(1))  # no gradient: skipped
    a.grad = torch.tensor([1.0, 2.0, 2.0])
    b.grad = torch.full((2, 2), 0.5)
    out = grad_sq_norm([a, b, c])
    assert out.dtype == torch.float64 and out.dim() == 0
    assert float(out) == pytest.approx(9.0 + 1.0)
    assert float(grad_sq_norm([c])) == 0.0


def test_recommendations_state_the_ratio_and_the_change() -> None:
    gns = GradientNoiseScale(ema_decay=0.0)
    assert "not measured yet" in gns.recommendation(512)
    gns.update(3.0, 8, 1.25, 64)  # B_simple = 16
    large = gns.recommendation(512)
    assert "32x the critical batch" in large and "--global-batch-size 16" in large
    small = gns.recommendation(4)
    assert "0.25x" in small and "raise --global-batch-size towards 16" in small
    assert "keep it" in gns.recommendation(16)
    unresolved = GradientNoiseScale(ema_decay=0.0)
    unresolved.update(1.0, 8, 1.01, 64)  # |G|^2 estimate > 0 but tr < 0: not resolved
    assert unresolved.b_simple is None
    assert "not resolved" in unresolved.recommendation(64)
    with pytest.raises(ConfigError):
        gns.recommendation(0)
