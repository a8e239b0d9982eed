"""The HTML report: one self-contained file (figures embedded as base64 PNG) that people look at.

``build_report`` gathers what the report shows: a plan of the global batch with its alternatives, one
traced step at the plan's micro-batch (its estimate, its timeline, its snapshot), the memory curve
over batch sizes (predicted from two traces through ``TraceLine``, which reproduces a real trace's
estimate exactly when the step's code does not depend on the batch size, and traced otherwise), an
optional learning-rate scaling and an optional CPU throughput sweep. ``render_html`` turns that into
text and ``write_report`` into a file. Nothing here prints.

Example:
    >>> from batchfit.report.html import build_report, render_html
    >>> report = build_report("mlp", device="2GiB", global_batch_size=64)  # doctest: +SKIP
    >>> "<html" in render_html(report)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import base64
import datetime
import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DoesNotFitError
from ..memory.categories import ORDER
from ..memory.trace import MemoryTrace
from ..units import format_bytes
from .figures import (
    COLORS,
    Figure,
    estimates_over_batch_sizes,
    plot_memory_by_batch_size,
    plot_memory_timeline,
    plot_throughput,
)

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
    workload: Any,
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
    from ..checkpointing import checkpoint_classes
    from ..devices import get_device
    from ..memory.estimate import (
        _as_workload,
        check_batch_size,
        finish_estimate,
        trace_for_device,
        with_accumulation,
    )
    from ..memory.sharding import shard_trace
    from ..plan import plan as make_plan
    from ..precision import policy_for

    say = progress or (lambda _msg: None)
    _require_matplotlib()
    if (base_lr is None) != (base_batch_size is None):
        raise ConfigError("give both --base-lr and --base-batch-size (a learning rate and the batch it was tuned at)")
    wl = _as_workload(workload)
    dev = get_device(device)
    global_batch = DEFAULT_GLOBAL_BATCH_SIZE if global_batch_size is None else global_batch_size
    check_batch_size(global_batch, "the global batch size")
    if batch_size is not None:
        check_batch_size(batch_size, "--batch-size")

    lr = None  # before the slow stages, so a bad learning rate fails at once
    if base_lr is not None and base_batch_size is not None:
        from ..advice.lr import lr_scaling

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
        from ..sweep import sweep

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


# -- rendering ----------------------------------------------------------------------------------------------
_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.25em; margin-top: 1.8em;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.6em 0 1em; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.7em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em; vertical-align: -0.1em; }
.fits { color: #1a7f37; font-weight: bold; } .nofit { color: #cf222e; font-weight: bold; }
.note { background: #fff8c5; border-left: 4px solid #d4a72c; padding: 0.5em 0.8em; margin: 0.8em 0; }
.advice { background: #ddf4ff; border-left: 4px solid #54aeff; padding: 0.5em 0.8em; margin: 0.8em 0; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
code { background: #f4f4f4; padding: 0 0.25em; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(header: Sequence[str] | None, rows: Sequence[Sequence[Any]]) -> str:
    """Rows of already-escaped cells."""
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _img(fig: Figure, caption: str) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    return (
        f'<figure><img alt="{_e(fig.title)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def _estimate_section(r: Report) -> str:
    est = r.estimate
    rows = [
        [
            f'<span class="swatch" style="background:{COLORS[c.value]}"></span>{_e(c.value.replace("_", " "))}',
            _e(format_bytes(est.breakdown.get(c.value, 0))),
            _e(_pct(est.breakdown.get(c.value, 0), est.peak_allocated_bytes)),
        ]
        for c in ORDER
    ]
    rows.append(["<b>peak allocated</b>", f"<b>{_e(format_bytes(est.peak_allocated_bytes))}</b>", ""])
    device = [
        ["peak sits in", _e(f"{est.peak_phase} of step {est.peak_step + 1}")],
        ["peak reserved (allocator cache)", _e(format_bytes(est.peak_reserved_bytes))],
    ]
    if est.context_bytes:
        device.append(["CUDA context", _e(format_bytes(est.context_bytes))])
    device.append(["device total (nvidia-smi)", _e(format_bytes(est.device_total_bytes))])
    if est.capacity_bytes is not None:
        verdict = '<span class="fits">fits</span>' if est.fits else '<span class="nofit">does not fit</span>'
        device.append(["capacity", _e(format_bytes(est.capacity_bytes))])
        device.append(["headroom", f"{_e(format_bytes(est.headroom_bytes))} ({verdict})"])
    modules = [
        [_e(name), _e(format_bytes(v)), _e(_pct(v, est.peak_allocated_bytes))]
        for name, v in list(est.per_module.items())[:8]
    ]
    return (
        f"<h2>One step at micro-batch {r.batch_size}</h2>"
        + _table(["at the peak", "bytes", "share"], rows)
        + _table(None, device)
        + "<p>Largest holders at the peak, by the module that allocated them:</p>"
        + _table(["module", "bytes", "share"], modules)
    )


def _plan_section(r: Report) -> str:
    from ..plan import describe_split

    out = ["<h2>Plan</h2>"]
    p = r.plan
    if p is None:
        out.append(f'<p class="note">{_e(r.plan_note or "no plan")}</p>')
    else:
        rows = [
            ["global batch", _e(p.global_batch_size)],
            ["micro-batch x accumulation x GPUs", _e(f"{p.micro_batch_size} x {p.accumulation_steps} x {p.gpus}")],
            ["splits per optimizer step", _e(describe_split(p.splits))],
            ["precision", _e(p.precision)],
            ["activation checkpointing", "yes" if p.checkpointing else "no"],
            ["sharding (FSDP)", "yes" if p.sharded else "no"],
            ["remedies applied", _e(", ".join(p.remedies) or "none needed")],
            ["largest micro-batch that fits", _e(p.max_micro_batch_size)],
            ["memory per GPU", _e(format_bytes(p.estimate.device_total_bytes))],
            ["headroom per GPU", _e(format_bytes(p.headroom_bytes))],
        ]
        if p.tokens_per_step:
            rows.append(["tokens per step", _e(f"{p.tokens_per_step:,}")])
        if r.lr is not None:
            rows.append(["learning rate", _e(f"{r.lr.lr:.4g} ({r.lr.rule} rule)")])
        out.append(_table(None, rows))
        if p.changes_numerics:
            out.append('<p class="note"><b>bf16 weights and optimizer states change the training maths (no fp32 '
                       "master weights); chosen only because no configuration that keeps them fits.</b></p>")
        if p.alternatives:
            alt = [
                [
                    _e(", ".join(o.remedies) or "nothing (fp32, accumulation only)"),
                    _e(f"{o.micro_batch_size} x {o.accumulation_steps}"),
                    _e("-" if o.device_total_bytes is None else format_bytes(o.device_total_bytes)),
                    _e("-" if o.predicted_step_s is None else f"{o.predicted_step_s:.3g} s"),
                ]
                for o in p.alternatives
            ]
            out.append("<p>Alternatives that also fit, fastest first (predicted time per global batch):</p>")
            out.append(_table(["what it changes", "micro x accum", "memory/GPU", "time/global batch"], alt))
        for w in p.warnings:
            out.append(f'<p class="note">{_e(w)}</p>')
    if r.lr is not None:
        out.append(f'<p class="advice">{_e(r.lr.describe())}</p>')
    return "".join(out)


def _sweep_section(r: Report) -> str:
    s = r.sweep
    rows = []
    for p in s.points:
        marks = ", ".join(m for m, b in (("knee", s.knee), ("best", s.best)) if p.batch_size == b)
        rows.append(
            [
                _e(p.batch_size),
                _e(f"{p.seconds_per_step:.4f}"),
                _e(f"{p.items_per_second:,.1f}"),
                _e("-" if p.peak_bytes is None else format_bytes(p.peak_bytes)),
                _e(marks),
            ]
        )
    return (
        "<h2>Throughput (measured on this machine's CPU)</h2>"
        + _img(
            r.figure("throughput"),
            f"Median of {s.steps} steps per size; the knee is the smallest batch within "
            "3% of the best throughput: as fast, for less memory.",
        )
        + _table(["batch", "s/step", "items/s", "peak memory", ""], rows)
    )


def render_html(report: Report) -> str:
    """The report as one HTML document: no external file, script or font; figures as data URIs."""
    from .. import __version__

    r = report
    title = f"batchfit report: {r.workload} on {r.device}"
    budget = ""
    if r.budget_bytes is not None:
        budget = (
            f" The dashed red line is what the allocator may reserve ({format_bytes(r.budget_bytes)}: capacity less "
            "the CUDA context)."
        )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">{_e(r.precision)}{" · activation checkpointing" if r.checkpointing else ""} · '
        f"traced on fake tensors, no GPU used · batchfit {_e(__version__)} · {_e(r.created)}</p>",
        _plan_section(r),
        "<h2>Memory by batch size</h2>",
        _img(
            r.figure("memory_by_batch_size"),
            "Breakdown at the peak of one step (stacked), allocator reserve "
            "(dotted), what nvidia-smi would show (solid) and the device's capacity (dashed).",
        ),
        "<h2>Memory over one training step</h2>",
        _img(
            r.figure("memory_timeline"),
            "Live memory by category after each allocation and free of two traced "
            "steps (the first creates the optimizer state, the second is the steady state); forward, backward "
            "and optimizer phases shaded." + budget,
        ),
        _estimate_section(r),
    ]
    if r.sweep is not None:
        parts.append(_sweep_section(r))
    parts.append(
        "<h2>Limitations</h2><p>Estimated from a trace of the real step on fake tensors and a model of the CUDA "
        "caching allocator: cuDNN workspaces, other processes on the GPU and compiled regions are not modelled, and "
        "the CUDA context is a per-architecture constant (override with <code>--context-mib</code>).</p>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(report: Report, path: str | Path, *, png_dir: str | Path | None = None) -> Path:
    """Write the HTML (and, with ``png_dir``, each figure as ``<name>.png``); returns the HTML's path."""
    out = Path(path)
    if out.parent != Path():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(report), encoding="utf-8")
    if png_dir is not None:
        for fig in report.figures:
            fig.save(png_dir)
    return out
