"""Rich tables: the only place where bytes become text for a terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..memory.categories import ORDER
from ..units import format_bytes


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else "-"


def estimate_table(est: Any, *, top_modules: int = 8) -> Group:
    """Breakdown at the peak, top modules, analytic vs traced, and the device's headroom."""
    title = (
        f"{est.workload} · batch {est.batch_size} · {est.precision}"
        f"{' · checkpointing' if est.checkpointing else ''} · {est.device}"
    )
    breakdown = Table(title=title, title_justify="left")
    breakdown.add_column("at the peak", style="bold")
    breakdown.add_column("bytes", justify="right")
    breakdown.add_column("share", justify="right")
    breakdown.add_column("analytic", justify="right", style="dim")
    for cat in ORDER:
        value = est.breakdown.get(cat.value, 0)
        analytic = est.analytic.get(cat.value) if est.analytic else None
        breakdown.add_row(
            cat.value.replace("_", " "),
            format_bytes(value),
            _pct(value, est.peak_allocated_bytes),
            "-" if analytic is None else format_bytes(analytic),
        )
    breakdown.add_section()
    breakdown.add_row(
        "peak allocated",
        format_bytes(est.peak_allocated_bytes),
        "",
        format_bytes(est.analytic.get("total", 0)) if est.analytic else "-",
    )

    device = Table(show_header=False, title="device", title_justify="left")
    device.add_column(style="bold")
    device.add_column(justify="right")
    device.add_row("peak sits in", f"{est.peak_phase} of step {est.peak_step + 1}")
    device.add_row("peak allocated", format_bytes(est.peak_allocated_bytes))
    device.add_row("peak reserved (allocator cache)", format_bytes(est.peak_reserved_bytes))
    if est.context_bytes:
        device.add_row("CUDA context", format_bytes(est.context_bytes))
    if est.workspace_bytes:
        device.add_row("cuBLAS workspaces (in reserved)", format_bytes(est.workspace_bytes))
    device.add_row("device total (nvidia-smi)", format_bytes(est.device_total_bytes))
    if est.capacity_bytes is not None:
        device.add_row("capacity", format_bytes(est.capacity_bytes))
        headroom = est.headroom_bytes
        style = "green" if headroom >= 0 else "red"
        verdict = "fits" if headroom >= 0 else "does NOT fit"
        device.add_row("headroom", Text(f"{format_bytes(headroom)} ({verdict})", style=style))

    modules = Table(title=f"top {top_modules} modules at the peak", title_justify="left")
    modules.add_column("module")
    modules.add_column("bytes", justify="right")
    modules.add_column("share", justify="right")
    for name, value in list(est.per_module.items())[:top_modules]:
        modules.add_row(name, format_bytes(value), _pct(value, est.peak_allocated_bytes))
    return Group(breakdown, device, modules)


def devices_table(devices: list[Any]) -> Table:
    """The GPU catalog."""
    table = Table(title="GPU catalog", title_justify="left")
    for col, justify in (
        ("name", "left"),
        ("memory", "right"),
        ("arch", "left"),
        ("sm", "right"),
        ("bf16", "center"),
        ("context", "right"),
        ("cuBLAS ws x handles", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for d in devices:
        table.add_row(
            d.name,
            format_bytes(d.total_bytes),
            d.arch,
            f"{d.compute_capability[0]}.{d.compute_capability[1]}",
            "yes" if d.bf16 else "no",
            format_bytes(d.context_bytes),
            f"{format_bytes(d.cublas_workspace_bytes)} x {d.cublas_handles}",
        )
    return table
