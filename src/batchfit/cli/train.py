"""``batchfit train``: train a preset on its deterministic synthetic data with exact accumulation.

The data: global batch ``t`` (counting from 0) holds the items with ids ``t*G .. t*G+G-1`` (``G`` the
global batch size), each built by ``Workload.items(ids, seed)`` from ``(id, seed)`` alone. The same
items therefore reach the model in every run with the same ``--seed`` and global batch, whatever the
micro-batch or the out-of-memory re-plans: two runs that differ only in ``--micro-batch-size`` end
with the same weights (bit for bit up to summation order; compare them with ``--dtype float64``).

``--device`` is ``cpu`` (this machine's CPU), ``cuda``/``cuda:N`` (a real GPU), or a simulated GPU run
on the CPU: ``simulated:NAME`` or just ``NAME``, where NAME is a catalog GPU (``T4``, ``A100-40GB``) or
a capacity (``64MiB``). A simulated GPU raises out-of-memory exactly where a GPU of that capacity
would, so ``--micro-batch-size auto`` plans for it and the trainer's OOM recovery runs for real.

This module is the command: it reads the options (``train_args.py``), runs
``batchfit.train.synthetic.train_synthetic`` (the training loop, callable from Python as
``batchfit.train_synthetic``) and shows its progress and result (``train_output.py``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import ConfigError
from ..sources import load
from .train_args import DType, _micro, _overrides, _positive
from .train_output import _log_to, _print_table, _progress


def train(
    preset: Annotated[str, typer.Argument(help="A preset name (see `batchfit presets`) or module.path:function.")],
    global_batch_size: Annotated[int, typer.Option("--global-batch-size", "-g", help="Items per optimizer step.")],
    micro_batch_size: Annotated[
        str, typer.Option("--micro-batch-size", "-m", help="Items per forward/backward, or auto (planned).")
    ] = "auto",
    steps: Annotated[int, typer.Option("--steps", "-n", help="Optimizer steps to run.")] = 5,
    device: Annotated[
        str,
        typer.Option("--device", "-d", help="cpu, cuda[:N], or a simulated GPU: simulated:64MiB, T4, 24GiB..."),
    ] = "cpu",
    precision: Annotated[
        str, typer.Option("--precision", "-p", help="fp32, bf16, fp16, bf16-true or bf16-true-autocast.")
    ] = "fp32",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the model's initialisation and of the data.")] = 0,
    dtype: Annotated[
        DType, typer.Option("--dtype", help="float64 builds model and data in double precision (exactness checks).")
    ] = DType.float32,
    save: Annotated[Path | None, typer.Option("--save", help="Write the final state_dict here (torch.save).")] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="Checkpoint after every step, atomically; if the file exists, resume from it first "
            "(on any number of processes: what an elastic restart needs).",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="A preset override KEY=VALUE (repeatable), e.g. --set hidden=128.")
    ] = None,
    shard: Annotated[
        bool,
        typer.Option(
            "--shard",
            help="Under torchrun, shard parameters, gradients and optimizer states with FSDP instead of DDP "
            "(a plan that needs it turns it on by itself).",
        ),
    ] = False,
    tp: Annotated[
        int,
        typer.Option(
            "--tp",
            help="Under torchrun, tensor-parallel groups of this many processes (inside a node), the model split "
            "by its tensor-parallel plan, FSDP across the groups.",
        ),
    ] = 1,
    sp: Annotated[bool, typer.Option("--sp", help="With --tp, sequence parallelism in the blocks.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with every step's result.")] = False,
) -> None:
    """Train a preset on deterministic synthetic data: global batch = micro-batch x accumulation, exactly."""
    import torch

    from ..train.synthetic import check_save_path, train_synthetic

    _positive(global_batch_size, "--global-batch-size")
    _positive(steps, "--steps")
    micro = _micro(micro_batch_size)
    check_save_path(save)
    if DType(dtype) is DType.float64 and precision.lower() != "fp32":
        raise ConfigError("--dtype float64 is for exactness checks in full precision; use it with --precision fp32")
    workload = load(preset, **_overrides(set_))
    with contextlib.ExitStack() as stack:
        bar: list[Any] = []  # the progress bar, from the trainer's planning on while the steps run

        def show_progress() -> None:
            bar.append(stack.enter_context(_progress(steps)))
            _log_to(stack, bar[0].console)

        run = train_synthetic(
            workload,
            global_batch_size,
            micro_batch_size=micro,
            steps=steps,
            device=device,
            precision=precision,
            seed=seed,
            dtype=torch.float64 if DType(dtype) is DType.float64 else torch.float32,
            checkpoint=checkpoint,
            save=save,
            shard=shard,
            tensor_parallel=tp,
            sequence_parallel=sp,
            on_start=None if as_json else show_progress,
            on_step=None if as_json else lambda row: bar[0].advance(row),
            name=preset,
        )
    if run.rank != 0:
        return
    if as_json:
        sys.stdout.write(json.dumps(run.to_dict(), default=str) + "\n")
        return
    _print_table(run.to_dict())
