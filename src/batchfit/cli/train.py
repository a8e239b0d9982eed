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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import ConfigError


class DType(str, Enum):
    """Default dtype the model and data are built in."""

    float32 = "float32"
    float64 = "float64"


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise ConfigError(f"{flag} must be a whole number >= 1, got {value}")
    return value


def _micro(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--micro-batch-size takes a whole number or 'auto', got {text!r}") from None
    return _positive(value, "--micro-batch-size")


def _overrides(sets: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set takes KEY=VALUE, got {item!r}; e.g. --set hidden=128")
        out[key.strip()] = value.strip()  # presets parse strings themselves
    return out


def _device(text: str, precision: str) -> tuple[Any, Any]:
    """``(device for the Trainer, SimulatedDevice or None)`` from ``--device``."""
    import torch

    from ..precision import policy_for
    from ..simulated import SimulatedDevice

    spec = text.strip()
    if spec.lower() == "cpu" or spec.lower().split(":")[0] == "cuda":
        policy_for(precision)  # validates the name
        if spec.lower() != "cpu" and not torch.cuda.is_available():
            raise ConfigError(f"--device {spec} needs a GPU but none is visible; use cpu or a simulated GPU, e.g. T4")
        return spec.lower(), None
    name = spec[len("simulated:") :] if spec.lower().startswith("simulated:") else spec
    if not name:
        raise ConfigError("--device simulated: needs a GPU name or a capacity, e.g. simulated:64MiB")
    probe = SimulatedDevice(name)  # resolves the name or capacity; raises ConfigError with the fix
    policy = policy_for(precision, bf16_supported=probe.device.bf16, device_name=probe.device.name)
    sim = SimulatedDevice(name, policy=policy)
    return sim, sim


def _save(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then an atomic rename over it."""
    import torch

    parent = path.resolve().parent
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _split_text(sizes: tuple[int, ...]) -> str:
    """``16 x 4`` for even micro-batches, ``4+3+3`` for short uneven ones."""
    if len(set(sizes)) == 1:
        return f"{sizes[0]} x {len(sizes)}"
    if len(sizes) <= 4:
        return "+".join(str(s) for s in sizes)
    return f"{len(sizes)} of {min(sizes)}-{max(sizes)}"


def _peak_reader(sim: Any, device: Any) -> Callable[[], int | None]:
    """A function returning the device's peak reserved bytes since the previous call (None on the CPU)."""
    import torch

    if sim is not None:

        def simulated() -> int:
            peak = sim.stats().peak_reserved_bytes
            sim.reset_peak()
            return peak

        return simulated
    if str(device).startswith("cuda"):

        def cuda() -> int:
            peak = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            return peak

        return cuda
    return lambda: None


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
    precision: Annotated[str, typer.Option("--precision", "-p", help="fp32, bf16, fp16 or bf16-true.")] = "fp32",
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
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with every step's result.")] = False,
) -> None:
    """Train a preset on deterministic synthetic data: global batch = micro-batch x accumulation, exactly."""
    import torch

    from ..advice.batchnorm import BatchNormWarning, batchnorm_advice
    from ..batching import rank_shares
    from ..memory.steps import default_dtype
    from ..sources import load
    from ..train.checkpoint import load_checkpoint, model_and_optimizer_states
    from ..train.distributed import shutdown
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
    from ..train.checkpoint import read_checkpoint

    resume = read_checkpoint(checkpoint) if checkpoint is not None and checkpoint.exists() else None
    workload = load(preset, **_overrides(set_))
    if workload.items is None:
        raise ConfigError(f"{preset!r} has no synthetic items (Workload.items); batchfit train needs them")
    place = _join_process_group(device, global_batch_size)
    trainer_device, sim = _device(device, precision)
    if precision.lower() == "bf16-true":
        model_dtype = torch.bfloat16
    torch.manual_seed(seed)
    with default_dtype(model_dtype):
        model = workload.build_model()
    if isinstance(trainer_device, str) and trainer_device.startswith("cuda"):
        model = model.to(trainer_device)
    optimizer = workload.optimizer(trainable_parameters(model))
    items = workload.items

    shares = rank_shares(global_batch_size, place.world_size)
    first_id = sum(shares[: place.rank])

    def rank_ids(step: int) -> torch.Tensor:
        start = step * global_batch_size + first_id  # this rank's contiguous part of global batch t
        return torch.arange(start, start + shares[place.rank])

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
            item_log.append(_gathered_ids(rank_ids(step), place))
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


class _Progress:
    """A rich progress bar on stderr showing the last step's loss, split, items/s and memory."""

    def __init__(self, steps: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self._bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self._task = self._bar.add_task("train", total=steps, status="")

    def advance(self, loss: float, split: str, row: dict[str, Any]) -> None:
        from ..units import format_bytes

        memory = "" if row["peak_reserved_bytes"] is None else f"  peak {format_bytes(row['peak_reserved_bytes'])}"
        status = f"loss {loss:.4f}  micro x accum {split}  {row['items_per_s']:,.0f} items/s{memory}"
        self._bar.update(self._task, advance=1, status=status)


@contextlib.contextmanager
def _progress(steps: int) -> Iterator[_Progress]:
    progress = _Progress(steps)
    with progress._bar:
        yield progress


def _log_to(stack: contextlib.ExitStack, console: Any) -> None:
    """Route batchfit's log (OOM re-plans, advice) through the progress bar's console while it runs."""
    from rich.logging import RichHandler

    logger = logging.getLogger("batchfit")
    handler = RichHandler(console=console, show_time=False, show_path=False, level=logging.INFO)
    logger.addHandler(handler)
    stack.callback(logger.removeHandler, handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        old = logger.level
        logger.setLevel(logging.INFO)
        stack.callback(logger.setLevel, old)


def _print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..units import format_bytes

    rows = summary["steps"]
    first = rows[0]
    console = Console()
    console.print(
        f"batchfit train {summary['preset']}: global batch {summary['global_batch_size']} = micro-batch "
        f"{first['micro_batch_size']} x {first['accumulation_steps']} accumulation steps on {summary['device']}"
        + (f", FSDP over {summary['world_size']} ranks" if summary["sharded"] else "")
        + (" (planned)" if summary["plan"] else ""),
        soft_wrap=True,
    )
    table = Table()
    for name in ("step", "loss", "micro x accum", "items/s"):
        table.add_column(name, justify="right")
    show_memory = rows[0]["peak_reserved_bytes"] is not None
    if show_memory:
        table.add_column("peak reserved", justify="right")
    table.add_column("note")
    for row in rows:
        cells = [str(row["step"] + 1), f"{row['loss']:.4f}", _split_text(tuple(row["micro_batch_sizes"]))]
        cells.append(f"{row['items_per_s']:,.0f}")
        if show_memory:
            cells.append(format_bytes(row["peak_reserved_bytes"]))
        notes = [
            f"OOM in {r['phase']}: micro {r['from_micro_batch_size']} -> {r['to_micro_batch_size']}"
            for r in row["replanned"]
        ]
        if row["skipped"]:
            notes.append("fp16 overflow: step skipped")
        table.add_row(*cells, "; ".join(notes))
    console.print(table)
    for text in summary["advice"]:
        console.print(f"advice: {text}", soft_wrap=True)
    if summary["saved"]:
        console.print(f"saved the final weights to {summary['saved']}")


def _join_process_group(device: str, global_batch_size: int) -> Any:
    """Under torchrun, join the process group (gloo on CPU and simulated GPUs, NCCL on CUDA)."""
    import torch

    from ..train.distributed import init_distributed, launched_by_torchrun

    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    if world > global_batch_size:
        raise ConfigError(
            f"{world} processes cannot share a global batch of {global_batch_size} (each needs an item); "
            f"use --global-batch-size >= {world} or fewer processes"
        )
    if world == 1:  # a single process: nothing to join (the device is checked where it is used)
        from ..train.distributed import Place

        return Place(0, 1, 0, torch.device("cpu"), None)
    return init_distributed("cuda" if device.startswith("cuda") else "cpu")


def _gathered_ids(ids: Any, place: Any) -> list[int]:
    """Every rank's item ids of one step, in rank order (the item accounting a checkpoint keeps)."""
    mine = ids.tolist()
    if not place.distributed:
        return mine
    import torch.distributed as dist

    parts: list[Any] = [None] * place.world_size
    dist.all_gather_object(parts, mine)
    return [i for part in parts for i in part]


def _checkpoint(
    path: Path,
    place: Any,
    model: Any,
    optimizer: Any,
    step: int,
    item_log: list[list[int]],
    preset: str,
    global_batch_size: int,
    seed: int,
) -> None:
    """Rank 0 writes the checkpoint of a finished step (every rank joins: FSDP gathers the states whole);
    every rank waits for the file (no step runs ahead)."""
    from ..train.checkpoint import save_checkpoint
    from ..train.distributed import barrier

    save_checkpoint(
        path,
        model=model,
        optimizer=optimizer,
        step=step,
        plan={"global_batch_size": global_batch_size, "world_size": place.world_size},
        extra={"items": item_log, "preset": preset, "seed": seed},
    )
    barrier(place)


def _check_resume(payload: dict[str, Any], preset: str, global_batch_size: int, seed: int) -> None:
    """Refuse to continue a run with other data: same preset, seed and global batch, or nothing."""
    from ..errors import CheckpointError

    extra, plan = payload.get("extra", {}), payload.get("plan") or {}
    saved = (extra.get("preset"), extra.get("seed"), plan.get("global_batch_size"))
    if saved != (preset, seed, global_batch_size):
        raise CheckpointError(
            f"the checkpoint is of {saved[0]} with seed {saved[1]} and global batch {saved[2]}, not {preset} with "
            f"seed {seed} and global batch {global_batch_size}; resume with the same settings or another path"
        )
