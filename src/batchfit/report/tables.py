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


def paged_note(paged_bytes: int) -> str:
    """What the paged optimizer states' line means, in one sentence."""
    return (
        f"paged optimizer states: {format_bytes(paged_bytes)} in CUDA unified memory, outside PyTorch's allocator "
        "(not in peak reserved), held on the GPU once touched (in the device total); when the GPU fills, the "
        "driver moves their pages to host RAM and back, so the step slows down instead of running out of memory"
    )


def checkpointing_words(plan: Any, block: str = "block") -> str:
    """Which blocks a checkpointing plan recomputes, in words (a block called ``block``): every block, the first k,
    the rest selectively."""
    blocks = getattr(plan, "checkpointed_blocks", None)
    if blocks is None:
        return f"every {block}"
    if not getattr(plan, "selective_rest", False):
        return f"the first {blocks} {block}s"
    return f"the first {blocks} {block}s, the rest selectively" if blocks else f"every {block}, selectively"


def estimate_table(est: Any, *, top_modules: int = 8) -> Group:
    """Breakdown at the peak, top modules, analytic vs traced, and the device's headroom."""
    blocks = getattr(est, "checkpointed_blocks", None)
    checkpointing = " · checkpointing" if est.checkpointing else ""
    selective = est.checkpointing and getattr(est, "selective_checkpointing", False)
    if est.checkpointing and blocks is not None:
        checkpointing += f" {len(blocks)} block{'s' if len(blocks) != 1 else ''}"
        checkpointing += " (the rest selective)" if selective else ""
    elif selective:
        checkpointing += " (selective)"
    title = (
        f"{est.workload} · batch {est.batch_size} · {est.precision}{checkpointing}"
        f"{f' · {est.accumulation_steps} micro-batches per step' if est.accumulation_steps > 1 else ''} · {est.device}"
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
    if est.context_bytes or getattr(est, "context_source", ""):
        device.add_row(f"CUDA context ({est.context_source or 'default'})", format_bytes(est.context_bytes))
    if est.workspace_bytes:
        device.add_row("cuBLAS workspaces (in reserved)", format_bytes(est.workspace_bytes))
    if getattr(est, "cudnn_workspace_bytes", 0):
        device.add_row("largest cuDNN conv workspace (transient)", format_bytes(est.cudnn_workspace_bytes))
    paged = getattr(est, "paged_optimizer_bytes", 0)
    if paged:
        device.add_row("paged optimizer states (unified memory)", format_bytes(paged))
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
    parts: list[Any] = [breakdown, device, modules]
    if getattr(est, "context_assumption", ""):
        parts.append(Text(f"CUDA context: {est.context_assumption}", style="dim"))
    if paged:
        parts.append(Text(paged_note(paged), style="dim"))
    notes = getattr(est, "notes", ())
    if notes:
        parts.append(Text("assumed while tracing:\n" + "\n".join(f"  - {n}" for n in notes), style="yellow"))
    return Group(*parts)


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


def fit_table(result: Any) -> Group:
    """The largest micro-batch (or the longest sequence at a batch), the attempts that found it, the estimate there."""
    seq = result.max_seq_len is not None
    head = Table(show_header=False, title=f"fit: {result.estimate.workload} on {result.device}", title_justify="left")
    head.add_column(style="bold")
    head.add_column(justify="right")
    if seq:
        longest = " (the model's longest)" if result.capped else ""
        head.add_row("longest sequence", f"{result.max_seq_len} {result.seq_unit}{longest}")
        head.add_row("at batch", str(result.max_batch_size))
        if result.seq_multiple > 1:
            head.add_row("lengths searched", f"multiples of {result.seq_multiple}")
    else:
        head.add_row("largest micro-batch", str(result.max_batch_size))
    blocks = getattr(result, "checkpointed_blocks", None)
    checkpointing = f" + checkpointing of the first {blocks} blocks" if blocks else " + checkpointing"
    head.add_row("precision", result.precision + (checkpointing if result.checkpointing else ""))
    head.add_row("budget", format_bytes(result.capacity_bytes))
    if getattr(result, "known_error", None):
        head.add_row("kept free", f"{format_bytes(result.known_error_bytes)} (measured error of this kind of model)")
    head.add_row("device total at the maximum", format_bytes(result.estimate.device_total_bytes))
    if getattr(result.estimate, "context_assumption", ""):
        head.add_row("CUDA context", result.estimate.context_assumption)
    head.add_row("steps traced or run", str(result.trials))
    attempts = Table(title="attempts", title_justify="left")
    for col in ("length" if seq else "batch", "kind", "device total", "fits"):
        attempts.add_column(col, justify="right")
    for a in result.attempts:
        total = "-" if a.device_total_bytes is None else format_bytes(a.device_total_bytes)
        point = a.seq_len if seq else a.batch_size
        blocks = getattr(a, "checkpointed_blocks", None)
        kind = a.kind if blocks is None else f"{a.kind}, {blocks} blocks"
        attempts.add_row(str(point), kind, total, Text("yes", "green") if a.fits else Text("no", "red"))
    parts = [head, attempts]
    if getattr(result, "known_error", None):
        parts.append(Text(result.known_error, style="yellow"))
    if getattr(result, "expandable_max_batch_size", None):
        from ..planning.messages import expandable_remedy

        parts.append(Text(expandable_remedy(result.max_batch_size, result.expandable_max_batch_size), style="green"))
    return Group(Text(seq_len_line(result)), *parts) if seq else Group(*parts)


def seq_len_line(result: Any) -> str:
    """One line saying the longest sequence at the batch, what it holds of the budget, and what it cost."""
    longest = ", the model's longest" if result.capped else ""
    multiple = f", a multiple of {result.seq_multiple}" if result.seq_multiple > 1 else ""
    return (
        f"longest sequence at batch {result.max_batch_size}: {result.max_seq_len} {result.seq_unit}{longest} "
        f"({format_bytes(result.estimate.device_total_bytes)} of {format_bytes(result.capacity_bytes)} on "
        f"{result.device}{multiple}; {result.trials} step{'s' if result.trials != 1 else ''} traced or run)"
    )


def plan_table(plan: Any) -> Group:
    """The plan (micro x accumulation x GPUs), its estimate, the alternatives and the warnings."""
    from ..planning.plan import describe_split

    head = Table(
        show_header=False,
        title=f"plan: global batch {plan.global_batch_size} on {plan.gpus} x {plan.device}",
        title_justify="left",
    )
    head.add_column(style="bold")
    head.add_column()
    tp = getattr(plan, "tensor_parallel", 1)
    ranks = plan.gpus // tp
    even = plan.micro_batch_size * plan.accumulation_steps * ranks == plan.global_batch_size
    head.add_row(
        "micro-batch x accumulation x GPUs" if tp == 1 else "micro-batch x accumulation x groups",
        f"{plan.micro_batch_size} x {plan.accumulation_steps} x {ranks}" + ("" if even else " (uneven splits)"),
    )
    head.add_row("splits per optimizer step", describe_split(plan.splits, "ranks" if tp == 1 else "groups"))
    head.add_row("precision", plan.precision)
    checkpointing = checkpointing_words(plan) if plan.checkpointing else "no"
    head.add_row("activation checkpointing", checkpointing)
    head.add_row("sharding (FSDP)", "yes" if plan.sharded else "no")
    if tp > 1:
        sp = " + sequence parallel" if plan.sequence_parallel else ""
        across = f", FSDP across {ranks} groups" if plan.sharded else ""
        head.add_row("tensor parallel", f"{tp} GPUs per group{sp}{across}")
    head.add_row("remedies applied", ", ".join(plan.remedies) or "none needed (accumulation only)")
    if getattr(plan, "predicted_step_s", None) is not None:
        link = f" ({plan.interconnect} between GPUs)" if plan.gpus > 1 else ""
        head.add_row("predicted time per global batch", _seconds(plan.predicted_step_s) + link)
    head.add_row("largest micro-batch that fits", str(plan.max_micro_batch_size))
    head.add_row("memory per GPU", format_bytes(plan.estimate.device_total_bytes))
    if getattr(plan.estimate, "context_assumption", ""):
        head.add_row("CUDA context", plan.estimate.context_assumption)
    head.add_row("headroom per GPU", format_bytes(plan.headroom_bytes))
    head.add_row("items per step", str(plan.items_per_step))
    if plan.tokens_per_step:
        head.add_row("tokens per step", f"{plan.tokens_per_step:,}")
    if plan.scaled_lr is not None:
        head.add_row("learning rate", f"{plan.scaled_lr:.4g} ({plan.lr_rule} rule)")
    parts: list[Any] = [head]
    if getattr(plan, "changes_numerics", False):
        parts.append(Text(
            "bf16 weights and optimizer states: this changes the training maths (no fp32 master weights); "
            "it was chosen only because no configuration that keeps them fits",
            style="bold red",
        ))  # fmt: skip
    if plan.alternatives:
        alt = Table(title="alternatives that also fit (fastest first)", title_justify="left")
        for col in ("what it changes", "micro x accum", "largest micro", "memory/GPU", "time/global batch"):
            alt.add_column(col, justify="left" if col == "what it changes" else "right")
        for o in plan.alternatives:
            total = "-" if o.device_total_bytes is None else format_bytes(o.device_total_bytes)
            changes = ", ".join(o.remedies) or "nothing (fp32, accumulation only)"
            alt.add_row(
                Text(changes, style="bold" if getattr(o, "changes_numerics", False) else ""),
                f"{o.micro_batch_size} x {o.accumulation_steps}",
                str(o.max_micro_batch_size),
                total,
                "-" if getattr(o, "predicted_step_s", None) is None else _seconds(o.predicted_step_s),
            )
        parts.append(alt)
    for w in plan.warnings:
        parts.append(Text(f"warning: {w}", style="yellow"))
    return Group(*parts)


def _seconds(seconds: float) -> str:
    if seconds >= 100:
        return f"{seconds:,.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms"


def sweep_table(result: Any) -> Table:
    """Measured throughput by batch size, the knee and the best marked."""
    table = Table(title=f"sweep: {result.workload} on {result.device} (median of {result.steps} steps)")
    for col in ("batch", "s/step", "items/s", "tokens/s", "peak memory", ""):
        table.add_column(col, justify="right")
    for p in result.points:
        mark = []
        if p.batch_size == result.knee:
            mark.append("knee")
        if p.batch_size == result.best:
            mark.append("best")
        table.add_row(
            str(p.batch_size),
            f"{p.seconds_per_step:.4f}",
            f"{p.items_per_second:,.1f}",
            "-" if p.tokens_per_second is None else f"{p.tokens_per_second:,.0f}",
            "-" if p.peak_bytes is None else format_bytes(p.peak_bytes),
            ", ".join(mark),
        )
    return table


def profile_table(profile: Any, path: str) -> Group:
    """A device profile: who it is for, the measured context and workspaces, and where it was written."""
    head = Table(show_header=False, title=f"device profile: {profile.gpu.name}", title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    gpu = profile.gpu
    head.add_row("driver / CUDA / torch", f"{gpu.driver} / {gpu.cuda} / {gpu.torch}")
    head.add_row("cuDNN", str(profile.cudnn_version or "-"))
    head.add_row("memory", format_bytes(profile.total_bytes))
    head.add_row("module loading", profile.module_loading)
    head.add_row("allocator", f"{profile.allocator_backend}, PYTORCH_CUDA_ALLOC_CONF={profile.alloc_conf or '(unset)'}")
    head.add_row("context after the first CUDA op", format_bytes(profile.bare_context_bytes))
    head.add_row("context after training steps", format_bytes(profile.context_bytes))
    head.add_row("context after cuDNN benchmark runs", format_bytes(profile.context_benchmark_bytes))
    head.add_row(
        "cuBLAS + cuBLASLt workspace",
        f"{format_bytes(profile.cublas_workspace_bytes)} per handle x {profile.cublas_handles}",
    )
    head.add_row("steps measured", ", ".join(profile.steps) or "-")
    ratios = Table(title="cuDNN convolution workspace per operand byte (largest measured)", title_justify="left")
    for col in ("mode", "forward", "backward data", "backward filter"):
        ratios.add_column(col, justify="left" if col == "mode" else "right")
    for mode, r in (("heuristics", profile.conv_workspace), ("benchmark", profile.conv_workspace_benchmark)):
        ratios.add_row(mode, f"{r.forward:.3f}", f"{r.backward_data:.3f}", f"{r.backward_filter:.3f}")
    rows = Table(title="measured convolutions", title_justify="left")
    for col in ("shape", "dtype", "direction", "mode", "operands", "workspace"):
        rows.add_column(col, justify="left" if col in ("shape", "dtype", "direction", "mode") else "right")
    for m in profile.conv_measurements:
        rows.add_row(m.shape, m.dtype, m.direction, "benchmark" if m.benchmark else "heuristics",
                     format_bytes(m.operand_bytes), format_bytes(m.workspace_bytes))  # fmt: skip
    return Group(head, ratios, rows, Text(f"written to {path}", style="green"))
