"""Exact gradient accumulation: Trainer and Accumulator against one plain full-batch step, in float64."""

from __future__ import annotations

import contextlib
import doctest
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import IGNORE, VOCAB, mean_loss, mlp, token_loss, token_model
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import batchfit.train.accumulate as accumulate_module
from batchfit.batching import split_batch
from batchfit.errors import ConfigError
from batchfit.planning.fit import fit
from batchfit.runtime.simulated import SimulatedDevice
from batchfit.train.accumulate import Accumulator, StepResult, micro_batch_sizes
from batchfit.train.trainer import Trainer
from batchfit.workload import Workload

G = 10  # global batch
STEPS = 4


pytestmark = pytest.mark.usefixtures("one_thread")


# -- workloads ------------------------------------------------------------------------------------------
def class_batches(steps: int = STEPS, n: int = G) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen))
        for _ in range(steps)
    ]


def token_batches(steps: int = STEPS, n: int = G, t: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of lengths 1..t: later micro-batches hold far fewer real tokens than earlier ones."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (n, t), generator=gen)
        targets = torch.randint(0, VOCAB, (n, t), generator=gen)
        lengths = torch.linspace(t, 1, n).round().long()  # long first, short last
        pad = torch.arange(t)[None, :] >= lengths[:, None]
        out.append((idx.masked_fill(pad, 0), targets.masked_fill(pad, IGNORE)))
    return out


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def build(make_model: Callable[[], nn.Module], opt: str, scheduled: bool) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = make_model()
    optimizer = OPTIMIZERS[opt](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7) if scheduled else None
    return model, optimizer, scheduler


def reference(
    model: nn.Module, optimizer: Any, scheduler: Any, batches: list, loss: Callable, clip: float | None
) -> list[float]:
    """One plain full-batch step per batch: forward of everything, loss, backward, clip, step, schedule."""
    losses = []
    for batch in batches:
        out = loss(model, batch)
        value = out if isinstance(out, torch.Tensor) else out[0] / out[1]
        value.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(value.item())
    return losses


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest over tensors of max|a - b| / max|b|."""
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a.parameters(), b.parameters()))


# -- the split rule -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "micro", "expected"),
    [(10, 4, [4, 3, 3]), (10, 5, [5, 5]), (10, 3, [3, 3, 2, 2]), (10, 10, [10]), (10, 1, [1] * 10), (3, 8, [3])],
)
def test_micro_batch_sizes_rule(n: int, micro: int, expected: list[int]) -> None:
    assert micro_batch_sizes(n, micro) == expected


@given(st.integers(1, 500), st.integers(1, 64))
def test_micro_batch_sizes_properties(n: int, micro: int) -> None:
    sizes = micro_batch_sizes(n, micro)
    assert sum(sizes) == n
    assert max(sizes) <= micro and max(sizes) - min(sizes) <= 1
    assert len(sizes) == -(-n // micro)
    assert sizes == sorted(sizes, reverse=True)


# -- exactness --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("micro", [10, 5, 4, 3, 1])  # one window, even, uneven [4,3,3], uneven [3,3,2,2], ones
@pytest.mark.parametrize(("clip", "scheduled"), [(None, False), (0.05, True)])
def test_trainer_equals_full_batch_step(opt: str, micro: int, clip: float | None, scheduled: bool) -> None:
    batches = class_batches()
    ref_model, ref_opt, ref_sched = build(mlp, opt, scheduled)
    ref_losses = reference(ref_model, ref_opt, ref_sched, batches, mean_loss, clip)
    model, optimizer, scheduler = build(mlp, opt, scheduled)
    trainer = Trainer(
        model, optimizer, mean_loss, global_batch_size=G, micro_batch_size=micro, max_grad_norm=clip,
        scheduler=scheduler,
    )
    results = [trainer.step(b) for b in batches]
    assert max_rel_diff(model, ref_model) <= 1e-12
    for result, expected in zip(results, ref_losses):
        assert abs(result.loss - expected) <= 1e-12 * abs(expected)
        assert result.n_items == G
        assert result.micro_batch_sizes == tuple(micro_batch_sizes(G, micro))
        assert result.accumulation_steps == len(result.micro_batch_sizes)
        assert (result.grad_norm is not None) == (clip is not None)
    assert [r.step for r in results] == list(range(STEPS))
    if clip is not None:  # the clip really bit: the norm was above it
        assert all(r.grad_norm > clip for r in results)
    assert optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


@pytest.mark.parametrize("opt", ["sgd-momentum", "adamw"])
@pytest.mark.parametrize("micro", [5, 4, 3, 1])
def test_token_loss_with_padding_equals_full_batch(opt: str, micro: int) -> None:
    batches = token_batches()
    ref_model, ref_opt, ref_sched = build(token_model, opt, True)
    model, optimizer, scheduler = build(token_model, opt, True)
    ref_losses = reference(ref_model, ref_opt, ref_sched, batches, token_loss, 0.5)
    trainer = Trainer(
        model, optimizer, token_loss, global_batch_size=G, micro_batch_size=micro, max_grad_norm=0.5,
        scheduler=scheduler,
    )
    results = [trainer.step(b) for b in batches]
    assert max_rel_diff(model, ref_model) <= 1e-12
    for result, expected, (_, targets) in zip(results, ref_losses, batches):
        assert abs(result.loss - expected) <= 1e-12 * abs(expected)
        assert result.n_items == int((targets != IGNORE).sum())  # tokens, not sequences


def test_token_gradients_stay_at_the_size_of_a_mean_while_accumulating() -> None:
    """NOTE [ Dividing by a count known only at the end ]: each micro-batch backpropagates loss_sum / N_prev,
    N_prev the previous step's token count (the global batch's item count on the first step)."""
    seeds: list[float] = []

    def loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        total, count = token_loss(model, batch)
        total.register_hook(lambda g: seeds.append(g.item()))
        return total, count

    model, optimizer, _ = build(token_model, "adam", False)
    trainer = Trainer(model, optimizer, loss, global_batch_size=G, micro_batch_size=4)
    first, second = token_batches(2)
    n_first = trainer.step(first).n_items
    trainer.step(second)
    assert seeds == [1 / G] * 3 + [1 / n_first] * 3


def test_mean_of_micro_batch_means_is_not_the_global_loss() -> None:
    """The usual mistake the token test guards against: its batches are uneven enough to show it."""
    (idx, targets), = token_batches(steps=1)
    torch.manual_seed(0)
    model = token_model()
    total, count = token_loss(model, (idx, targets))
    pieces = split_batch((idx, targets), micro_batch_sizes(G, 4))
    naive = sum(s / c for s, c in (token_loss(model, p) for p in pieces)) / len(pieces)
    assert abs(naive.item() - (total / count).item()) > 1e-3


def test_dict_and_plain_tensor_batches() -> None:
    (x, y), = class_batches(1)
    ref_model, ref_opt, _ = build(mlp, "adam", False)
    reference(ref_model, ref_opt, None, [(x, y)], mean_loss, None)
    model, optimizer, _ = build(mlp, "adam", False)
    as_dict = Trainer(model, optimizer, lambda m, b: mean_loss(m, (b["x"], b["y"])), global_batch_size=G,
                      micro_batch_size=4)
    assert as_dict.step({"x": x, "y": y}).micro_batch_sizes == (4, 3, 3)
    assert max_rel_diff(model, ref_model) <= 1e-12

    def energy(m: nn.Module, inputs: torch.Tensor) -> torch.Tensor:  # a batch that is a single tensor
        return (m(inputs) ** 2).mean()

    ref_model, ref_opt, _ = build(mlp, "sgd-momentum", False)
    reference(ref_model, ref_opt, None, [x], energy, None)
    model, optimizer, _ = build(mlp, "sgd-momentum", False)
    trainer = Trainer(model, optimizer, energy, global_batch_size=G, micro_batch_size=3)
    assert trainer.step(x).micro_batch_sizes == (3, 3, 2, 2)
    assert max_rel_diff(model, ref_model) <= 1e-12


def test_accumulator_in_a_users_own_loop() -> None:
    batches = class_batches()
    ref_model, ref_opt, _ = build(mlp, "adam", False)
    reference(ref_model, ref_opt, None, batches, mean_loss, 1.0)
    model, optimizer, _ = build(mlp, "adam", False)
    acc = Accumulator(model, optimizer, global_batch_size=G, max_grad_norm=1.0)
    for batch in batches:
        sizes = micro_batch_sizes(G, 3)
        for i, micro in enumerate(split_batch(batch, sizes)):
            with acc.accumulate(micro, last=i == len(sizes) - 1) as step:
                step.backward_weighted(mean_loss(model, micro))
        result = acc.step()
        assert isinstance(result, StepResult) and result.micro_batch_sizes == (3, 3, 2, 2)
        assert all(p.grad is None for p in model.parameters())  # freed after the step
    assert max_rel_diff(model, ref_model) <= 1e-12


# -- synchronisation -------------------------------------------------------------------------------------
class SyncSpy(nn.Module):
    """A stand-in for DDP: counts ``no_sync`` entries and records whether each backward would sync."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.synced: list[bool] = []
        self._sync = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.synced.append(self._sync)
        return self.module(x)


def test_gradients_sync_only_on_the_last_micro_batch() -> None:
    model, optimizer, _ = build(mlp, "sgd-momentum", False)
    spy = SyncSpy(model)
    trainer = Trainer(spy, optimizer, mean_loss, global_batch_size=G, micro_batch_size=3)
    trainer.step(class_batches(1)[0])
    assert spy.synced == [False, False, False, True]


def test_ddp_on_a_one_process_gloo_group(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp = trainer = None
    try:
        reduced: list[torch.Tensor] = []
        real = dist.all_reduce

        def spy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reduced.append(t.clone())
            return real(t, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", spy)
        batches = token_batches(2)
        ref_model, ref_opt, _ = build(token_model, "adamw", False)
        model, optimizer, _ = build(token_model, "adamw", False)
        reference(ref_model, ref_opt, None, batches, token_loss, None)
        ddp = nn.parallel.DistributedDataParallel(model)
        trainer = Trainer(ddp, optimizer, token_loss, global_batch_size=G, micro_batch_size=4)
        for batch in batches:
            trainer.step(batch)
        assert max_rel_diff(model, ref_model) <= 1e-12
        assert len(reduced) == 2  # [loss_sum, n_tokens], once per step
        assert reduced[0][1].item() == (batches[0][1] != IGNORE).sum().item()
    finally:
        # DDP's reducer holds the group: gloo can deadlock destroying a group's last holder after
        # destroy_process_group, so the reducer goes first.
        del ddp, trainer
        dist.destroy_process_group()


@pytest.mark.parametrize("loss", [mean_loss, token_loss], ids=["mean", "tokens"])
def test_two_identical_ranks_give_the_single_process_result(monkeypatch: pytest.MonkeyPatch, loss: Callable) -> None:
    """A fake world of 2 whose other rank holds the same share: counts and loss sums double, the
    gradient (which DDP would average over the two equal ranks) must not change."""
    monkeypatch.setattr(accumulate_module, "distributed", lambda: True)
    monkeypatch.setattr(accumulate_module, "world_size", lambda: 2)
    monkeypatch.setattr(accumulate_module, "all_reduce_sum", lambda t: t.mul_(2))
    make, batches = (mlp, class_batches()) if loss is mean_loss else (token_model, token_batches())
    ref_model, ref_opt, _ = build(make, "adam", False)
    model, optimizer, _ = build(make, "adam", False)
    ref_losses = reference(ref_model, ref_opt, None, batches, loss, None)
    acc = Accumulator(model, optimizer, global_batch_size=2 * G)
    for batch, expected in zip(batches, ref_losses):
        sizes = micro_batch_sizes(G, 4)
        for i, micro in enumerate(split_batch(batch, sizes)):
            with acc.accumulate(micro, last=i == len(sizes) - 1) as step:
                step.backward_weighted(loss(model, micro))
        result = acc.step()
        assert abs(result.loss - expected) <= 1e-12 * abs(expected)
    assert max_rel_diff(model, ref_model) <= 1e-12


# -- precision ---------------------------------------------------------------------------------------------
def test_bf16_autocasts_the_forward_only() -> None:
    seen: list[tuple[bool, torch.dtype]] = []

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        logits = model(batch[0])
        seen.append((torch.is_autocast_enabled("cpu"), logits.dtype))
        return F.cross_entropy(logits.float(), batch[1])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, global_batch_size=G,
                      micro_batch_size=5, precision="bf16")
    x, y = class_batches(1)[0]
    result = trainer.step((x.float(), y))
    assert seen == [(True, torch.bfloat16)] * 2
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.isfinite(torch.tensor(result.loss)) and not result.skipped


def test_fp16_unscales_before_clipping_and_reports_skipped_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    trainer = Trainer(model, optimizer, mean_loss, global_batch_size=G, micro_batch_size=G, precision="fp16",
                      max_grad_norm=100.0, scheduler=scheduler)
    assert trainer.accumulator.grad_scaler is not None
    x, y = class_batches(1)[0]
    x = x.float()
    ref = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    ref.load_state_dict(model.state_dict())
    with torch.autocast("cpu", dtype=torch.float16):
        ref_loss = mean_loss(ref, (x, y))
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 100.0).item()
    good = trainer.step((x, y))
    assert not good.skipped and good.grad_norm == pytest.approx(ref_norm, rel=1e-3)  # unscaled: ~1, not ~65536
    before = [p.detach().clone() for p in model.parameters()]
    lr = optimizer.param_groups[0]["lr"]
    bad = trainer.step((torch.full_like(x, 1e6), y))  # overflows fp16: inf/NaN gradients
    assert bad.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer.param_groups[0]["lr"] == lr  # the scheduler does not step past a skipped step


# -- micro_batch_size="auto" ---------------------------------------------------------------------------------
def _fake_plan_module(calls: list[dict[str, Any]], splits: list[list[int]], **fields: Any) -> types.ModuleType:
    module = types.ModuleType("batchfit.planning.plan")

    def plan(workload: Any, global_batch_size: int, **kwargs: Any) -> Any:
        with FakeTensorMode():
            batch = workload.batch(7)
            optimizer = workload.optimizer(list(workload.build_model().parameters()))
        calls.append({"workload": workload, "batch": batch, "optimizer": optimizer, "G": global_batch_size, **kwargs})
        return types.SimpleNamespace(micro_batch_size=max(max(s) for s in splits), splits=splits, **fields)

    module.plan = plan  # type: ignore[attr-defined]
    return module


def test_auto_micro_batch_comes_from_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "batchfit.planning.plan", _fake_plan_module(calls, [[2, 3, 2, 3]]))
    model, optimizer, _ = build(mlp, "adamw", False)
    with SimulatedDevice("1GiB") as gpu:
        trainer = Trainer(model, optimizer, mean_loss, global_batch_size=G, device=gpu, precision="fp32")
        assert trainer.micro_batch_size is None
        result = trainer.step(class_batches(1)[0])
    (call,) = calls
    assert call["G"] == G and call["gpus"] == 1 and call["precision"] == "fp32" and call["device"] is gpu.device
    x, y = call["batch"]
    assert x.shape == (7, 6) and x.dtype == torch.float64 and y.shape == (7,) and y.dtype == torch.int64
    assert type(call["optimizer"]) is torch.optim.AdamW and call["optimizer"].defaults["weight_decay"] == 0.1
    assert result.micro_batch_sizes == (2, 3, 2, 3)  # the plan's split, executed as planned
    assert trainer.micro_batch_size == 3 and trainer.plan.splits == [[2, 3, 2, 3]]


def test_auto_on_the_plain_cpu_runs_the_share_as_one_micro_batch() -> None:
    model, optimizer, _ = build(mlp, "sgd-momentum", False)
    result = Trainer(model, optimizer, mean_loss, global_batch_size=G).step(class_batches(1)[0])
    assert result.micro_batch_sizes == (G,)


def test_sharding_is_nothing_to_do_on_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sharded=True`` (or a plan that shards) on a single process trains exactly as without it."""
    batch = class_batches(1)[0]
    results = []
    for sharded in (False, True):
        monkeypatch.setitem(sys.modules, "batchfit.planning.plan", _fake_plan_module([], [[5, 5]], sharded=sharded))
        model, optimizer, _ = build(mlp, "sgd-momentum", False)
        with SimulatedDevice("1GiB") as gpu:
            trainer = Trainer(model, optimizer, mean_loss, global_batch_size=G, device=gpu, sharded=sharded)
            result = trainer.step(batch)
        assert not trainer.sharded and result.micro_batch_sizes == (5, 5)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_auto_with_the_real_plan_on_a_simulated_gpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(2048, 64), torch.randint(0, 10, (2048,)))
    with SimulatedDevice("48MiB") as gpu:
        trainer = Trainer(model, optimizer, mean_loss, global_batch_size=2048, device=gpu)
        result = trainer.step(batch)
    assert result.micro_batch_size == trainer.plan.micro_batch_size < 2048
    assert list(result.micro_batch_sizes) == trainer.plan.splits[0] and not result.replanned


def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def test_auto_plans_for_the_gradients_alive_through_the_window() -> None:
    """A micro-batch sized by a plain step runs out of memory in the window; the plan's does not."""
    wl = Workload(
        model=_wide_mlp,
        batch=lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))),
        loss=mean_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    data = [wl.batch(4096) for _ in range(2)]  # the second step has AdamW's states on the device too

    def run(micro: Any) -> tuple[Trainer, list[StepResult]]:
        with SimulatedDevice("80MiB") as gpu:
            model = _wide_mlp()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            trainer = Trainer(model, optimizer, mean_loss, global_batch_size=4096, micro_batch_size=micro,
                              device=gpu, workload=wl)  # fmt: skip
            return trainer, [trainer.step(b) for b in data]

    plain = fit(wl, SimulatedDevice("80MiB").device).max_batch_size  # what fits one plain step
    _, results = run(plain)
    assert any(r.replanned and r.replanned[0].phase == "backward" for r in results)
    trainer, results = run("auto")
    assert trainer.micro_batch_size < plain
    assert trainer.plan.estimate.accumulation_steps == trainer.plan.accumulation_steps > 1
    assert all(not r.replanned and list(r.micro_batch_sizes) == trainer.plan.splits[0] for r in results)


# -- bad input -------------------------------------------------------------------------------------------------
def _trainer(**kwargs: Any) -> Trainer:
    model, optimizer, _ = build(mlp, "sgd-momentum", False)
    args: dict[str, Any] = {"global_batch_size": G, "micro_batch_size": 4, **kwargs}
    loss = args.pop("loss", mean_loss)
    return Trainer(model, optimizer, loss, **args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch_size": 0}, "global_batch_size must be a whole number >= 1, got 0"),
        ({"global_batch_size": -3}, "global_batch_size must be a whole number >= 1, got -3"),
        ({"micro_batch_size": 11}, "micro_batch_size 11 exceeds global_batch_size 10; use at most 10"),
        ({"micro_batch_size": 0}, "micro_batch_size must be 'auto' or a whole number >= 1, got 0"),
        ({"micro_batch_size": "big"}, "micro_batch_size must be 'auto'"),
        ({"max_grad_norm": 0.0}, "max_grad_norm must be a positive finite number or None, got 0.0"),
        ({"max_grad_norm": -1.0}, "max_grad_norm must be a positive finite number"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm must be a positive finite number"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"device": "tpu"}, "device must be 'cpu', 'cuda', 'cuda:N' or a SimulatedDevice"),
    ],
)
def test_bad_settings_raise_one_config_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        _trainer(**kwargs)


def test_batch_tensors_disagreeing_on_the_leading_dimension() -> None:
    x, y = class_batches(1)[0]
    with pytest.raises(ConfigError, match=r"disagree on the leading \(batch\) dimension: \[9, 10\]"):
        _trainer().step((x, y[:9]))


def test_a_share_of_the_wrong_size() -> None:
    x, y = class_batches(1, n=12)[0]
    with pytest.raises(ConfigError, match="got a batch of 12 items, expected 10"):
        _trainer().step((x, y))


@pytest.mark.parametrize(
    "bad",
    [lambda m, b: 1.5, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"), lambda m, b: {"loss": 1}],
    ids=["float", "per-item tensor", "dict"],
)
def test_a_loss_of_neither_form(bad: Callable) -> None:
    with pytest.raises(ConfigError, match=r"scalar float tensor .* or a tuple \(loss_sum, n_items\)"):
        _trainer(loss=bad).step(class_batches(1)[0])


def test_mixing_loss_forms_within_a_window() -> None:
    calls = iter(range(100))

    def flip(model: nn.Module, batch: Any) -> Any:
        value = mean_loss(model, batch)
        return value if next(calls) % 2 == 0 else (value * batch[1].shape[0], batch[1].shape[0])

    with pytest.raises(ConfigError, match="same form for every micro-batch"):
        _trainer(loss=flip).step(class_batches(1)[0])


def test_accumulator_misuse() -> None:
    model, optimizer, _ = build(mlp, "sgd-momentum", False)
    acc = Accumulator(model, optimizer, global_batch_size=G)
    with pytest.raises(ConfigError, match="at least one micro-batch"):
        acc.step()
    x, y = class_batches(1)[0]
    with pytest.raises(ConfigError, match="call backward_weighted"):
        with acc.accumulate((x, y), last=True):
            mean_loss(model, (x, y))
    with acc.accumulate((x[:4], y[:4]), last=True) as step:
        step.backward_weighted(mean_loss(model, (x[:4], y[:4])))
    with pytest.raises(ConfigError, match="held 4 items in total but global_batch_size is 10"):
        acc.step()


def test_examples_in_docstrings_run() -> None:
    import batchfit.advice.batchnorm
    import batchfit.train.accumulate
    import batchfit.train.trainer

    for module in (batchfit.train.accumulate, batchfit.train.trainer, batchfit.advice.batchnorm):
        failed, attempted = doctest.testmod(module)
        assert attempted > 0 and failed == 0, module.__name__


@pytest.mark.parametrize(
    ("make_model", "loss", "batches"), [(mlp, mean_loss, class_batches), (token_model, token_loss, token_batches)]
)
def test_a_padding_micro_batch_adds_exactly_nothing(make_model: Any, loss: Any, batches: Any) -> None:
    """``n_items=0`` (FSDP padding): a real item runs for its collectives, weighted by exactly zero."""
    results, params = [], []
    for pad in (False, True):
        model, optimizer, _ = build(make_model, "adamw", False)
        acc = Accumulator(model, optimizer, global_batch_size=G, max_grad_norm=0.5)
        for batch in batches(2):
            pieces = split_batch(batch, [6, 4])
            window = list(zip(pieces, (6, 4))) + ([(split_batch(batch, [1, 9])[0], 0)] if pad else [])
            for i, (piece, n) in enumerate(window):
                with acc.accumulate(piece, last=i == len(window) - 1, n_items=n) as micro:
                    micro.backward_weighted(loss(model, piece))
            results.append(acc.step())
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))  # bit for bit
    plain, padded = results[:2], results[2:]
    for a, b in zip(plain, padded):
        assert b.micro_batch_sizes == (6, 4, 0) and b.accumulation_steps == 3
        assert (b.loss, b.n_items, b.grad_norm) == (a.loss, a.n_items, a.grad_norm)
