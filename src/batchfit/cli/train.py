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

This module is the command and its training loop; reading the options is ``train_args.py``, the
process side (torchrun's group, checkpoints, saving) ``train_run.py``, and what it shows
``train_output.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import ConfigError
from .train_args import DType, _device, _micro, _overrides, _positive
from .train_output import _log_to, _print_table, _progress, _split_text
from .train_run import _check_resume, _checkpoint, _gathered_ids, _join_process_group, _peak_reader, _save


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

    from ..advice.batchnorm import BatchNormWarning, batchnorm_advice
    from ..batching import rank_shares
    from ..memory.steps import default_dtype
    from ..precision import policy_for
    from ..sources import load
    from ..train.distributed import shutdown
    from ..train.save_resume import load_checkpoint, model_and_optimizer_states
    from ..train.trainer import Trainer
    from ..workload import trainable_parameters

    _positive(global_batch_size, "--global-batch-size")
    _positive(steps, "--steps")
    micro = _micro(micro_batch_size)
    if save is not None and not save.resolve().parent.is_dir():
        raise ConfigError(f"cannot save to {str(save)!r}: directory {str(save.resolve().parent)!r} does not exist")
    model_dtype = torch.float64 if DType(dtype) is DType.float64 else torch.float32
    if model_dtype is torch.float64 and precision.lower() != "fp32":
        raise ConfigError("--dtype float64 is for exactness checks in full precision; use it with --precision fp32")
    from ..train.save_resume import read_checkpoint

    resume = read_checkpoint(checkpoint) if checkpoint is not None and checkpoint.exists() else None
    workload = load(preset, **_overrides(set_))
    if workload.items is None:
        raise ConfigError(f"{preset!r} has no synthetic items (Workload.items); batchfit train needs them")
    place = _join_process_group(device, global_batch_size, tp)
    trainer_device, sim = _device(device, precision)
    model_dtype = policy_for(precision).param_dtype or model_dtype  # the precisions that build weights in bf16
    torch.manual_seed(seed)
    with default_dtype(model_dtype):
        model = workload.build_model()
    if isinstance(trainer_device, str) and trainer_device.startswith("cuda"):
        model = model.to(trainer_device)
    optimizer = workload.optimizer(trainable_parameters(model))
    items = workload.items

    groups = max(1, place.world_size // tp)  # the ranks of a tensor-parallel group take the same items
    shares = rank_shares(global_batch_size, groups)
    group = place.rank // tp if place.world_size % tp == 0 else place.rank
    first_id = sum(shares[:group])

    def rank_ids(step: int) -> torch.Tensor:
        start = step * global_batch_size + first_id  # this rank's (group's) contiguous part of global batch t
        return torch.arange(start, start + shares[group])

    def make_batch(step: int) -> Any:
        with default_dtype(model_dtype):
            return items(rank_ids(step), seed)

    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if sim is not None:
            stack.enter_context(sim)
        # The global batch is built on the host, by a worker thread: dispatch modes are per thread, so
        # a simulated GPU counts only the micro-batches the trainer copies to it, as a real GPU would.
        loader = stack.enter_context(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", BatchNormWarning)  # logged, and printed with the results
        progress = None if as_json else stack.enter_context(_progress(steps))
        if progress is not None:
            _log_to(stack, progress.console)
        trainer = Trainer(
            model,
            optimizer,
            workload.loss,
            global_batch_size=global_batch_size,
            micro_batch_size=micro,
            device=trainer_device,
            precision=precision,
            workload=None if model_dtype is torch.float64 else workload,  # float64: plan the model as built
            sharded=shard,
            tensor_parallel=tp,
            sequence_parallel=sp,
            tp_plan=workload.tp_plan,
        )
        first_step, item_log = 0, []
        if resume is not None:
            payload = load_checkpoint(checkpoint, model=model, optimizer=optimizer)  # type: ignore[arg-type]
            first_step = int(payload["step"])
            item_log = list(payload["extra"].get("items", []))
            _check_resume(payload, preset, global_batch_size, seed)
        peak = _peak_reader(sim, trainer_device)
        peak()
        upcoming = loader.submit(make_batch, first_step) if first_step < steps else None
        for step in range(first_step, steps):
            batch = upcoming.result()
            if step + 1 < steps:
                upcoming = loader.submit(make_batch, step + 1)
            start = time.perf_counter()
            result = trainer.step(batch)
            seconds = time.perf_counter() - start
            del batch
            row = {**result.to_dict(), "seconds": seconds, "items_per_s": global_batch_size / seconds}
            row["peak_reserved_bytes"] = peak()
            row["step"] = step  # counted from 0 across resumes, as StepResult.step
            rows.append(row)
            item_log.append(_gathered_ids(rank_ids(step) if place.rank % tp == 0 else rank_ids(step)[:0], place))
            if checkpoint is not None:
                _checkpoint(checkpoint, place, model, optimizer, step + 1, item_log, preset, global_batch_size, seed)
            if progress is not None:
                progress.advance(result.loss, _split_text(result.micro_batch_sizes), row)
    advice = batchnorm_advice(model, trainer.micro_batch_size or global_batch_size, global_batch_size)
    if save is not None:
        weights, _ = model_and_optimizer_states(trainer.model, None)  # every rank: FSDP gathers them
        if place.is_main:
            _save(weights, save)
        del weights
    planned = trainer.plan.to_dict() if hasattr(trainer.plan, "to_dict") else None
    sharded = trainer.sharded
    del trainer, model, optimizer  # an FSDP module alive when its group is destroyed can abort the exit
    shutdown(place)
    if not rows:  # resumed after the last step: nothing left to do
        rows = [{"loss": float("nan"), "micro_batch_size": None, "step": first_step}]
    if not place.is_main:
        return
    summary = {
        "preset": preset,
        "global_batch_size": global_batch_size,
        "micro_batch_size": rows[-1]["micro_batch_size"],
        "device": device,
        "precision": precision,
        "dtype": str(model_dtype).removeprefix("torch."),
        "seed": seed,
        "data": "global batch t = item ids t*G .. t*G+G-1 of the preset's synthetic items",
        "plan": planned,
        "world_size": place.world_size,
        "sharded": sharded,
        "tensor_parallel": tp,
        "sequence_parallel": sp and tp > 1,
        "resumed_from_step": first_step if resume is not None else None,
        "steps": rows,
        "final_loss": rows[-1]["loss"],
        "advice": [advice] if advice else [],
        "saved": str(save) if save is not None else None,
    }
    if as_json:
        sys.stdout.write(json.dumps(summary, default=str) + "\n")
        return
    _print_table(summary)
