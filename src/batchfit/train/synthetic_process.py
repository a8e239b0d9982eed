"""The process side of a synthetic training run: torchrun's group, checkpoints, saving, peaks.

A run under torchrun joins the process group before anything is built, checkpoints after every step
(rank 0 writes, every rank waits) with the item ids each step used, refuses to resume a checkpoint
made with other data, and writes files atomically; the device's peak memory is read per step. The
loop that calls these is ``synthetic.py``; they are apart from it so that the loop reads as the
steps of training and these as what a process must do around them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError


def save_atomically(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then an atomic rename over it: a run killed
    while saving leaves the old file or the new one, never half of one."""
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


def peak_reader(sim: Any, device: Any) -> Callable[[], int | None]:
    """A function returning the device's peak reserved bytes since the previous call (None on the CPU),
    so that each step reports its own peak rather than the run's."""
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


def join_process_group(device: str, global_batch_size: int, tensor_parallel: int = 1) -> Any:
    """Under torchrun, join the process group (gloo on CPU and simulated GPUs, NCCL on CUDA).

    The world is checked against the global batch first: a process without an item would have no
    gradient to contribute, and finding out after the group is up costs every rank a timeout.
    """
    import torch

    from .distributed import init_distributed, launched_by_torchrun
    from .tensor_parallel import check_tensor_parallel

    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    ranks = world // check_tensor_parallel(tensor_parallel, world)  # a tensor-parallel group takes one share
    if ranks > global_batch_size:
        raise ConfigError(
            f"{ranks} processes cannot share a global batch of {global_batch_size} (each needs an item); "
            f"use --global-batch-size >= {ranks} or fewer processes"
        )
    if world == 1:  # a single process: nothing to join (the device is checked where it is used)
        from .distributed import Place

        return Place(0, 1, 0, torch.device("cpu"), None)
    return init_distributed("cuda" if device.startswith("cuda") else "cpu")


def gathered_ids(ids: list[int], place: Any) -> list[int]:
    """Every rank's item ids of one step, in rank order (the item accounting a checkpoint keeps)."""
    if not place.distributed:
        return list(ids)
    import torch.distributed as dist

    parts: list[Any] = [None] * place.world_size
    dist.all_gather_object(parts, list(ids))
    return [i for part in parts for i in part]


def checkpoint_step(
    path: Path,
    place: Any,
    model: Any,
    optimizer: Any,
    step: int,
    item_log: list[list[int]],
    name: str,
    global_batch_size: int,
    seed: int,
) -> None:
    """Rank 0 writes the checkpoint of a finished step (every rank joins: FSDP gathers the states whole);
    every rank waits for the file (no step runs ahead)."""
    from .distributed import barrier
    from .save_resume import save_checkpoint

    save_checkpoint(
        path,
        model=model,
        optimizer=optimizer,
        step=step,
        plan={"global_batch_size": global_batch_size, "world_size": place.world_size},
        extra={"items": item_log, "preset": name, "seed": seed},
    )
    barrier(place)


def check_resume(payload: dict[str, Any], name: str, global_batch_size: int, seed: int) -> None:
    """Refuse to continue a run with other data: same preset, seed and global batch, or nothing."""
    extra, plan = payload.get("extra", {}), payload.get("plan") or {}
    saved = (extra.get("preset"), extra.get("seed"), plan.get("global_batch_size"))
    if saved != (name, seed, global_batch_size):
        raise CheckpointError(
            f"the checkpoint is of {saved[0]} with seed {saved[1]} and global batch {saved[2]}, not {name} with "
            f"seed {seed} and global batch {global_batch_size}; resume with the same settings or another path"
        )
