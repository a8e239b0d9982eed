"""What the HTML report shows, computed: a plan, one traced step, the memory curve and the figures.

``build_report`` runs the slow stages in order (plan the global batch, trace one step at the plan's
micro-batch, predict memory over batch sizes through ``TraceLine``, optionally sweep throughput on
the CPU, draw the figures) and returns a ``Report`` holding their results as data; turning that into
a page is ``sections.py`` and ``html.py``. Nothing here prints or formats.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..activation_checkpointing import checkpoint_classes
from ..advice.lr import lr_scaling
from ..batching import check_batch_size
from ..errors import ConfigError, DoesNotFitError
from ..gpu.catalog import get_device
from ..memory.estimate import finish_estimate, trace_for_device, with_accumulation
from ..memory.synthesis.sharding import shard_trace
from ..memory.trace.fake_step import MemoryTrace
from ..planning.plan import plan as make_plan
from ..planning.sweep import sweep
from ..precision import policy_for
from ..sources import as_workload
from .figures import (
    Figure,
    estimates_over_batch_sizes,
    plot_memory_by_batch_size,
    plot_memory_timeline,
    plot_throughput,
)

if TYPE_CHECKING:
    from ..workload import Workload

#: Global batch planned when none is given: GPT-2's 512 sequences (0.5M tokens at 1024 per sequence).
DEFAULT_GLOBAL_BATCH_SIZE = 512


@dataclass(frozen=True)
class Report:
    """Everything the report shows, computed; ``render_html`` only formats it."""

    workload: str
    device: str
    precision: str
    checkpointing: bool
    batch_size: int
    """The micro-batch of the traced step (the plan's, unless given)."""
    estimate: Any
    """``Estimate`` of the traced step."""
    trace: MemoryTrace
    curve: tuple[Any, ...]
    """``Estimate`` at each batch size of the memory-by-batch-size figure."""
    figures: tuple[Figure, ...]
    plan: Any = None
    """The ``Plan`` of the global batch; None on a device without capacity or when nothing fits."""
    plan_note: str | None = None
    """Why there is no plan (no capacity, nothing fits), in one line."""
    lr: Any = None
    """``LrScaling`` for the plan's global batch, when a reference learning rate was given."""
    sweep: Any = None
    """``SweepResult`` when a sweep ran."""
    budget_bytes: int | None = None
    """What the allocator may reserve: capacity less the CUDA context (None: no limit)."""
    created: str = field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))

    def figure(self, name: str) -> Figure:
        """The figure called ``name``.

        Raises:
            KeyError: no figure of that name (the throughput figure exists only after a sweep).
        """
        for f in self.figures:
            if f.name == name:
                return f
        raise KeyError(name)


def build_report(
    workload: Workload | str,
    *,
    device: Any = "A100-40GB",
    global_batch_size: int | None = None,
    gpus: int = 1,
    batch_size: int | None = None,
    precision: str | None = None,
    checkpointing: Any = None,
    base_lr: float | None = None,
    base_batch_size: int | None = None,
    lr_rule: str = "auto",
    sweep_batch_sizes: Sequence[int] | None = None,
    sweep_steps: int = 3,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Gather the report of ``workload`` on ``device``: plan, traced step, curve, figures, optional sweep.

    Args:
        workload: a ``Workload`` or a preset name.
        device: a catalog GPU, a capacity (``"24GiB"``), ``"cpu"`` or a ``Device``.
        global_batch_size: items per optimizer step to plan (default ``DEFAULT_GLOBAL_BATCH_SIZE``).
        gpus: data-parallel ranks of the plan.
        batch_size: the micro-batch of the traced step (default: the plan's, or 8 without a plan).
        precision: fix the precision (default: the plan's remedies ladder; fp32 without a plan).
        checkpointing: None (the plan decides), ``"blocks"`` or False.
        base_lr: a learning rate known to work at ``base_batch_size``; both or neither.
        lr_rule: ``"auto"``, ``"linear"`` or ``"sqrt"`` (``batchfit.advice.lr``).
        sweep_batch_sizes: run a CPU throughput sweep over these sizes (None: no sweep).
        sweep_steps: timed steps per swept size.
        progress: called with a short description before each slow stage.

    Raises:
        ConfigError: bad sizes, device or precision; only one of ``base_lr`` and ``base_batch_size``;
            matplotlib missing.
    """
    say = progress or (lambda _msg: None)
    _require_matplotlib()
    if (base_lr is None) != (base_batch_size is None):
        raise ConfigError("give both --base-lr and --base-batch-size (a learning rate and the batch it was tuned at)")
    wl = as_workload(workload)
    dev = get_device(device)
    global_batch = DEFAULT_GLOBAL_BATCH_SIZE if global_batch_size is None else global_batch_size
    check_batch_size(global_batch, "the global batch size")
    if batch_size is not None:
        check_batch_size(batch_size, "--batch-size")

    lr = None  # before the slow stages, so a bad learning rate fails at once
    if base_lr is not None and base_batch_size is not None:
        lr = lr_scaling(base_lr, base_batch_size, global_batch, lr_rule, optimizer=wl.optimizer)

    plan = None
    note = None
    if dev.total_bytes is None:
        note = f"{dev.name} has no memory capacity to plan against; give a GPU (--device A100-40GB) or a capacity"
    else:
        say(f"planning a global batch of {global_batch} on {gpus} x {dev.name}")
        try:
            plan = make_plan(wl, global_batch, device=dev, gpus=gpus, precision=precision, checkpointing=checkpointing)
        except DoesNotFitError as exc:
            note = str(exc)
    traced_wl = wl  # the plan's steps as it fitted them: with accumulation, gradients alive in later micro-batches
    if plan is not None and plan.accumulation_steps > 1 and batch_size is None:
        traced_wl = with_accumulation(wl, plan.accumulation_steps)
    prec = plan.precision if plan is not None else (precision or "fp32")
    ck = ("blocks" if plan.checkpointing else None) if plan is not None else checkpointing
    shard_over = gpus if plan is not None and plan.sharded else 1
    policy = policy_for(prec, bf16_supported=dev.bf16 or dev.exact, device_name=dev.name)
    classes = checkpoint_classes(ck, wl.checkpoint_blocks)
    micro = batch_size or (plan.micro_batch_size if plan is not None else 8)

    say(f"tracing one step at micro-batch {micro}")
    known: dict[int, MemoryTrace] = {micro: trace_for_device(traced_wl, micro, dev, policy, classes)}
    trace = shard_trace(known[micro], shard_over)
    est = finish_estimate(trace, traced_wl, micro, dev, policy, classes)

    say("predicting memory over batch sizes")
    largest = plan.max_micro_batch_size if plan is not None else 2 * micro
    marked = (micro, largest) if plan is not None else (micro,)
    upper = max(-(-largest * 5 // 4), micro, 4)
    curve = estimates_over_batch_sizes(
        traced_wl, dev, policy, classes, upper, known=known, marked=marked, shard_over=shard_over
    )

    sweep_result = None
    if sweep_batch_sizes:
        say(f"sweeping throughput on the CPU over batch sizes {', '.join(map(str, sweep_batch_sizes))}")
        sweep_result = sweep(wl, device="cpu", batch_sizes=list(sweep_batch_sizes), steps=sweep_steps)

    budget = None if dev.total_bytes is None else dev.total_bytes - est.context_bytes
    say("drawing figures")
    where = f"{wl.name} · {prec}{' · checkpointing' if classes else ''} · {dev.name}"
    figures = [
        plot_memory_by_batch_size(
            curve,
            title=f"Memory at the peak by micro-batch size ({where})",
            markers=_markers(micro, None if plan is None else plan.max_micro_batch_size),
        ),
        plot_memory_timeline(
            trace,
            rounded=not dev.exact,
            budget_bytes=budget,
            title=f"Memory over two training steps at micro-batch {micro} ({where})",
        ),
    ]
    if sweep_result is not None:
        figures.append(plot_throughput(sweep_result))
    return Report(
        workload=wl.name,
        device=dev.name,
        precision=prec,
        checkpointing=bool(classes),
        batch_size=micro,
        estimate=est,
        trace=trace,
        curve=tuple(curve),
        figures=tuple(figures),
        plan=plan,
        plan_note=note,
        lr=lr,
        sweep=sweep_result,
        budget_bytes=budget,
    )


def _markers(micro: int, largest: int | None) -> dict[str, int]:
    """Vertical lines of the batch-size figure: the traced micro-batch and the largest that fits (one if equal)."""
    if largest is None:
        return {"traced step": micro}
    if largest == micro:
        return {"traced step = largest that fits": micro}
    return {"traced step": micro, "largest that fits": largest}


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"the report draws figures with matplotlib, which is not installed ({exc}); pip install 'batchfit[plot]'"
        ) from None
