"""OOM recovery: halve the micro-batch, keep the global batch, keep the gradient (float64, exact)."""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchfit.train.trainer as trainer_module
from batchfit.errors import DoesNotFitError
from batchfit.runtime.simulated import SimulatedDevice
from batchfit.train.accumulate import Accumulator, micro_batch_sizes
from batchfit.train.oom_resplit import CudaCache, Replan, is_out_of_memory, release_memory
from batchfit.train.trainer import Trainer

MiB = 2**20


pytestmark = pytest.mark.usefixtures("one_thread")


def fake_oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...")


# -- scripted faults: exact control over where the error strikes ------------------------------------------
class Boom(torch.autograd.Function):
    """Identity; its backward raises an OOM when armed, after the layers above it got their gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, armed: bool) -> torch.Tensor:
        ctx.armed = armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.armed:
            raise fake_oom()
        return grad, None


class Faulty(nn.Module):
    """A small MLP that runs out of memory in the forward or backward of chosen calls (counted from 0)."""

    def __init__(self, forward_at: set[int] = frozenset(), backward_at: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 16), nn.Linear(16, 3)
        self.forward_at, self.backward_at = set(forward_at), set(backward_at)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if call in self.forward_at:
            raise fake_oom()
        return self.l2(torch.tanh(Boom.apply(self.l1(x), call in self.backward_at)))


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def data(steps: int, n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen))
            for _ in range(steps)]


def reference_params(batches: list, lr: float = 0.1) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Faulty().double()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for batch in batches:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


def assert_same(model: nn.Module, expected: list[torch.Tensor]) -> None:
    for p, q in zip(model.parameters(), expected):
        assert ((p - q).abs().max() / q.abs().max()).item() <= 1e-12


class CountingCache:
    def __init__(self) -> None:
        self.emptied = 0

    def empty_cache(self) -> None:
        self.emptied += 1


def faulty_trainer(monkeypatch: pytest.MonkeyPatch, model: nn.Module, micro: int, n: int = 12) -> tuple[Trainer, Any]:
    cache = CountingCache()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn,
                      global_batch_size=n, micro_batch_size=micro)
    monkeypatch.setattr(trainer, "_where", trainer_module._Placement(torch.device("cpu"), "fake-gpu", cache))
    return trainer, cache


def build_faulty(**faults: Any) -> nn.Module:
    torch.manual_seed(0)
    return Faulty(**faults).double()


def test_oom_in_forward_resplits_the_rest_of_the_window(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    batches = data(3)
    model = build_faulty(forward_at={1})  # the second micro-batch of the first step
    trainer, cache = faulty_trainer(monkeypatch, model, micro=4)
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        results = [trainer.step(b) for b in batches]
    assert results[0].micro_batch_sizes == (4, 2, 2, 2, 2)  # items 0-3 kept, 4-11 re-split
    assert results[0].replanned == (Replan(4, 2, "forward", at_item=4, redone_items=0),)
    assert results[0].micro_batch_size == 2 and trainer.micro_batch_size == 2
    assert [r.micro_batch_sizes for r in results[1:]] == [(2,) * 6] * 2 and not results[1].replanned  # kept
    assert cache.emptied == 1
    assert "out of memory on fake-gpu in the forward pass of a micro-batch of 4" in caplog.text
    assert "micro-batch 4 -> 2, global batch unchanged" in caplog.text
    assert_same(model, reference_params(batches))


def test_oom_in_backward_discards_and_redoes_the_window(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    batches = data(2)
    model = build_faulty(backward_at={1})
    trainer, cache = faulty_trainer(monkeypatch, model, micro=4)
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        first = trainer.step(batches[0])
    trainer.step(batches[1])
    assert first.micro_batch_sizes == (2,) * 6  # the whole window again, not 4 + 2 x 4
    assert first.replanned == (Replan(4, 2, "backward", at_item=4, redone_items=4),)
    assert "window redone from its first item (4 items recomputed)" in caplog.text
    assert cache.emptied == 1
    assert_same(model, reference_params(batches))


def test_without_the_reset_partial_gradients_would_count_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward fault really leaves partial sums behind: skipping the reset breaks exactness."""
    batches = data(1)
    model = build_faulty(backward_at={1})
    trainer, _ = faulty_trainer(monkeypatch, model, micro=4)
    acc = trainer.accumulator

    def forget_counts_but_keep_gradients() -> None:
        acc._values.clear(), acc._counts.clear(), acc._sizes.clear()
        acc._form, acc._dirty = None, False

    monkeypatch.setattr(acc, "reset", forget_counts_but_keep_gradients)
    trainer.step(batches[0])
    with pytest.raises(AssertionError):
        assert_same(model, reference_params(batches))


def test_oom_in_a_smaller_remainder_halves_the_micro_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = data(1, n=10)
    model = build_faulty(forward_at={1})  # [4, 3, 3]: the first 3 fails
    trainer, _ = faulty_trainer(monkeypatch, model, micro=4, n=10)
    result = trainer.step(batches[0])
    assert result.replanned == (Replan(3, 2, "forward", at_item=4, redone_items=0),)
    assert result.micro_batch_sizes == (4, 2, 2, 2)
    assert_same(model, reference_params(batches))


def test_repeated_ooms_keep_halving(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = data(1)
    model = build_faulty(forward_at={0, 1, 2})  # 12 -> 6 -> 3 -> 1 (three failures in a row)
    trainer, cache = faulty_trainer(monkeypatch, model, micro=12)
    result = trainer.step(batches[0])
    assert [(r.from_micro_batch_size, r.to_micro_batch_size) for r in result.replanned] == [(12, 6), (6, 3), (3, 1)]
    assert result.micro_batch_sizes == (1,) * 12 and cache.emptied == 3
    assert_same(model, reference_params(batches))


def test_one_item_that_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_faulty(forward_at=set(range(100)))
    trainer, _ = faulty_trainer(monkeypatch, model, micro=2)
    with pytest.raises(DoesNotFitError) as info:
        trainer.step(data(1)[0])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("one item does not fit on fake-gpu: out of memory in the forward pass of a micro-batch")
    assert "Tried to allocate 2.00 GiB" in message
    assert "activation checkpointing" in message and "--precision bf16" in message
    assert all(p.grad is None for p in model.parameters())


def test_other_errors_are_not_taken_for_oom(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(model: nn.Module, batch: Any) -> torch.Tensor:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    trainer, cache = faulty_trainer(monkeypatch, build_faulty(), micro=4)
    trainer.loss = broken
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        trainer.step(data(1)[0])
    assert cache.emptied == 0


def test_is_out_of_memory_checks_the_type_first_and_the_message_second() -> None:
    assert is_out_of_memory(fake_oom())
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("device-side assert triggered"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_a_synchronising_ddp_backward_is_not_redone(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_faulty(backward_at={2})  # the window's last micro-batch
    trainer, _ = faulty_trainer(monkeypatch, model, micro=4)
    trainer.accumulator.world_size = 2  # as if other ranks were waiting in this backward's all-reduce
    with pytest.raises(torch.OutOfMemoryError):
        trainer.step(data(1, n=12)[0])


@pytest.mark.parametrize(("phase", "at"), [("forward", 1), ("backward", 1), ("backward", 2)])
def test_under_fsdp_an_oom_names_a_smaller_micro_batch_instead_of_re_splitting_one_rank(
    monkeypatch: pytest.MonkeyPatch, phase: str, at: int
) -> None:
    """Also in the window's last backward (``at=2``), which under DDP alone re-raises the raw error."""
    model = build_faulty(**{f"{phase}_at": {at}})
    trainer, cache = faulty_trainer(monkeypatch, model, micro=4)
    trainer.accumulator.world_size = 2  # as if another rank were waiting in the collectives
    monkeypatch.setattr(Accumulator, "sharded", property(lambda self: True))  # every micro-batch a collective
    with pytest.raises(DoesNotFitError, match=f"in the {phase} pass of a micro-batch of 4 under FSDP") as info:
        trainer.step(data(1, n=12)[0])
    assert "micro-batch size of at most 2" in str(info.value) and "\n" not in str(info.value)
    assert cache.emptied == 1 and not trainer.accumulator.needs_reset
    assert all(p.grad is None for p in model.parameters())


def test_oom_in_the_optimizer_step_is_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, cache = faulty_trainer(monkeypatch, build_faulty(), micro=4)

    def step(*args: Any, **kwargs: Any) -> None:
        raise fake_oom()

    monkeypatch.setattr(trainer.optimizer, "step", step)
    with pytest.raises(DoesNotFitError, match="the optimizer step ran out of memory on fake-gpu"):
        trainer.step(data(1)[0])
    assert cache.emptied == 1


def test_release_memory_collects_then_empties_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    monkeypatch.setattr("gc.collect", lambda: order.append("gc") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("cuda"))
    release_memory(CudaCache())
    assert order == ["gc", "cuda"]


def test_micro_batches_are_copied_to_the_device_one_at_a_time() -> None:
    # "meta" stands in for a GPU: the copy path is the same ``.to(device, non_blocking=True)``.
    where = trainer_module._Placement(torch.device("meta"), "meta", CountingCache())
    x, y = where.move((torch.randn(3, 2), {"labels": torch.arange(3)}))
    assert x.device.type == "meta" and y["labels"].device.type == "meta"


def test_cuda_profile_from_the_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA A100-SXM4-40GB")
    assert trainer_module._cuda_profile(0).name == "A100-40GB"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Some Future GPU")
    props = type("Props", (), {"total_memory": 24 * 2**30})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    assert trainer_module._cuda_profile(0).total_bytes == 24 * 2**30


# -- on a simulated GPU: real out-of-memory errors where a GPU would raise them ----------------------------------
class Scratch(torch.autograd.Function):
    """Identity whose forward or backward needs a transient workspace of ``width`` elements per item
    (as attention scores or a fused kernel's buffer would): it sets where the memory peak of a step is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_width: int, backward_width: int) -> torch.Tensor:
        ctx.backward_width = backward_width
        if forward_width:
            torch.empty(x.shape[0], forward_width, dtype=x.dtype)  # (b, width), freed at once
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.backward_width:
            torch.empty(grad.shape[0], ctx.backward_width, dtype=grad.dtype)  # (b, width)
        return grad, None, None


class Net(nn.Module):
    """``Linear -> Scratch -> tanh -> Linear``, plus ``tag``: one zero-valued parameter per item id whose
    gradient counts how many times each item reached the optimizer step (see ``tagged_loss``)."""

    def __init__(self, d: int, h: int, n_ids: int, forward_width: int = 0, backward_width: int = 0) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, h), nn.Linear(h, 3)
        self.tag = nn.Parameter(torch.zeros(n_ids))
        self.widths = (forward_width, backward_width)
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(Scratch.apply(self.l1(x), *self.widths)))


def tagged_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean cross-entropy plus ``tag[id] - tag[id].detach()`` per item: zero in value, while its gradient
    is 1/G per use of the item; ``seen`` records the ids of every forward that completed."""
    x, y, ids = batch
    per_item = F.cross_entropy(model(x), y, reduction="none")  # (b,)
    tag = model.tag[ids]  # (b,)
    model.seen.append(ids.tolist())
    return (per_item + (tag - tag.detach())).mean()


def sim_data(steps: int, n: int, d: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    return [
        (torch.randn(n, d, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen),
         torch.arange(t * n, (t + 1) * n))
        for t in range(steps)
    ]


class DidNotFit(Exception):
    pass


def run(spec: dict[str, int], batches: list, micro: int, capacity: str | int, strict: bool = False) -> dict[str, Any]:
    """Train on a simulated GPU of ``capacity``; the model, results, tag counts and allocator stats.

    ``strict`` turns the first out-of-memory error into ``DidNotFit`` instead of recovering from it.
    """
    n = batches[0][0].shape[0]
    torch.manual_seed(0)
    model = Net(spec["d"], spec["h"], n * len(batches), spec.get("fwd", 0), spec.get("bwd", 0)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counts: list[torch.Tensor] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: counts.append(model.tag.grad * n))
    with SimulatedDevice(capacity) as gpu:
        trainer = Trainer(model, optimizer, tagged_loss, global_batch_size=n, micro_batch_size=micro, device=gpu)
        if strict:
            recovering = trainer._run_micro

            def run_micro(micro_batch: Any, n_items: int, last: bool) -> None:
                try:
                    recovering(micro_batch, n_items, last)
                except torch.OutOfMemoryError:
                    raise DidNotFit from None

            trainer._run_micro = run_micro  # type: ignore[method-assign]
        results = [trainer.step(b) for b in batches]
    return {"model": model, "results": results, "counts": counts, "stats": gpu.stats()}


def smallest_capacity(spec: dict[str, int], batches: list, micro: int) -> int:
    """The smallest simulated capacity (1 MiB steps) on which training at ``micro`` never runs out of memory.

    Measured, not guessed: on a large device the run's peak allocated bytes are a lower bound and its
    peak reserved bytes an upper bound (the same allocations, with no pressure to release the cache);
    bisection between the two, on the simulated device itself, finds where its allocator (segments of
    2 and 20 MiB, rounding, cache release and retry) stops raising.
    """
    stats = run(spec, batches, micro, "4GiB")["stats"]
    low, high = stats.peak_allocated_bytes // MiB, -(-stats.peak_reserved_bytes // MiB)  # fails?, fits
    while high - low > 1:
        mid = (low + high) // 2
        try:
            run(spec, batches, micro, mid * MiB, strict=True)
            fits = True
        except DidNotFit:
            fits = False
        low, high = (low, mid) if fits else (mid, high)
    return high * MiB


def full_batch(spec: dict[str, int], batches: list) -> nn.Module:
    n = batches[0][0].shape[0]
    torch.manual_seed(0)
    model = Net(spec["d"], spec["h"], n * len(batches)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        tagged_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def oom_capacity(spec: dict[str, int], batches: list) -> int:
    """A capacity on which the window's first micro-batch fits, its second does not, and half-size ones do."""
    first = [tuple(t[:MICRO] for t in batches[0])]
    two = [tuple(t[: 2 * MICRO] for t in batches[0])]
    must_fit = max(smallest_capacity(spec, first, MICRO), smallest_capacity(spec, batches[:1], MICRO // 2))
    must_fail = smallest_capacity(spec, two, MICRO)
    assert must_fail - must_fit >= 4 * MiB, (must_fit / MiB, must_fail / MiB)
    return (must_fit + must_fail) // 2


def check_exact_and_accounted(out: dict[str, Any], spec: dict[str, int], batches: list) -> None:
    ref = full_batch(spec, batches)
    never = run(spec, batches, micro=MICRO, capacity="4GiB")
    assert not any(r.replanned for r in never["results"])
    for model in (ref, never["model"]):
        for p, q in zip(out["model"].parameters(), model.parameters()):
            assert ((p - q).abs().max() / q.abs().max().clamp_min(1e-300)).item() <= 1e-12
    n = batches[0][0].shape[0]
    for t, count in enumerate(out["counts"]):  # every item of step t reached its step exactly once
        expected = torch.zeros_like(count)
        expected[t * n : (t + 1) * n] = 1.0
        assert (count - expected).abs().max().item() <= 1e-12


MICRO, N, STEPS = 8, 32, 2


def test_simulated_oom_in_forward_mid_window() -> None:
    # A forward workspace of 64 MiB per 8 items (float64) and an 8 MiB first layer: the first micro-batch
    # fits; the second's forward does not, since gradients and the backward's cuBLAS workspace now live
    # beside it; micro-batches of half the size need half the workspace and fit.
    spec = {"d": 512, "h": 2048, "fwd": 2**20}
    batches = sim_data(STEPS, N, spec["d"])
    out = run(spec, batches, MICRO, oom_capacity(spec, batches))
    first, second = out["results"]
    assert first.replanned == (Replan(MICRO, MICRO // 2, "forward", at_item=MICRO, redone_items=0),)
    assert first.micro_batch_sizes == (MICRO,) + (MICRO // 2,) * 6
    assert second.micro_batch_sizes == (MICRO // 2,) * 8 and not second.replanned
    for t in range(STEPS):  # each completed forward saw every item of its step exactly once
        seen = collections.Counter(i for ids in out["model"].seen if ids[0] // N == t for i in ids)
        assert seen == collections.Counter(range(t * N, (t + 1) * N))
    check_exact_and_accounted(out, spec, batches)


def test_simulated_oom_in_backward_mid_window() -> None:
    # A backward workspace of 64 MiB per 8 items and a 16 MiB first layer: the second micro-batch's
    # backward needs the first layer's accumulated gradient beside the workspace, the first's does not.
    spec = {"d": 1024, "h": 2048, "bwd": 2**20}
    batches = sim_data(STEPS, N, spec["d"])
    out = run(spec, batches, MICRO, oom_capacity(spec, batches))
    first, second = out["results"]
    assert first.replanned == (Replan(MICRO, MICRO // 2, "backward", at_item=MICRO, redone_items=MICRO),)
    assert first.micro_batch_sizes == (MICRO // 2,) * 8 and not second.replanned
    # Forwards of the discarded attempt: items 0-15 ran twice, but count once in the gradient (below).
    seen = collections.Counter(i for ids in out["model"].seen if ids[0] < N for i in ids)
    assert seen == collections.Counter(list(range(N)) + list(range(2 * MICRO)))
    check_exact_and_accounted(out, spec, batches)


def test_simulated_gpu_where_one_item_does_not_fit() -> None:
    spec = {"d": 64, "h": 256, "fwd": 2**22}  # 32 MiB of forward workspace per item
    batches = sim_data(1, 4, spec["d"])
    one_item = smallest_capacity(spec, [tuple(t[:1] for t in batches[0])], 1)
    expected = r"^one item does not fit on a simulated [0-9.]+ MiB GPU: out of memory in the forward pass"
    with pytest.raises(DoesNotFitError, match=expected):
        run(spec, batches, 2, one_item - 16 * MiB)  # the model fits, half an item's workspace short


def test_a_model_larger_than_the_simulated_gpu() -> None:
    model = nn.Linear(1024, 1024)  # 4 MiB of weights
    with SimulatedDevice("2MiB") as gpu:
        with pytest.raises(DoesNotFitError, match="parameters and buffers alone exceed the capacity"):
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch_size=4,
                    micro_batch_size=2, device=gpu)


def test_a_simulated_device_given_but_not_entered_is_used_as_a_gpu() -> None:
    """The Trainer places the model on the device it is given and copies each micro-batch there, entered
    or not: the same run, the same bytes, the same parameters as when the caller enters it."""
    runs, batches = [], data(2)  # made on the host, before any device is entered
    for entered in (False, True):
        model = build_faulty()
        gpu = SimulatedDevice("1GiB")
        with gpu if entered else contextlib.nullcontext():
            trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn,
                              global_batch_size=12, micro_batch_size=4, device=gpu)  # fmt: skip
            placed = gpu.stats().allocated_bytes
            results = [trainer.step(b) for b in batches]
        assert gpu.active is False
        runs.append((model, placed, gpu.stats(), results))
    (model, placed, stats, results), (_, placed_entered, stats_entered, _) = runs
    # float64 l1 (16x6 = 768 B, 16 = 128 B) and l2 (3x16 = 384 B, 3 = 24 B), each rounded up to 512 B
    assert placed == placed_entered == 1024 + 3 * 512
    assert stats.peak_allocated_bytes == stats_entered.peak_allocated_bytes > placed
    assert [r.micro_batch_sizes for r in results] == [(4, 4, 4)] * 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), runs[1][0].parameters()))
    assert_same(model, reference_params(batches))


def test_micro_batch_sizes_after_a_resplit_cover_the_rest() -> None:
    assert micro_batch_sizes(256 - 64, 32) == [32] * 6
