"""The sections of the HTML report (plan, one step's estimate, throughput) and the markup they share.

Each ``_*_section`` takes a ``Report`` and returns a fragment of escaped HTML: tables of its numbers
in binary units, figures as base64 data URIs. ``html.py`` puts the fragments in order on one page;
nothing here computes a number the ``Report`` does not already hold.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..memory.categories import ORDER
from ..planning.plan import describe_split
from ..units import format_bytes
from .figures import COLORS, Figure

if TYPE_CHECKING:
    from .build import Report


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
    if getattr(est, "paged_optimizer_bytes", 0):
        device.append(["paged optimizer states (unified memory)", _e(format_bytes(est.paged_optimizer_bytes))])
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
            out.append(
                '<p class="note"><b>bf16 weights and optimizer states change the training maths (no fp32 '
                "master weights); chosen only because no configuration that keeps them fits.</b></p>"
            )
        if p.alternatives:
            alt = [
                [
                    _e(", ".join(o.remedies) or "nothing (fp32, accumulation only)"),
                    _e(f"{o.micro_batch_size} x {o.accumulation_steps}"),
                    _e(o.max_micro_batch_size),
                    _e("-" if o.device_total_bytes is None else format_bytes(o.device_total_bytes)),
                    _e("-" if o.predicted_step_s is None else f"{o.predicted_step_s:.3g} s"),
                ]
                for o in p.alternatives
            ]
            out.append("<p>Alternatives that also fit, fastest first (predicted time per global batch):</p>")
            head = ["what it changes", "micro x accum", "largest micro", "memory/GPU", "time/global batch"]
            out.append(_table(head, alt))
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
