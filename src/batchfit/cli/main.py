"""The ``batchfit`` command line: every command mirrors a Python API call and takes ``--json``.

Results go to stdout (a rich table, or one JSON object with ``--json``); diagnostics go to stderr.
Bad input ends with one line ``batchfit: error: ...`` naming the fix, and exit code 2.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from .._version import __version__
from ..errors import BatchfitError, ConfigError
from ..gpu.catalog import catalog
from ..report.plots import plot_sweep
from ..report.tables import devices_table, estimate_table, fit_table, plan_table, sweep_table
from ..sources.presets import describe, get
from . import options as opts
from .calibrate import calibrate
from .options import (
    AccumulationOpt,
    BaseBatchSizeOpt,
    BaseLrOpt,
    CheckpointBlocksOpt,
    CheckpointingOpt,
    ContextOpt,
    CudaLoadingOpt,
    CudnnBenchmarkOpt,
    DeviceOpt,
    FitBatchSizeOpt,
    FusedLossOpt,
    GpusPerNodeOpt,
    HfArgsOpt,
    InterconnectName,
    InterconnectOpt,
    JsonOpt,
    LoraOpt,
    LoraTargetsOpt,
    LrRule,
    LrRuleOpt,
    MaximizeOpt,
    OptimizerOpt,
    PrecisionOpt,
    PresetArg,
    ProfileOpt,
    SeqLenOpt,
    SeqMultipleOpt,
    SequenceParallelOpt,
    SetOpt,
    TaskOpt,
    TensorParallelOpt,
)
from .quiet import take_verbose, third_party_output
from .report import demo_report, report
from .train import train

# typer raises its click's exceptions (vendored from typer 0.29 on); find the classes through it.
_USAGE_ERROR: type[Exception] = typer.BadParameter.__mro__[1]
_CLICK_EXCEPTION: type[Exception] = typer.BadParameter.__mro__[2]

app = typer.Typer(
    help="Make any batch size trainable on the GPU memory you have.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"batchfit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="Show other libraries' warnings and logs (hidden by default); anywhere on the line."
        ),
    ] = False,
) -> None:
    """Make any batch size trainable on the GPU memory you have."""


@app.command()
def estimate(
    preset: PresetArg,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Items in one step's batch.")],
    device: DeviceOpt = "cpu",
    precision: PrecisionOpt = "fp32",
    seq_len: SeqLenOpt = None,
    optimizer: OptimizerOpt = None,
    checkpointing: CheckpointingOpt = None,
    checkpoint_blocks: CheckpointBlocksOpt = None,
    context_mib: ContextOpt = None,
    expandable_segments: Annotated[
        bool, typer.Option("--expandable-segments", help="Model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    ] = False,
    accumulation_steps: AccumulationOpt = 1,
    task: TaskOpt = None,
    lora: LoraOpt = None,
    lora_targets: LoraTargetsOpt = None,
    fused_loss: FusedLossOpt = None,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    cuda_loading: CudaLoadingOpt = None,
    cudnn_benchmark: CudnnBenchmarkOpt = False,
    tp: Annotated[int, typer.Option("--tp", help="Estimate one rank of tensor parallelism over this many GPUs.")] = 1,
    sp: Annotated[bool, typer.Option("--sp", help="With --tp, sequence parallelism in the blocks.")] = False,
    fsdp: Annotated[
        int, typer.Option("--fsdp", help="FSDP2 across this many (tensor-parallel groups of) GPUs, traced.")
    ] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Estimate the memory of one training step: breakdown at the peak, top modules, headroom."""
    from ..batching import check_batch_size
    from ..planning.estimate import estimate as run_estimate

    check_batch_size(batch_size, "--batch-size")
    check_batch_size(accumulation_steps, "--accumulation-steps")
    dev = opts.device(device, context_mib, profile, cuda_loading, cudnn_benchmark)
    wl = opts.workload(preset, seq_len, optimizer, set_, task, lora, lora_targets, fused_loss)
    est = run_estimate(
        wl,
        batch_size,
        device=dev,
        precision=precision,
        checkpointing=opts.checkpointing(checkpointing, checkpoint_blocks),
        expandable_segments=expandable_segments,
        accumulation_steps=accumulation_steps,
        parallel=_layout(tp, sp, fsdp),
    )
    if as_json:
        opts.emit_json(est.to_dict())
        return

    opts.console().print(estimate_table(est))


@app.command()
def gpus(as_json: JsonOpt = False) -> None:
    """List the GPU catalog."""
    from dataclasses import asdict

    devices = catalog()
    if as_json:
        opts.emit_json({"devices": [asdict(d) for d in devices]})
        return

    opts.console().print(devices_table(devices))


@app.command()
def presets(as_json: JsonOpt = False) -> None:
    """List the built-in workloads."""
    rows = describe()
    if as_json:
        opts.emit_json({"presets": [{"name": n, "description": d} for n, d in rows]})
        return
    from rich.table import Table

    table = Table(title="presets", title_justify="left")
    table.add_column("name")
    table.add_column("description")
    for name, text in rows:
        table.add_row(name, text)
    opts.console().print(table)


@app.command(name="fit")
def fit_command(
    preset: PresetArg,
    device: DeviceOpt = "A100-40GB",
    precision: PrecisionOpt = "fp32",
    seq_len: SeqLenOpt = None,
    optimizer: OptimizerOpt = None,
    checkpointing: CheckpointingOpt = None,
    checkpoint_blocks: CheckpointBlocksOpt = None,
    margin: Annotated[float, typer.Option("--margin", help="Fraction of memory to keep free, e.g. 0.1.")] = 0.0,
    accumulation_steps: AccumulationOpt = 1,
    context_mib: ContextOpt = None,
    task: TaskOpt = None,
    lora: LoraOpt = None,
    lora_targets: LoraTargetsOpt = None,
    fused_loss: FusedLossOpt = None,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    cuda_loading: CudaLoadingOpt = None,
    cudnn_benchmark: CudnnBenchmarkOpt = False,
    maximize: MaximizeOpt = opts.Maximize.batch_size,
    batch_size: FitBatchSizeOpt = None,
    seq_multiple: SeqMultipleOpt = 1,
    as_json: JsonOpt = False,
) -> None:
    """Find the largest micro-batch that fits on a device (or the longest sequence at a batch), in a handful of
    traced steps."""
    from ..batching import check_batch_size
    from ..planning.fit import fit

    check_batch_size(accumulation_steps, "--accumulation-steps")

    wl = opts.workload(preset, seq_len, optimizer, set_, task, lora, lora_targets, fused_loss)
    ck = opts.checkpointing(checkpointing, checkpoint_blocks)
    target = None  # with --checkpointing auto, -b is the micro-batch to fit with the fewest blocks
    if ck == "auto" and opts.Maximize(maximize) == opts.Maximize.batch_size and batch_size is not None:
        target, batch_size = check_batch_size(batch_size, "--batch-size"), None
    with opts.progress(as_json) as show:
        result = fit(
            wl,
            opts.device(device, context_mib, profile, cuda_loading, cudnn_benchmark),
            precision=precision,
            checkpointing=ck,
            margin=margin,
            accumulation_steps=accumulation_steps,
            maximize=opts.Maximize(maximize).value,
            batch_size=batch_size,
            max_batch_size=target,
            seq_multiple=seq_multiple,
            progress=show,
        )
    if as_json:
        opts.emit_json(result.to_dict())
        return

    opts.console().print(fit_table(result))


@app.command(name="plan")
def plan_command(
    preset: PresetArg,
    global_batch_size: Annotated[int, typer.Option("--global-batch-size", "-g", help="Items per optimizer step.")],
    device: DeviceOpt = "A100-40GB",
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs (data-parallel ranks).")] = 1,
    precision: Annotated[
        str | None, typer.Option("--precision", "-p", help="Fix the precision (default: walk the remedies ladder).")
    ] = None,
    seq_len: SeqLenOpt = None,
    optimizer: OptimizerOpt = None,
    checkpointing: Annotated[
        bool | None,
        typer.Option("--checkpointing/--no-checkpointing", help="Fix checkpointing (default: as the ladder needs)."),
    ] = None,
    margin: Annotated[float, typer.Option("--margin", help="Fraction of memory to keep free, e.g. 0.1.")] = 0.0,
    base_lr: BaseLrOpt = None,
    base_batch_size: BaseBatchSizeOpt = None,
    lr_rule: LrRuleOpt = LrRule.auto,
    interconnect: InterconnectOpt = InterconnectName.nvlink,
    tp: TensorParallelOpt = None,
    sp: SequenceParallelOpt = None,
    gpus_per_node: GpusPerNodeOpt = 8,
    workers: Annotated[
        int | None,
        typer.Option("--workers", help="Processes fitting configurations at once (default: the cores; 1: one by one)."),
    ] = None,
    context_mib: ContextOpt = None,
    task: TaskOpt = None,
    lora: LoraOpt = None,
    lora_targets: LoraTargetsOpt = None,
    fused_loss: FusedLossOpt = None,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    cuda_loading: CudaLoadingOpt = None,
    cudnn_benchmark: CudnnBenchmarkOpt = False,
    hf_args: HfArgsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Plan a global batch as micro-batch x accumulation steps x GPUs, exactly."""
    from ..planning.plan import plan

    planner = plan
    parallel = _parallel_kwargs(tp, sp, gpus_per_node)
    if hf_args is not None:
        from ..integrations.transformers import training_arguments_planner

        if tp is not None and tp > 1:
            raise ConfigError("--hf-args plans for the Hugging Face Trainer, which does not split a model; drop --tp")
        planner, parallel = training_arguments_planner(hf_args), {}
    wl = opts.workload(preset, seq_len, optimizer, set_, task, lora, lora_targets, fused_loss)
    with opts.progress(as_json) as show:
        result = planner(
            wl,
            global_batch_size,
            device=opts.device(device, context_mib, profile, cuda_loading, cudnn_benchmark),
            gpus=gpus,
            precision=precision,
            checkpointing=None if checkpointing is None else ("blocks" if checkpointing else False),
            margin=margin,
            base_lr=base_lr,
            base_batch_size=base_batch_size,
            lr_rule=lr_rule.value,
            interconnect=interconnect.value,
            progress=show,
            workers=workers,
            **parallel,
        )
    if as_json:
        opts.emit_json(result.to_dict())
        return

    opts.console().print(plan_table(result))


def _layout(tp: int, sp: bool, fsdp: int) -> Any:
    """``estimate``'s layout from its flags (None: one GPU's whole step)."""
    if tp == 1 and fsdp == 1 and not sp:
        return None
    from ..workload import ParallelLayout

    return ParallelLayout(tensor_parallel=tp, sequence_parallel=sp and tp > 1, fsdp=fsdp)


def _parallel_kwargs(tp: int | None, sp: bool | None, gpus_per_node: int) -> dict[str, Any]:
    """``plan``'s tensor-parallel arguments, passed only when given (the HF planner takes none)."""
    given = {"tensor_parallel": tp, "sequence_parallel": sp}
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if kwargs or gpus_per_node != 8:
        kwargs["gpus_per_node"] = gpus_per_node
    return kwargs


@app.command(name="sweep")
def sweep_command(
    preset: PresetArg,
    device: Annotated[str, typer.Option("--device", "-d", help="cpu, or cuda when a GPU is present.")] = "cpu",
    batch_sizes: Annotated[
        str | None, typer.Option("--batch-sizes", help="Comma-separated sizes (default 1,2,4,...,64).")
    ] = None,
    steps: Annotated[int, typer.Option("--steps", help="Timed steps per size (median reported).")] = 5,
    plot: Annotated[str | None, typer.Option("--plot", help="Write a PNG of throughput and memory.")] = None,
    seq_len: SeqLenOpt = None,
    optimizer: OptimizerOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Measure real steps: throughput and peak memory by batch size, and the knee of the curve."""
    from ..planning.sweep import measurable_device, parse_batch_sizes, sweep

    measurable_device(device)  # before building anything: a GPU that is not here is refused at once
    sizes = None if batch_sizes is None else parse_batch_sizes(batch_sizes)
    wl = opts.workload(preset, seq_len, optimizer, set_)
    if as_json or not sys.stderr.isatty():
        result = sweep(wl, device=device, batch_sizes=sizes, steps=steps)
    else:
        from rich.progress import Progress

        with Progress(console=opts.console_err(), transient=True) as bar:
            task = bar.add_task("sweeping", total=None)

            def progress(i: int, total: int, b: int) -> None:
                bar.update(task, total=total, completed=i, description=f"batch {b}")

            result = sweep(wl, device=device, batch_sizes=sizes, steps=steps, progress=progress)
    out = {}
    if plot:
        out["plot"] = str(plot_sweep(result, plot))
    if as_json:
        opts.emit_json({**result.to_dict(), **out})
        return

    console = opts.console()
    console.print(sweep_table(result))
    if plot:
        console.print(f"plot written to {out['plot']}")


app.command()(report)
app.command()(train)
app.command()(calibrate)


@app.command()
def demo() -> None:
    """A tour on a built-in default: estimate, plan and train a GPT without a GPU."""
    from ..planning.estimate import estimate as run_estimate
    from ..planning.plan import plan

    console = opts.console()
    wl = get("gpt", seq_len=1024)
    console.rule("[bold]1. estimate: GPT-2 small (124M), seq 1024, batch 8, AdamW fp32, on a V100-16GB")
    est = run_estimate(wl, 8, device="V100-16GB", precision="fp32")
    console.print(estimate_table(est))
    console.rule("[bold]2. plan: a global batch of 512 sequences on one V100-16GB")
    console.print(plan_table(plan(wl, 512, device="V100-16GB", gpus=1, precision="fp32")))
    console.rule("[bold]3. train: a global batch of 8192 planned on a simulated 48 MiB GPU (runs on the CPU)")
    console.print("batchfit train mlp --global-batch-size 8192 --set hidden=512 --device simulated:48MiB --steps 3")
    train("mlp", global_batch_size=8192, set_=["hidden=512"], device="simulated:48MiB", steps=3)

    console.rule("[bold]4. report: memory by batch size and over one step, as one HTML file")
    demo_report(console)


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and turns every expected failure into one line and exit code 2.

    Returns the exit code (the console script passes it to ``sys.exit``).
    """
    args, verbose = take_verbose(list(sys.argv[1:] if argv is None else argv))
    args = opts.take_checkpointing(args)
    try:
        with third_party_output(verbose):
            rv = app(args=args, standalone_mode=False, prog_name="batchfit")
    except BatchfitError as exc:
        sys.stderr.write(f"batchfit: error: {exc}\n")
        return 2
    except _USAGE_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `batchfit` (or group): the help, not an error
            sys.stdout.write(exc.ctx.get_help() + "\n")  # type: ignore[attr-defined]
            return 0
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `batchfit {ctx.info_name} --help`)" if ctx is not None and ctx.parent is not None else ""
        sys.stderr.write(f"batchfit: error: {exc.format_message()}{hint}\n")  # type: ignore[attr-defined]
        return 2
    except typer.Abort:
        sys.stderr.write("batchfit: aborted\n")
        return 130
    except _CLICK_EXCEPTION as exc:
        sys.stderr.write(f"batchfit: error: {exc.format_message()}\n")  # type: ignore[attr-defined]
        return getattr(exc, "exit_code", 1)
    except KeyboardInterrupt:
        sys.stderr.write("batchfit: interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - nothing a user passes in may end in a traceback
        if os.environ.get("BATCHFIT_DEBUG"):
            raise
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        sys.stderr.write(
            f"batchfit: error: unexpected {type(exc).__name__}: {text} "
            "(please report it; BATCHFIT_DEBUG=1 shows the traceback)\n"
        )
        return 1
    return rv if isinstance(rv, int) else 0
