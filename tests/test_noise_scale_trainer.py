"""The gradient noise scale measured during training: B_simple from the Trainer on a problem known in closed
form, the two norms it reads against plain autograd, and what it must not cost or change."""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny_models import IGNORE, VOCAB, mean_loss, mlp, token_loss, token_model
from torch import nn

import batchfit.train.accumulate as accumulate_module
from batchfit.advice.noise_scale import GradientNoiseScale, grad_sq_norm
from batchfit.batching import split_batch
from batchfit.errors import ConfigError
from batchfit.train.accumulate import Accumulator, micro_batch_sizes
from batchfit.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


# -- B_simple on linear regression ---------------------------------------------------------------------
# The closed form is derived in NOTE [ Noise scale of linear regression in closed form ] (test_noise_scale.py):
# x ~ N(0, I_d), y = x.w* + e, e ~ N(0, s2), per-item loss (x.w - y)^2 / 2 give |G|^2 = |w - w*|^2 and
# B_simple = (d + 1) + d s2 / |w - w*|^2.
DIM, NOISE_VAR = 10, 1.0


def _half_squared_error(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return 0.5 * (model(x).squeeze(1) - y).pow(2).mean()


def test_b_simple_from_the_trainer_is_within_15_percent_of_the_closed_form() -> None:
    gen = torch.Generator().manual_seed(0)
    w_star = torch.randn(DIM, generator=gen, dtype=torch.float64)
    model = nn.Linear(DIM, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + torch.randn(DIM, generator=gen, dtype=torch.float64) * 0.3)[None])
    d_sq = float((model.weight.detach()[0] - w_star).pow(2).sum())
    expected = (DIM + 1) + DIM * NOISE_VAR / d_sq  # ~ 27 with |w - w*|^2 ~ 0.6
    # lr=0: the parameters, hence the true noise scale, stay where they are while it is measured.
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        _half_squared_error,
        global_batch_size=256,
        micro_batch_size=64,
        noise_scale=GradientNoiseScale(ema_decay=0.999),
    )
    for _ in range(1000):
        x = torch.randn(256, DIM, generator=gen, dtype=torch.float64)  # (B, d), a fresh global batch each step
        y = x @ w_star + torch.randn(256, generator=gen, dtype=torch.float64) * math.sqrt(NOISE_VAR)
        result = trainer.step((x, y))
    gns = trainer.noise_scale
    assert gns is not None and gns.steps == 1000
    assert result.noise_scale == gns.b_simple and result.to_dict()["noise_scale"] == gns.b_simple
    assert abs(gns.b_simple - expected) / expected < 0.15, (gns.b_simple, expected)
    assert abs(gns.g_sq - d_sq) / d_sq < 0.15, (gns.g_sq, d_sq)


# -- the two norms, against plain autograd -----------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return mlp()


def _class_batch(seed: int, n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen)


def _token_model() -> nn.Module:
    torch.manual_seed(0)
    return token_model()


def _token_batch(seed: int, n: int = 10, t: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of lengths t..1: the first micro-batch holds more tokens than its share of the items."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (n, t), generator=gen)
    targets = torch.randint(0, VOCAB, (n, t), generator=gen)
    pad = torch.arange(t)[None, :] >= torch.linspace(t, 1, n).round().long()[:, None]
    return idx.masked_fill(pad, 0), targets.masked_fill(pad, IGNORE)


def _mean_grad_sq(model: nn.Module, loss: Callable, batch: Any) -> tuple[float, int]:
    """``|mean gradient|²`` over ``batch`` by plain autograd, and the count it is a mean over."""
    model.zero_grad(set_to_none=True)
    out = loss(model, batch)
    value, count = (out, batch[0].shape[0]) if isinstance(out, torch.Tensor) else (out[0] / out[1], int(out[1]))
    value.backward()
    sq = float(grad_sq_norm(model.parameters()))
    model.zero_grad(set_to_none=True)
    return sq, count


def _expected(model: nn.Module, loss: Callable, batch: Any, first: int) -> GradientNoiseScale:
    """The estimator fed by hand: the first ``first`` items against the whole batch."""
    small, small_n = _mean_grad_sq(model, loss, tuple(t[:first] for t in batch))
    big, big_n = _mean_grad_sq(model, loss, batch)
    gns = GradientNoiseScale(ema_decay=0.0)
    assert gns.update(small, small_n, big, big_n)
    return gns


def _assert_same(measured: GradientNoiseScale | None, expected: GradientNoiseScale, rel: float = 1e-9) -> None:
    assert measured is not None and measured.steps >= 1
    assert measured.g_sq == pytest.approx(expected.g_sq, rel=rel)
    assert measured.trace_sigma == pytest.approx(expected.trace_sigma, rel=rel)


@pytest.mark.parametrize("clip", [None, 1e-3], ids=["no-clip", "clipped"])
@pytest.mark.parametrize("form", ["mean", "tokens"])
def test_each_step_measures_the_first_micro_batch_against_the_window(form: str, clip: float | None) -> None:
    """With no smoothing, each step's estimate is exactly that of the two mean gradients' norms: the first
    micro-batch's undone from its weight (and, for tokens, from the previous step's count), the window's
    taken before clipping (a tiny ``max_grad_norm`` clips every step)."""
    make, loss, batch_of = (
        (_mlp, mean_loss, _class_batch) if form == "mean" else (_token_model, token_loss, _token_batch)
    )
    model = make()
    ref = copy.deepcopy(model)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss,
        global_batch_size=10,
        micro_batch_size=4,
        max_grad_norm=clip,
        noise_scale=GradientNoiseScale(ema_decay=0.0),
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for seed in range(3):  # later steps: token weights use the previous step's count, not the global batch
        batch = batch_of(seed)
        expected = _expected(ref, loss, batch, first=4)
        result = trainer.step(batch)
        assert result.micro_batch_sizes == (4, 3, 3)
        _assert_same(trainer.noise_scale, expected)
        out = loss(ref, batch)  # keep the reference on the trainer's parameters
        (out if isinstance(out, torch.Tensor) else out[0] / out[1]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("form", ["mean", "tokens"])
def test_under_a_fake_world_of_two_the_ranks_first_micro_batches_are_the_small_batch(
    monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """Two identical ranks: the small-batch terms ride the step's one all-reduce (which doubles them here),
    the big batch counts both ranks' items, and the gradient is each rank's own (no DDP to average)."""
    reduced: list[torch.Tensor] = []

    def fake_all_reduce(t: torch.Tensor) -> torch.Tensor:
        reduced.append(t.clone())
        return t.mul_(2)

    monkeypatch.setattr(accumulate_module, "distributed", lambda: True)
    monkeypatch.setattr(accumulate_module, "world_size", lambda: 2)
    monkeypatch.setattr(accumulate_module, "all_reduce_sum", fake_all_reduce)
    make, loss, batch_of = (
        (_mlp, mean_loss, _class_batch) if form == "mean" else (_token_model, token_loss, _token_batch)
    )
    model = make()
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        global_batch_size=20,
        noise_scale=GradientNoiseScale(ema_decay=0.0),
    )
    batch = batch_of(0)
    small, small_n = _mean_grad_sq(model, loss, tuple(t[:4] for t in batch))
    big, big_n = _mean_grad_sq(model, loss, batch)
    expected = GradientNoiseScale(ema_decay=0.0)
    expected.update(small, small_n, big, 2 * big_n)
    sizes = micro_batch_sizes(10, 4)
    for i, micro in enumerate(split_batch(batch, sizes)):
        with acc.accumulate(micro, last=i == len(sizes) - 1) as step:
            step.backward_weighted(loss(model, micro))
    acc.step()
    _assert_same(acc.noise_scale, expected)
    assert len(reduced) == 1 and reduced[0].shape == (5,)  # [loss_sum, n, |g|², 1/n, 1]: one all-reduce


def test_a_real_process_group_measures_what_one_process_does() -> None:
    """A one-process gloo group with DDP: the distributed path (no_sync, the all-reduce) gives the same."""
    batch = _token_batch(0)
    plain = _token_model()
    expected = Trainer(
        plain,
        torch.optim.SGD(plain.parameters(), lr=0.1),
        token_loss,
        global_batch_size=10,
        micro_batch_size=4,
        noise_scale=GradientNoiseScale(ema_decay=0.0),
    )
    expected.step(batch)
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp = trainer = None
    try:
        model = _token_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        trainer = Trainer(
            ddp,
            torch.optim.SGD(model.parameters(), lr=0.1),
            token_loss,
            global_batch_size=10,
            micro_batch_size=4,
            noise_scale=GradientNoiseScale(ema_decay=0.0),
        )
        result = trainer.step(batch)
        measured = trainer.noise_scale
    finally:
        del ddp, trainer  # the reducer before the group it holds (gloo can deadlock the other way round)
        dist.destroy_process_group()
    assert expected.noise_scale is not None
    _assert_same(measured, expected.noise_scale, rel=1e-12)
    assert result.noise_scale == pytest.approx(expected.noise_scale.b_simple, rel=1e-12)


# -- what is not measured ---------------------------------------------------------------------------------
def test_a_window_of_one_micro_batch_measures_nothing() -> None:
    model = _mlp()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), mean_loss, global_batch_size=10, micro_batch_size=10
    )
    result = trainer.step(_class_batch(0))
    assert result.noise_scale is None and trainer.noise_scale is not None and trainer.noise_scale.steps == 0
    assert "not measured yet" in trainer.noise_scale.recommendation(10)


def test_fp16_steps_are_unscaled_and_skipped_ones_ignored() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mean_loss,
        global_batch_size=10,
        micro_batch_size=5,
        precision="fp16",
        noise_scale=GradientNoiseScale(ema_decay=0.0),
    )
    scaler = trainer.accumulator.grad_scaler
    assert scaler is not None
    x, y = _class_batch(0)
    x = x.float()

    def fp16_loss(m: nn.Module, b: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return mean_loss(m, b)

    expected = _expected(ref, fp16_loss, (x, y), first=5)
    good = trainer.step((x, y))
    assert not good.skipped and scaler.get_scale() > 1  # the gradients were read scaled by 65536
    _assert_same(trainer.noise_scale, expected, rel=1e-3)  # fp16 gradients: rounding, not 65536x off
    measured = copy.deepcopy(trainer.noise_scale)
    bad = trainer.step((torch.full_like(x, 1e6), y))  # overflows fp16: inf/NaN gradients, the step is skipped
    assert bad.skipped
    assert trainer.noise_scale.steps == 1 and trainer.noise_scale.to_dict() == measured.to_dict()
    assert bad.noise_scale == good.noise_scale


def test_noise_scale_off_and_bad_values() -> None:
    model = _mlp()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mean_loss,
        global_batch_size=10,
        micro_batch_size=4,
        noise_scale=False,
    )
    result = trainer.step(_class_batch(0))
    assert trainer.noise_scale is None and result.noise_scale is None and result.to_dict()["noise_scale"] is None
    with pytest.raises(ConfigError, match="noise_scale must be True, False or a GradientNoiseScale"):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            mean_loss,
            global_batch_size=10,
            micro_batch_size=4,
            noise_scale=0.99,
        )  # type: ignore[arg-type]


# -- what it must not cost or change --------------------------------------------------------------------------
def _count_host_reads(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Count the ways Python code reads a tensor's value back to the host."""
    calls: collections.Counter = collections.Counter()
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clipped"])
def test_measuring_adds_no_host_read(monkeypatch: pytest.MonkeyPatch, clip: float | None) -> None:
    counts = {}
    for on in (False, True):
        model = _mlp()
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),  # Adam's step reads its step count
            mean_loss,
            global_batch_size=10,
            micro_batch_size=4,
            max_grad_norm=clip,
            noise_scale=on,
        )
        trainer.step(_class_batch(0))  # the first step creates the momentum buffers
        with monkeypatch.context() as patch:
            calls = _count_host_reads(patch)
            trainer.step(_class_batch(1))
        counts[on] = dict(calls)
        assert (trainer.noise_scale is not None and trainer.noise_scale.steps == 2) == on
    # One read per step: the losses, the clipping norm and both noise-scale norms come back together.
    assert counts[True] == counts[False] == {"tolist": 1}, counts


@pytest.mark.parametrize("form", ["mean", "tokens"])
def test_the_trained_parameters_do_not_change(form: str) -> None:
    make, loss, batch_of = (
        (_mlp, mean_loss, _class_batch) if form == "mean" else (_token_model, token_loss, _token_batch)
    )
    params = {}
    for on in (False, True):
        model = make()
        trainer = Trainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            loss,
            global_batch_size=10,
            micro_batch_size=3,
            max_grad_norm=0.5,
            noise_scale=on,
        )
        losses = [trainer.step(batch_of(seed)).loss for seed in range(4)]
        params[on] = ([p.detach().clone() for p in model.parameters()], losses)
    assert all(torch.equal(a, b) for a, b in zip(params[False][0], params[True][0]))
    assert params[False][1] == params[True][1]
