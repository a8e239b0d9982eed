"""``batchfit report``: the HTML report, its figures as PNG and the memory snapshot, from the command line.

``report`` is a plain Typer-annotated function; ``cli.py`` registers it (``app.command()(report)``).
``demo_report`` is the last stage of ``batchfit demo``. Helpers of ``cli.py`` are imported when a
command runs, not at import time, so either module can be imported first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..sources.presets import get
from .options import BaseBatchSizeOpt, BaseLrOpt, LrRule, LrRuleOpt

if TYPE_CHECKING:
    from ..workload import Workload


def report(
    preset: Annotated[str, typer.Argument(help="A preset name (see `batchfit presets`) or module.path:function.")],
    device: Annotated[
        str, typer.Option("--device", "-d", help="A catalog GPU (see `batchfit gpus`), a capacity like 24GiB, or cpu.")
    ] = "A100-40GB",
    output: Annotated[str, typer.Option("--output", "-o", help="The HTML file to write.")] = "report.html",
    global_batch_size: Annotated[
        int | None, typer.Option("--global-batch-size", "-g", help="Items per optimizer step to plan (default 512).")
    ] = None,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs (data-parallel ranks) of the plan.")] = 1,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "-b", help="Micro-batch of the traced step (default: the plan's).")
    ] = None,
    precision: Annotated[
        str | None, typer.Option("--precision", "-p", help="Fix the precision (default: walk the remedies ladder).")
    ] = None,
    checkpointing: Annotated[
        bool | None,
        typer.Option("--checkpointing/--no-checkpointing", help="Fix checkpointing (default: as the ladder needs)."),
    ] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Sequence length (language-model presets).")] = None,
    optimizer: Annotated[str | None, typer.Option("--optimizer", help="adamw, adam or sgd (presets).")] = None,
    base_lr: BaseLrOpt = None,
    base_batch_size: BaseBatchSizeOpt = None,
    lr_rule: LrRuleOpt = LrRule.auto,
    sweep: Annotated[bool, typer.Option("--sweep", help="Also measure throughput on this CPU (slower).")] = False,
    sweep_batch_sizes: Annotated[
        str, typer.Option("--sweep-batch-sizes", help="Comma-separated sizes for --sweep.")
    ] = "1,2,4,8,16",
    png_dir: Annotated[
        str | None, typer.Option("--png-dir", help="Also write each figure as a PNG into this directory.")
    ] = None,
    snapshot: Annotated[
        str | None,
        typer.Option(
            "--snapshot",
            help="Also write the traced step as a PyTorch memory snapshot (.pickle) for pytorch.org/memory_viz.",
        ),
    ] = None,
    context_mib: Annotated[
        float | None, typer.Option("--context-mib", help="Override the device's CUDA context size (MiB).")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="A preset override KEY=VALUE (repeatable), e.g. --set n_layer=4.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
) -> None:
    """Write an HTML report: the plan, memory by batch size, one step's memory timeline, optional throughput."""
    from ..planning.sweep import parse_batch_sizes
    from .options import device as _device
    from .options import workload as _workload

    wl = _workload(preset, seq_len, optimizer, set_)
    dev = _device(device, context_mib)
    written = _write(
        wl,
        dev,
        output,
        png_dir=png_dir,
        snapshot=snapshot,
        quiet=as_json,
        global_batch_size=global_batch_size,
        gpus=gpus,
        batch_size=batch_size,
        precision=precision,
        checkpointing=None if checkpointing is None else ("blocks" if checkpointing else False),
        base_lr=base_lr,
        base_batch_size=base_batch_size,
        lr_rule=lr_rule.value,
        sweep_batch_sizes=parse_batch_sizes(sweep_batch_sizes, "--sweep-batch-sizes") if sweep else None,
    )
    if as_json:
        sys.stdout.write(json.dumps(written, default=str) + "\n")
        return
    sys.stdout.write(f"report written to {written['report']}\n")
    for png in written["png"]:
        sys.stdout.write(f"figure written to {png}\n")
    if written["snapshot"]:
        sys.stdout.write(
            f"snapshot written to {written['snapshot']} (view: python -m torch.cuda._memory_viz trace_plot "
            f"{written['snapshot']} -o trace.html, or drop it on https://pytorch.org/memory_viz)\n"
        )


def _write(
    wl: Workload, dev: Any, output: str | Path, *, png_dir: Any, snapshot: Any, quiet: bool, **options: Any
) -> dict[str, Any]:
    """Build and write the report (and PNGs, snapshot); returns what was written, for text or JSON."""
    from ..memory.allocator.snapshot import write_snapshot
    from ..report.html import build_report, write_report

    if quiet or not sys.stderr.isatty():
        built = build_report(wl, device=dev, **options)
    else:
        from rich.console import Console

        with Console(stderr=True).status("report") as status:
            built = build_report(wl, device=dev, progress=lambda msg: status.update(msg), **options)
    path = write_report(built, output, png_dir=png_dir)
    pngs = [str(Path(png_dir) / f"{f.name}.png") for f in built.figures] if png_dir else []
    snap = str(write_snapshot(built.trace, snapshot, capacity_bytes=built.budget_bytes)) if snapshot else None
    return {
        "report": str(path.resolve()),
        "png": pngs,
        "snapshot": snap,
        "estimate": built.estimate.to_dict(),
        "plan": None if built.plan is None else built.plan.to_dict(),
        "plan_note": built.plan_note,
        "lr": None if built.lr is None else built.lr.to_dict(),
        "sweep": None if built.sweep is None else built.sweep.to_dict(),
    }


def demo_report(console: Any, path: str | Path = "batchfit-report.html") -> Path:
    """The demo's last stage: the report of GPT-2 small (seq 1024) on a V100-16GB, global batch 512.

    Prints the report's path on ``console`` and returns it.
    """
    from ..report.html import build_report, write_report

    with console.status("writing the report") as status:
        built = build_report(
            get("gpt", seq_len=1024),
            device="V100-16GB",
            global_batch_size=512,
            precision="fp32",
            progress=lambda msg: status.update(msg),
        )
        out = write_report(built, path).resolve()
    console.print(f"report written to {out}")
    return out
