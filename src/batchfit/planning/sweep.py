"""Measured throughput against batch size on the device at hand, and the knee of the curve.

The largest micro-batch that fits is not always the fastest one per item: past a point, a larger
batch buys no more throughput (the GPU is saturated) and only costs memory. ``sweep`` measures real
steps, so its answer is about this machine, not a model of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..batching import check_batch_size, map_tensors
from ..errors import ConfigError
from ..memory.measure import measure_cpu_peak
from ..memory.steps import loss_for_backward
from ..sources import as_workload
from ..workload import trainable_parameters

if TYPE_CHECKING:
    from ..workload import Workload

#: A batch size within this fraction of the best throughput counts as "as fast" (the knee rule).
KNEE_TOLERANCE = 0.03


@dataclass(frozen=True)
class SweepPoint:
    """Measurements at one batch size."""

    batch_size: int
    seconds_per_step: float
    """Median wall time of one training step, warm-up excluded."""
    items_per_second: float
    tokens_per_second: float | None
    peak_bytes: int | None
    """Peak memory of a step (CPU: the allocator's, via the profiler; CUDA: max_memory_allocated)."""


@dataclass(frozen=True)
class SweepResult:
    """A throughput sweep and its knee."""

    workload: str
    device: str
    points: tuple[SweepPoint, ...]
    best: int
    """The batch size with the highest items/s."""
    knee: int
    """The smallest batch size within 3% of the best throughput: as fast, for less memory."""
    steps: int
    warmup: int = field(default=1)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        d = asdict(self)
        d["points"] = [asdict(p) for p in self.points]
        return d


def knee_of(points: list[SweepPoint] | tuple[SweepPoint, ...], tolerance: float = KNEE_TOLERANCE) -> int:
    """The smallest batch size whose throughput is within ``tolerance`` of the best."""
    best = max(p.items_per_second for p in points)
    return min(p.batch_size for p in points if p.items_per_second >= (1 - tolerance) * best)


def default_batch_sizes(limit: int = 64) -> list[int]:
    """Powers of two up to ``limit``."""
    sizes, b = [], 1
    while b <= limit:
        sizes.append(b)
        b *= 2
    return sizes


def _time_steps(model: Any, optimizer: Any, batch: Any, loss_fn: Any, steps: int, warmup: int, sync: Any) -> float:
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = loss_for_backward(loss_fn(model, batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measurable_device(device: Any) -> torch.device:
    """The device of this machine that ``device`` names: a sweep times real steps, so only ``cpu`` and
    a visible CUDA GPU can be swept. A catalog name (``H100-80GB``) is refused rather than timed on the
    CPU under that label: a GPU that is not here is the estimator's job.

    Raises:
        ConfigError: anything else, or ``cuda`` with no GPU visible.
    """
    text = str(device).strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ConfigError("sweep measures this machine and no CUDA GPU is visible here; use --device cpu")
        index = int(text[5:]) if ":" in text else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"sweep: {device} is not here ({torch.cuda.device_count()} GPU(s) visible)")
        return torch.device("cuda", index)
    raise ConfigError(
        f"sweep measures this machine (cpu, or cuda when a GPU is present), not {device!r}; "
        f"to predict another GPU use `batchfit fit <model> --device {device}`"
    )


def parse_batch_sizes(text: str, option: str = "--batch-sizes") -> list[int]:
    """``"1,2,8"`` -> ``[1, 2, 8]``; empty entries, words and non-positive sizes are refused.

    Raises:
        ConfigError: the text is empty or malformed, naming ``option`` and the entry at fault.
    """
    example = f"e.g. {option} 1,2,4,8"
    if not text.strip():
        raise ConfigError(f"{option} is empty; give whole numbers separated by commas, {example}")
    sizes = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry.isdigit() or int(entry) < 1:
            raise ConfigError(f"{option} takes whole numbers >= 1 separated by commas, not {entry!r}; {example}")
        sizes.append(int(entry))
    return sizes


def sweep(
    workload: Workload | str,
    device: str = "cpu",
    batch_sizes: list[int] | None = None,
    steps: int = 5,
    *,
    warmup: int = 1,
    measure_memory: bool = True,
    progress: Callable[[int, int, int], None] | None = None,
) -> SweepResult:
    """Time real training steps at each batch size on ``device`` (``"cpu"``, or ``"cuda"`` when present).

    Args:
        batch_sizes: the sizes to measure (default: powers of two up to 64).
        steps: timed steps per size; their median is reported. ``warmup`` steps before are not timed.
        measure_memory: also record each size's peak memory (on the CPU this runs two more steps
            under the profiler, outside the timed ones).
        progress: called with ``(index, total, batch_size)`` before each size (for progress bars).

    Raises:
        ConfigError: a device not on this machine (see :func:`measurable_device`), an empty or
            non-positive list of batch sizes, or fewer than one step.
    """
    target = measurable_device(device)
    sizes = sorted(set(default_batch_sizes() if batch_sizes is None else batch_sizes))
    if not sizes:
        raise ConfigError("give at least one batch size to sweep, e.g. --batch-sizes 1,2,4,8")
    for b in sizes:
        check_batch_size(b, "every swept batch size")
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    wl = as_workload(workload)
    on_cuda = target.type == "cuda"
    device = str(target)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    torch.manual_seed(0)
    model = wl.build_model().to(target)
    model.train()
    optimizer = wl.optimizer(trainable_parameters(model))
    points = []
    for i, b in enumerate(sizes):
        if progress is not None:
            progress(i, len(sizes), b)

        batch = map_tensors(wl.batch(b), lambda t: t.to(target))
        seconds = _time_steps(model, optimizer, batch, wl.loss, steps, warmup, sync)
        peak = None
        if measure_memory:
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()
                _time_steps(model, optimizer, batch, wl.loss, 1, 0, sync)
                peak = int(torch.cuda.max_memory_allocated())
            else:
                peak = measure_cpu_peak(wl, b)
        del batch
        items = b / seconds
        tokens = items * wl.tokens_per_item if wl.tokens_per_item else None
        points.append(SweepPoint(b, seconds, items, tokens, peak))
    if progress is not None:
        progress(len(sizes), len(sizes), sizes[-1])
    best = max(points, key=lambda p: p.items_per_second).batch_size
    return SweepResult(wl.name, device, tuple(points), best, knee_of(points), steps, warmup)
