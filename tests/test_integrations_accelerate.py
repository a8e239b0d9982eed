"""``find_executable_batch_size`` that keeps the global batch: the first try from the estimate, retries
with more accumulation after an out-of-memory error, the same weights (float64) as a run that never ran
out, and one clear error when one item does not fit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from lightning_tiny import CAPACITY, SMALLER, data, net, reference  # noqa: E402

from batchfit import SimulatedDevice, Workload  # noqa: E402
from batchfit.errors import ConfigError, DoesNotFitError  # noqa: E402
from batchfit.integrations._common import largest_divisor_at_most  # noqa: E402
from batchfit.integrations.accelerate import Attempt, find_executable_batch_size  # noqa: E402

GLOBAL_BATCH = 24
STEPS = 2
LR = 0.1


def workload() -> Workload:
    """One step of ``train`` below, for the estimate: the same net, loss and item shapes (fresh tensors,
    as ``train`` copies its micro-batches to the GPU; the dataset itself stays in host memory)."""
    return Workload(
        model=net,
        batch=lambda b: (torch.randn(b, 32, 128, dtype=torch.float64), torch.randn(b, 32, 4, dtype=torch.float64)),
        loss=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]),
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )


def train(micro_batch_size: int, accumulation_steps: int, gpu: SimulatedDevice | None = None) -> dict[str, Any]:
    """A hand-written accumulation loop, run inside ``gpu`` (a simulated GPU) when given."""
    x, y = data()
    # Views of the host data, made before the GPU is entered (a view made inside would put the whole
    # dataset's storage on it); each is copied to the GPU when its turn comes.
    parts = [(x[i : i + micro_batch_size], y[i : i + micro_batch_size])
             for i in range(0, STEPS * micro_batch_size * accumulation_steps, micro_batch_size)]  # fmt: skip
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with gpu if gpu is not None else torch.autograd.set_grad_enabled(True):
        if gpu is not None:
            gpu.track(model)
        for step in range(STEPS):
            for k in range(accumulation_steps):
                xb, yb = (t.clone() for t in parts[step * accumulation_steps + k])  # the copy to the GPU
                loss = nn.functional.mse_loss(model(xb), yb) / accumulation_steps
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=0)


def test_the_first_try_comes_from_the_estimate_and_fits() -> None:
    gpu = SimulatedDevice(CAPACITY)
    run = find_executable_batch_size(GLOBAL_BATCH, device=gpu, workload=workload())(train)
    weights = run(gpu)
    plan = run.plan
    assert plan.max_micro_batch_size < GLOBAL_BATCH
    micro = largest_divisor_at_most(GLOBAL_BATCH, plan.max_micro_batch_size)
    assert run.attempts == [Attempt(micro, GLOBAL_BATCH // micro, False)]  # no crash
    _same(weights, reference(GLOBAL_BATCH, STEPS))


def test_an_out_of_memory_error_keeps_the_global_batch_and_the_weights() -> None:
    """Planned for a larger GPU than the one it runs on: the first try runs out, the retry fits."""
    small = SimulatedDevice(SMALLER)
    run = find_executable_batch_size(
        GLOBAL_BATCH, device=SimulatedDevice(CAPACITY), workload=workload(), free=small.empty_cache
    )(train)
    weights = run(small)
    first, *rest = run.attempts
    assert first.out_of_memory and first.micro_batch_size == run.plan.micro_batch_size
    assert rest and rest[-1].out_of_memory is False and all(a.out_of_memory for a in rest[:-1])
    for a, b in zip(run.attempts, run.attempts[1:]):
        assert b.micro_batch_size <= a.micro_batch_size // 2 and b.accumulation_steps > a.accumulation_steps
    assert all(a.micro_batch_size * a.accumulation_steps == GLOBAL_BATCH for a in run.attempts)
    assert small.stats().num_ooms == len(run.attempts) - 1
    _same(weights, train(GLOBAL_BATCH, 1))  # one micro-batch per step, never out of memory


def test_without_a_workload_it_starts_from_the_whole_share() -> None:
    calls: list[tuple[int, int]] = []

    @find_executable_batch_size(12, world_size=2)
    def run(micro_batch_size: int, accumulation_steps: int, tag: str) -> str:
        calls.append((micro_batch_size, accumulation_steps))
        if micro_batch_size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return tag

    assert run("done") == "done"
    assert calls == [(6, 1), (3, 2), (1, 6)]  # divisors of the per-process share, each at most half the last
    assert run.__name__ == "run"


def test_docstring_example() -> None:
    @find_executable_batch_size(12, micro_batch_size=12)
    def run(micro_batch_size: int, accumulation_steps: int) -> tuple[int, int]:
        if micro_batch_size > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return micro_batch_size, accumulation_steps

    assert run() == (3, 4)
    assert [(a.micro_batch_size, a.out_of_memory) for a in run.attempts] == [(12, True), (6, True), (3, False)]


def test_one_item_that_does_not_fit_is_one_clear_error() -> None:
    @find_executable_batch_size(24)
    def run(micro_batch_size: int, accumulation_steps: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with pytest.raises(DoesNotFitError) as info:
        run()
    text = str(info.value)
    assert "one item per micro-batch runs out of memory" in text and "mixed precision" in text
    assert "reached zero" not in text and "\n" not in text
    assert [a.micro_batch_size for a in run.attempts] == [24, 12, 6, 3, 1]


def test_other_errors_and_bad_sizes_are_not_retried() -> None:
    calls: list[int] = []

    @find_executable_batch_size(8)
    def run(micro_batch_size: int, accumulation_steps: int) -> None:
        calls.append(micro_batch_size)
        raise ValueError("a bug in the loop")

    with pytest.raises(ValueError, match="a bug in the loop"):
        run()
    assert calls == [8]
    with pytest.raises(ConfigError, match="use 20 or 25 instead of 24"):
        find_executable_batch_size(24, world_size=5)(train)()
    with pytest.raises(ConfigError, match="cannot give each of 4 processes an item"):
        find_executable_batch_size(2, world_size=4)(train)()
    with pytest.raises(ConfigError, match="whole number >= 1"):
        find_executable_batch_size(0)


def test_the_precision_reaches_the_plan() -> None:
    run = find_executable_batch_size(
        GLOBAL_BATCH, device=SimulatedDevice(CAPACITY), workload=workload(), precision="bf16"
    )(lambda micro_batch_size, accumulation_steps: (micro_batch_size, accumulation_steps))
    assert run() == (run.plan.micro_batch_size, run.plan.accumulation_steps)
    assert run.plan.precision == "bf16" and run.plan.micro_batch_size * run.plan.accumulation_steps == GLOBAL_BATCH


def test_a_preset_name_is_a_workload_and_an_unknown_one_fails_when_decorating() -> None:
    run = find_executable_batch_size(64, device="1GiB", workload="mlp")(lambda micro, accumulation: micro)
    assert run.workload.name == "mlp"
    assert run._first_micro(64, 1) == 64  # the plan's micro-batch, planned for the named preset
    with pytest.raises(ConfigError, match="no-such-preset"):
        find_executable_batch_size(64, device="1GiB", workload="no-such-preset")(lambda micro, accumulation: micro)
