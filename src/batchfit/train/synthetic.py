"""Training a workload on its deterministic synthetic items, exactly, on one process or under torchrun.

The data: global batch ``t`` (counting from 0) holds the items with ids ``t*G .. t*G+G-1`` (``G`` the
global batch size), each built by ``Workload.items(ids, seed)`` from ``(id, seed)`` alone. Each rank
(each tensor-parallel group under ``tensor_parallel``) takes a contiguous share of it, as
``GlobalBatchSampler`` hands them out (NOTE [ Which items a rank takes ] in ``sampler.py``). The same
items therefore reach the model in every run with the same seed and global batch, whatever the
micro-batch, the out-of-memory re-plans or the number of processes: two runs that differ only in the
micro-batch size end with the same weights (bit for bit up to summation order; compare them in
float64). That makes a run a test of the trainer as much as a training run, and it is what
``batchfit train`` runs.

The device is ``cpu``, ``cuda``/``cuda:N`` (a real GPU), or a simulated GPU run on the CPU:
``simulated:NAME`` or just ``NAME``, where NAME is a catalog GPU (``T4``, ``A100-40GB``) or a
capacity (``64MiB``). A simulated GPU raises out-of-memory exactly where a GPU of that capacity
would, so ``micro_batch_size="auto"`` plans for it and the trainer's OOM recovery runs for real.

What a process does around the steps (torchrun's group, checkpoints, saving, peaks) is
``synthetic_process.py``; nothing here prints (the command line shows progress through ``on_step``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..advice.batchnorm import BatchNormWarning, batchnorm_advice
from ..batching import check_batch_size
from ..errors import ConfigError
from ..memory.steps import default_dtype
from ..precision import policy_for
from ..runtime.simulated import SimulatedDevice
from ..sources import load
from ..workload import Workload, trainable_parameters
from .distributed import distributed, shutdown
from .sampler import GlobalBatchSampler
from .save_resume import load_checkpoint, model_and_optimizer_states, read_checkpoint
from .synthetic_process import (
    check_resume,
    checkpoint_step,
    gathered_ids,
    join_process_group,
    peak_reader,
    save_atomically,
)
from .trainer import Trainer

if TYPE_CHECKING:
    from ..workload import Workload

DATA = "global batch t = item ids t*G .. t*G+G-1 of the preset's synthetic items"
"""How a run's data is made, as its summary says it."""


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """What ``train_synthetic`` did: the settings it ran with, every step's result, and the advice.

    The fields are the keys of ``batchfit train --json`` (``to_dict`` gives that object), so a
    script and the command line read a run the same way.
    """

    preset: str
    """The workload's name (the one its checkpoints are checked against on resume)."""
    global_batch_size: int
    micro_batch_size: int | None
    """The last step's micro-batch (None when a resume found nothing left to run)."""
    device: str
    precision: str
    dtype: str
    """``float32``, ``float64``, or ``bfloat16`` for the precisions that build the weights in it."""
    seed: int
    plan: dict[str, Any] | None
    """The plan of ``micro_batch_size="auto"`` (``Plan.to_dict``); None for a given micro-batch."""
    world_size: int
    sharded: bool
    tensor_parallel: int
    sequence_parallel: bool
    resumed_from_step: int | None
    steps: list[dict[str, Any]]
    """One row per step run: ``StepResult.to_dict`` with ``seconds``, ``items_per_s``,
    ``peak_reserved_bytes`` (None on the CPU) and ``step`` counted from 0 across resumes."""
    advice: list[str]
    saved: str | None
    rank: int = 0
    """This process's rank (every rank returns its run; the command line shows rank 0's)."""

    @property
    def final_loss(self) -> float:
        return self.steps[-1]["loss"]

    def to_dict(self) -> dict[str, Any]:
        """The summary ``batchfit train --json`` prints, key for key."""
        return {
            "preset": self.preset,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "device": self.device,
            "precision": self.precision,
            "dtype": self.dtype,
            "seed": self.seed,
            "data": DATA,
            "plan": self.plan,
            "world_size": self.world_size,
            "sharded": self.sharded,
            "tensor_parallel": self.tensor_parallel,
            "sequence_parallel": self.sequence_parallel,
            "resumed_from_step": self.resumed_from_step,
            "steps": self.steps,
            "final_loss": self.final_loss,
            "advice": self.advice,
            "saved": self.saved,
        }


def train_synthetic(
    workload: Workload | str,
    global_batch_size: int,
    *,
    micro_batch_size: int | str = "auto",
    steps: int = 5,
    device: str = "cpu",
    precision: str = "fp32",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    checkpoint: str | Path | None = None,
    save: str | Path | None = None,
    shard: bool = False,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    on_start: Callable[[], None] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    name: str | None = None,
) -> TrainingRun:
    """Train ``workload`` for ``steps`` optimizer steps on its synthetic items; global batch = micro-batch
    x accumulation (x processes), exactly.

    Launched by torchrun, every process calls it alike: it joins the process group (and leaves it at
    the end when it joined it), splits each global batch between the ranks and, with ``shard`` or
    ``tensor_parallel``, the model too.

    Args:
        workload: a ``Workload`` with ``items``, or a preset name (``batchfit.sources.load``).
        global_batch_size: items per optimizer step, over all processes.
        micro_batch_size: items per forward/backward, or ``"auto"`` (planned for the device).
        steps: the optimizer step to stop after, counted from 0 across resumes.
        device: ``cpu``, ``cuda[:N]``, or a simulated GPU (``simulated:64MiB``, ``T4``, ``24GiB``).
        precision: ``fp32``, ``bf16``, ``fp16``, ``bf16-true`` or ``bf16-true-autocast``.
        seed: seeds the model's initialisation and the data.
        dtype: ``torch.float64`` builds model and data in double precision (exactness checks, with fp32).
        checkpoint: a file written atomically after every step; if it exists, the run resumes from it
            first (on any number of processes: what an elastic restart needs).
        save: where to write the final ``state_dict`` (``torch.save``, atomically).
        shard: under torchrun, FSDP instead of DDP (a plan that needs it turns it on by itself).
        tensor_parallel: under torchrun, tensor-parallel groups of this many processes, FSDP across them.
        sequence_parallel: with ``tensor_parallel``, sequence parallelism in the blocks.
        on_start: called once the model is built, just before the trainer plans and the steps run.
        on_step: called with each finished step's row (the one ``TrainingRun.steps`` lists), after
            its checkpoint is written.
        name: what the run and its checkpoints call the workload; by default the preset name given,
            or ``Workload.name``.

    Returns:
        The run; under torchrun each process returns its own (``TrainingRun.rank``).

    Raises:
        ConfigError: one line naming the fix (a value out of range, an unknown device or precision,
            more processes than items, a workload without synthetic items).
        CheckpointError: ``checkpoint`` is unreadable or of another model, preset, seed or global batch.

    Example:
        >>> from batchfit import train_synthetic
        >>> run = train_synthetic("mlp", 64, micro_batch_size=16, steps=2)
        >>> [row["micro_batch_sizes"] for row in run.steps]
        [[16, 16, 16, 16], [16, 16, 16, 16]]
    """
    check_batch_size(global_batch_size, "global_batch_size")
    check_batch_size(steps, "steps")
    save = check_save_path(save)
    if not isinstance(device, str):
        raise ConfigError(
            "device must be a name: 'cpu', 'cuda[:N]' or a simulated GPU such as 'T4' or 'simulated:64MiB', "
            f"got {type(device).__name__}"
        )
    if dtype not in (torch.float32, torch.float64):
        raise ConfigError(f"dtype must be torch.float32 or torch.float64 (for exactness checks), got {dtype!r}")
    if dtype is torch.float64 and str(precision).lower() != "fp32":
        raise ConfigError("dtype=torch.float64 is for exactness checks in full precision; use it with precision='fp32'")
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    resume = read_checkpoint(checkpoint) if checkpoint is not None and checkpoint.exists() else None
    if isinstance(workload, str):
        name = workload if name is None else name
        workload = load(workload)
    elif not isinstance(workload, Workload):
        raise ConfigError(f"expected a Workload or a preset name, got {type(workload).__name__}")
    name = workload.name if name is None else name
    if workload.items is None:
        raise ConfigError(f"{name!r} has no synthetic items (Workload.items); batchfit train needs them")
    joined = not distributed()  # a group the caller set up is the caller's to leave
    place = join_process_group(device, global_batch_size, tensor_parallel)
    trainer_device, sim = _resolve_device(device, precision)
    model_dtype = policy_for(precision).param_dtype or dtype  # the precisions that build weights in bf16
    torch.manual_seed(seed)
    with default_dtype(model_dtype):
        model = workload.build_model()
    if isinstance(trainer_device, str) and trainer_device.startswith("cuda"):
        model = model.to(trainer_device)
    optimizer = workload.optimizer(trainable_parameters(model))
    items = workload.items

    tp = tensor_parallel
    sampler = rank_sampler(place.rank, place.world_size, global_batch_size, steps, tp)
    leads = place.rank % tp == 0  # one rank per group speaks for its items in the checkpoint's log

    def make_batch(ids: list[int]) -> Any:
        with default_dtype(model_dtype):
            return items(torch.tensor(ids, dtype=torch.long), seed)

    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if sim is not None:
            stack.enter_context(sim)
        # The global batch is built on the host, by a worker thread: dispatch modes are per thread, so
        # a simulated GPU counts only the micro-batches the trainer copies to it, as a real GPU would.
        loader = stack.enter_context(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", BatchNormWarning)  # logged, and returned with the results
        if on_start is not None:
            on_start()
        trainer = Trainer(
            model,
            optimizer,
            workload.loss,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            device=trainer_device,
            precision=precision,
            workload=None if model_dtype is torch.float64 else workload,  # float64: plan the model as built
            sharded=shard,
            tensor_parallel=tp,
            sequence_parallel=sequence_parallel,
            tp_plan=workload.tp_plan,
        )
        first_step, item_log = 0, []
        if resume is not None:
            payload = load_checkpoint(checkpoint, model=model, optimizer=optimizer)  # type: ignore[arg-type]
            first_step = int(payload["step"])
            item_log = list(payload["extra"].get("items", []))
            check_resume(payload, name, global_batch_size, seed)
        peak = peak_reader(sim, trainer_device)
        peak()
        sampler.position = first_step  # global batches counted across resumes
        shares = iter(sampler)

        def prefetch() -> tuple[list[int], concurrent.futures.Future] | None:
            ids = next(shares, None)
            return None if ids is None else (ids, loader.submit(make_batch, ids))

        upcoming = prefetch()
        for step in range(first_step, steps):
            assert upcoming is not None  # the sampler holds exactly the run's global batches
            ids, pending = upcoming
            batch = pending.result()
            upcoming = prefetch()
            start = time.perf_counter()
            result = trainer.step(batch)
            seconds = time.perf_counter() - start
            del batch
            row = {**result.to_dict(), "seconds": seconds, "items_per_s": global_batch_size / seconds}
            row["peak_reserved_bytes"] = peak()
            row["step"] = step  # counted from 0 across resumes, as StepResult.step
            rows.append(row)
            item_log.append(gathered_ids(ids if leads else [], place))
            if checkpoint is not None:
                checkpoint_step(checkpoint, place, model, optimizer, step + 1, item_log, name, global_batch_size, seed)
            if on_step is not None:
                on_step(row)
    advice = batchnorm_advice(model, trainer.micro_batch_size or global_batch_size, global_batch_size)
    if save is not None:
        weights, _ = model_and_optimizer_states(trainer.model, None)  # every rank: FSDP gathers them
        if place.is_main:
            save_atomically(weights, save)
        del weights
    planned = trainer.plan.to_dict() if hasattr(trainer.plan, "to_dict") else None
    sharded = trainer.sharded
    del trainer, model, optimizer  # an FSDP module alive when its group is destroyed can abort the exit
    if joined:
        shutdown(place)
    if not rows:  # resumed after the last step: nothing left to do
        rows = [{"loss": float("nan"), "micro_batch_size": None, "step": first_step}]
    return TrainingRun(
        preset=name,
        global_batch_size=global_batch_size,
        micro_batch_size=rows[-1]["micro_batch_size"],
        device=device,
        precision=precision,
        dtype=str(model_dtype).removeprefix("torch."),
        seed=seed,
        plan=planned,
        world_size=place.world_size,
        sharded=sharded,
        tensor_parallel=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        resumed_from_step=first_step if resume is not None else None,
        steps=rows,
        advice=[advice] if advice else [],
        saved=str(save) if save is not None else None,
        rank=place.rank,
    )


def rank_sampler(
    rank: int, world_size: int, global_batch_size: int, steps: int, tensor_parallel: int = 1
) -> GlobalBatchSampler:
    """The sampler of this rank's item ids in global batches ``0 .. steps-1``: ids in order (one epoch
    of exactly the run's global batches), the tensor-parallel group as the sampler's rank (its ranks
    take the same items) and the number of groups as its world.

    Global batch ``t`` is then ids ``t*G .. t*G+G-1``, each group a contiguous share of it
    (``batching.rank_shares``); a resume sets ``position`` to the step it continues from.
    """
    groups = max(1, world_size // tensor_parallel)
    group = rank // tensor_parallel if world_size % tensor_parallel == 0 else rank
    return GlobalBatchSampler(
        steps * global_batch_size, global_batch_size, rank=group, world_size=groups, shuffle=False
    )


def check_save_path(save: str | Path | None) -> Path | None:
    """``save`` as a path whose directory exists, checked before a run rather than after its last step."""
    if save is None:
        return None
    path = Path(save)
    if not path.resolve().parent.is_dir():
        raise ConfigError(f"cannot save to {str(save)!r}: directory {str(path.resolve().parent)!r} does not exist")
    return path


def _resolve_device(text: str, precision: str) -> tuple[Any, Any]:
    """``(device for the Trainer, SimulatedDevice or None)`` from a device name (see the module docstring).

    A simulated GPU is made with the precision policy of the GPU it stands for, so a bf16 run on a GPU
    without bf16 fails here, as it would on that GPU.
    """
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
