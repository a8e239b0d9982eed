"""Memory figures (PNG bytes) and the numbers they draw, so a test can check a picture against the estimate.

Each ``plot_*`` function returns a ``Figure``: the PNG and the ``data`` it was drawn from, in bytes
(integers) and batch sizes. The data functions (``memory_by_batch_size``, ``memory_timeline``) are pure
and import nothing heavy; matplotlib is imported only when a figure is drawn. ``estimates_over_batch_sizes``
computes the estimates the batch-size figure draws (two or three traces, the rest predicted).
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..memory.allocator.caching import round_size
from ..memory.categories import ORDER, Category
from ..memory.estimate import finish_estimate, trace_for_device
from ..memory.synthesis.scaling import TraceLine
from ..memory.synthesis.sharding import shard_trace
from ..memory.trace.fake_step import MemoryTrace
from ..units import GiB, KiB, MiB, format_bytes
from .plots import _pyplot, plot_sweep

if TYPE_CHECKING:
    from ..workload import Workload

#: One colour per category, the same in every figure (matplotlib's tab10, in the order of ``ORDER``).
COLORS = {
    Category.PARAMETERS.value: "#4e79a7",
    Category.GRADIENTS.value: "#f28e2b",
    Category.OPTIMIZER_STATES.value: "#59a14f",
    Category.ACTIVATIONS.value: "#e15759",
    Category.BATCH_DATA.value: "#b07aa1",
    Category.TEMPORARIES.value: "#9c9c9c",
}
#: Shading of the phases the timeline marks.
PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde3cf", "optimizer": "#dcefd8"}
PHASE_LABELS = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
#: Points on the memory-by-batch-size curve.
CURVE_POINTS = 12
#: Points when the curve must be traced point by point (the step's code depends on the batch size).
TRACED_CURVE_POINTS = 6
#: At most this many points are drawn on the timeline; each bucket keeps its highest point, so the peak stays.
MAX_TIMELINE_POINTS = 4000


@dataclass(frozen=True)
class Figure:
    """A rendered figure and the numbers behind it."""

    name: str
    """File stem for ``--png-dir`` (``memory_by_batch_size``, ``memory_timeline``, ``throughput``)."""
    title: str
    png: bytes
    data: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | Path) -> Path:
        """Write ``<directory>/<name>.png`` (the directory is created) and return its path."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.name}.png"
        path.write_bytes(self.png)
        return path


def _unit(max_bytes: float) -> tuple[int, str]:
    """The binary unit that keeps the axis' numbers readable (KiB for the tiniest models)."""
    for scale, unit in ((GiB, "GiB"), (MiB, "MiB")):
        if max_bytes >= scale:
            return scale, unit
    return KiB, "KiB"


def _png(fig: Any) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


# -- memory against batch size --------------------------------------------------------------------------
def memory_by_batch_size(estimates: Sequence[Any]) -> dict[str, Any]:
    """The breakdown at the peak of each estimate, by batch size (the stacked areas' data).

    Returns:
        ``batch_sizes``; ``categories``: category -> bytes at each batch size (they add up to
        ``peak_allocated``); ``peak_allocated``, ``peak_reserved``, ``device_total`` per batch size;
        ``capacity`` (None: no limit).
    """
    ests = sorted(estimates, key=lambda e: e.batch_size)
    return {
        "batch_sizes": [e.batch_size for e in ests],
        "categories": {c.value: [int(e.breakdown.get(c.value, 0)) for e in ests] for c in ORDER},
        "peak_allocated": [e.peak_allocated_bytes for e in ests],
        "peak_reserved": [e.peak_reserved_bytes for e in ests],
        "device_total": [e.device_total_bytes for e in ests],
        "capacity": ests[0].capacity_bytes if ests else None,
    }


def _curve_sizes(upper: int, points: int, marked: Sequence[int] = ()) -> list[int]:
    """About ``points`` batch sizes spread evenly over ``1..upper`` (memory is affine in the batch size),
    plus the ``marked`` ones within that range."""
    upper = max(upper, 2)
    spread = {max(1, round(1 + i * (upper - 1) / (points - 1))) for i in range(points)}
    return sorted(spread | {b for b in marked if 1 <= b <= upper})


def estimates_over_batch_sizes(
    wl: Workload,
    dev: Any,
    policy: Any,
    classes: tuple,
    upper: int,
    *,
    known: dict[int, MemoryTrace] | None = None,
    marked: Sequence[int] = (),
    shard_over: int = 1,
) -> list[Any]:
    """Estimates over ``1..upper`` (the data of ``plot_memory_by_batch_size``), cheaply.

    Predicted from traces at 2 and 3 through ``TraceLine`` (which reproduces a real trace's estimate
    exactly when the step's code does not depend on the batch size), or traced point by point when no
    line fits. ``known`` (batch size -> trace) is reused and filled in; ``marked`` sizes are included.
    Batch size 1 is always traced (it is the cheapest trace, and at one item broadcasting can skip
    reductions in backward, so its ops may differ from the line's); so are sizes traced already.

    Args:
        wl, dev, policy, classes: the workload, ``Device``, ``PrecisionPolicy`` and checkpointed module
            classes, as ``memory.estimate.trace_for_device`` takes them.
        upper: the largest batch size on the curve.
        shard_over: estimate one rank of FSDP over this many GPUs (``memory/synthesis/sharding.py``).
    """
    known = {} if known is None else known

    def traced(b: int) -> MemoryTrace:
        if b not in known:
            known[b] = trace_for_device(wl, b, dev, policy, classes)
        return known[b]

    def estimate_of(trace: MemoryTrace, b: int) -> Any:
        return finish_estimate(shard_trace(trace, shard_over), wl, b, dev, policy, classes)

    try:
        line: TraceLine | None = TraceLine(traced(2), 2, traced(3), 3)
    except ValueError:
        line = None
    if line is None:
        return [estimate_of(traced(b), b) for b in _curve_sizes(upper, TRACED_CURVE_POINTS, marked)]
    traced(1)
    return [estimate_of(known[b] if b in known else line.at(b), b) for b in _curve_sizes(upper, CURVE_POINTS, marked)]


def plot_memory_by_batch_size(
    estimates: Sequence[Any], *, title: str | None = None, markers: dict[str, int] | None = None
) -> Figure:
    """Stacked areas of the peak's breakdown against batch size, with reserved, device total and capacity.

    Args:
        markers: label -> batch size, drawn as labelled vertical lines (the plan's micro-batch, the
            largest that fits).
    """
    data = memory_by_batch_size(estimates)
    plt = _pyplot()
    sizes = data["batch_sizes"]
    top = max([*data["device_total"], data["capacity"] or 0, 1])
    scale, unit = _unit(top)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    ax.stackplot(
        sizes,
        [[v / scale for v in data["categories"][c.value]] for c in ORDER],
        labels=[c.value.replace("_", " ") for c in ORDER],
        colors=[COLORS[c.value] for c in ORDER],
        alpha=0.9,
    )
    ax.plot(
        sizes,
        [v / scale for v in data["peak_reserved"]],
        color="black",
        linewidth=1,
        linestyle=":",
        label="peak reserved (allocator)",
    )
    if data["device_total"] != data["peak_reserved"]:
        ax.plot(
            sizes,
            [v / scale for v in data["device_total"]],
            color="black",
            linewidth=1.5,
            label="device total (nvidia-smi)",
        )
    if data["capacity"] is not None:
        ax.axhline(
            data["capacity"] / scale,
            color="#d62728",
            linestyle="--",
            linewidth=1.5,
            label=f"capacity {format_bytes(data['capacity'])}",
        )
    for i, (label, b) in enumerate((markers or {}).items()):
        ax.axvline(b, color="#444444", linestyle=(0, (4, 2 + 2 * i)), linewidth=1)
        ax.annotate(
            f"{label}: {b}",
            (b, top / scale * (1.0 - 0.07 * i)),
            textcoords="offset points",
            xytext=(4, 0),
            fontsize=8,
            color="#444444",
        )
    ax.set_xlabel("micro-batch size (items per step)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_xlim(min(sizes), max(sizes))
    ax.set_ylim(0, top / scale * 1.08)
    ax.set_title(title or "Memory at the peak by batch size")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return Figure("memory_by_batch_size", ax.get_title(), _png(fig), data)


# -- the timeline of one step ---------------------------------------------------------------------------
def memory_timeline(trace: MemoryTrace, *, rounded: bool) -> dict[str, Any]:
    """Live bytes by category after every event of ``trace`` (x = event index).

    Args:
        rounded: count each storage as the caching allocator's block (512-byte multiples), as the
            estimate does on CUDA devices; False for exact bytes (CPU).

    Returns:
        ``categories``: category -> live bytes after each event; ``total``: their sum (its maximum is
        the estimate's ``peak_allocated_bytes``); ``peak_index``: the first event where it is reached;
        ``phases``: the trace's ``(event_index, phase, step)`` boundaries.
    """
    size = {sid: (round_size(n) if rounded else n) for sid, n in trace.nbytes.items()}
    role = trace.role
    index = {c.value: i for i, c in enumerate(ORDER)}
    live = [0] * len(ORDER)
    series: list[list[int]] = [[] for _ in ORDER]
    total: list[int] = []
    running = 0
    for e in trace.events:
        sid, sign = (e, 1) if e >= 0 else (~e, -1)
        k = index[role.get(sid, Category.TEMPORARIES).value]
        live[k] += sign * size[sid]
        running += sign * size[sid]
        for j in range(len(ORDER)):
            series[j].append(live[j])
        total.append(running)
    peak = max(total, default=0)
    return {
        "categories": {c.value: series[i] for i, c in enumerate(ORDER)},
        "total": total,
        "peak_bytes": peak,
        "peak_index": total.index(peak) if total else 0,
        "phases": [tuple(p) for p in trace.phases],
    }


def _downsample(total: list[int], limit: int) -> list[int]:
    """Indices to draw: all of them, or each bucket's highest point when there are more than ``limit``."""
    n = len(total)
    if n <= limit:
        return list(range(n))
    k = -(-n // limit)
    return [max(range(i, min(i + k, n)), key=total.__getitem__) for i in range(0, n, k)]


def plot_memory_timeline(
    trace: MemoryTrace, *, rounded: bool, title: str | None = None, budget_bytes: int | None = None
) -> Figure:
    """Stacked live memory by category over one traced step, phases shaded, the peak marked.

    Args:
        rounded: as for ``memory_timeline``.
        budget_bytes: drawn as a dashed line when given (capacity less the CUDA context: what the
            allocator can reserve).
    """
    data = memory_timeline(trace, rounded=rounded)
    plt = _pyplot()
    n = len(data["total"])
    keep = _downsample(data["total"], MAX_TIMELINE_POINTS)
    top = max(data["peak_bytes"], budget_bytes or 0, 1)
    scale, unit = _unit(top)
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    phases = data["phases"]
    labelled = set()
    for i, (start, phase, step) in enumerate(phases):
        end = phases[i + 1][0] if i + 1 < len(phases) else n
        if phase in PHASE_COLORS and end > start:
            label = phase if phase not in labelled else None
            labelled.add(phase)
            ax.axvspan(start, end, color=PHASE_COLORS[phase], zorder=0, label=label)
            ax.text(
                (start + end) / 2,
                top / scale * 1.02,
                f"{PHASE_LABELS[phase]} {step + 1}",
                ha="center",
                va="bottom",
                fontsize=7,
                color="#555555",
            )
    ax.stackplot(
        keep,
        [[data["categories"][c.value][i] / scale for i in keep] for c in ORDER],
        labels=[c.value.replace("_", " ") for c in ORDER],
        colors=[COLORS[c.value] for c in ORDER],
        step="post",
        zorder=2,
    )
    peak_i = data["peak_index"]
    ax.plot([peak_i], [data["peak_bytes"] / scale], "v", color="black", zorder=3)
    ax.annotate(
        f"peak {format_bytes(data['peak_bytes'])}",
        (peak_i, data["peak_bytes"] / scale),
        textcoords="offset points",
        xytext=(6, 6),
        fontsize=8,
        zorder=3,
    )
    if budget_bytes is not None:
        ax.axhline(
            budget_bytes / scale,
            color="#d62728",
            linestyle="--",
            linewidth=1.2,
            label=f"allocator budget {format_bytes(budget_bytes)}",
        )
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, top / scale * 1.12)
    ax.set_xlabel("event (allocation or free) of the traced steps")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(title or "Memory of one training step by category")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return Figure("memory_timeline", ax.get_title(), _png(fig), data)


# -- throughput -----------------------------------------------------------------------------------------
def plot_throughput(result: Any) -> Figure:
    """The sweep's figure (``plot_sweep``: throughput and peak memory by batch size, the knee) as a ``Figure``."""
    with tempfile.TemporaryDirectory() as tmp:
        png = plot_sweep(result, Path(tmp) / "throughput.png").read_bytes()
    data = {
        "batch_sizes": [p.batch_size for p in result.points],
        "items_per_second": [p.items_per_second for p in result.points],
        "peak_bytes": [p.peak_bytes for p in result.points],
        "knee": result.knee,
        "best": result.best,
    }
    return Figure("throughput", f"{result.workload} on {result.device}: throughput by batch size", png, data)
