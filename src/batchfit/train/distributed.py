"""torch.distributed glue: where this process is, its device, and the model wrapped for it.

Launch with ``torchrun`` (single node: ``torchrun --nproc_per_node=N``; several nodes and elastic
restarts: see the README); the process group comes from torchrun's environment variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...). Backend choice lives in one
function: NCCL when the process has a CUDA device, gloo otherwise (CPU runs and tests).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class Place:
    """This process in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """None on a single process without a process group."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def choose_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for everything else (the one place backends are chosen)."""
    return "nccl" if device.type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher using its variables) started this process."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(device: str | None = None, timeout_s: float = 120.0) -> Place:
    """Join the process group torchrun describes (or stay a single process) and pick the device.

    Args:
        device: ``"cuda"``/``"cpu"``; None picks CUDA when available. Each rank uses
            ``cuda:LOCAL_RANK``.
        timeout_s: how long collective operations may wait before failing (a dead peer must not hang
            the job forever; torchrun then restarts it).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("no CUDA GPU is visible to this process; use --device cpu")
    dev = torch.device(f"cuda:{local_rank}") if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(dev)
    if dist.is_available() and dist.is_initialized():
        return Place(dist.get_rank(), dist.get_world_size(), local_rank, dev, dist.get_backend())
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return Place(0, 1, local_rank, dev, None)
    backend = choose_backend(dev)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Place(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def wrap_model(
    model: nn.Module, device: torch.device, *, sharded: bool = False, optimizer: torch.optim.Optimizer | None = None
) -> nn.Module:
    """The model ready for the default group: FSDP's ``fully_shard`` when ``sharded``, else DDP.

    As is on a single process, or when it is already wrapped (DDP, FSDP). Sharding re-points
    ``optimizer`` at the sharded parameters (see ``batchfit.train.fsdp``); DDP keeps the parameters.
    """
    from .fsdp import is_sharded, shard_model

    if world_size() == 1 or is_sharded(model) or no_sync_of(model) is not None:
        return model
    if sharded:
        return shard_model(model, optimizer, device)
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def barrier(place: Place) -> None:
    if place.distributed:
        dist.barrier()


def shutdown(place: Place) -> None:
    """Leave the process group cleanly (torchrun expects every rank to), once every rank is done with it.

    Without the barrier a rank that finishes first tears its side down while a slower rank may
    still be receiving from it. An FSDP module that outlives its group can abort the interpreter's
    exit (gloo, CPU): drop the references to it first; the collection here then frees it.
    """
    if place.distributed and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


# -- the default process group, as the accumulator sees it --------------------------------------
def distributed() -> bool:
    """True inside an initialised ``torch.distributed`` default group."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Processes in the default group; 1 without ``dist``."""
    return dist.get_world_size() if distributed() else 1


def rank() -> int:
    """This process's rank in the default group; 0 without ``dist``."""
    return dist.get_rank() if world_size() > 1 else 0


def decided_on_main(decide: Callable[[], Any]) -> Any:
    """``decide()`` run on rank 0 only, its result (or its error) given to every rank.

    For decisions every rank must share: under FSDP a plan that differed between ranks (shapes of
    their own batches, different GPUs) would make them call different collectives and hang.
    """
    if world_size() == 1:
        return decide()
    box: list[Any] = [None]
    if rank() == 0:
        try:
            box[0] = (True, decide())
        except Exception as exc:  # every rank raises it, instead of waiting for rank 0 forever
            box[0] = (False, exc)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


_HOST_GROUPS: dict[int, Any] = {}
_NO_SIZE = 2**62  # "no micro-batch size given": larger than any real one, so MIN ignores it


def _host_group() -> Any:
    """A group whose collectives take CPU tensors: the default one under gloo, else a gloo group made once
    (every rank makes it at the same point: its first agreement)."""
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[key]


def agree(failure: str | None, micro_batch_size: int | None) -> tuple[str | None, int | None]:
    """Every rank's verdict on its window (a collective: every rank calls it once per DDP window).

    A rank that could not finish its window passes its one-line error; the others pass None. All get
    back the same answer: the error of the lowest failing rank as ``"rank R: ..."`` (None when none
    failed), and the smallest micro-batch size any rank plans for the next window (None when none gave
    one). The verdict is host data, exchanged over gloo in host memory: a dispatch mode (a simulated
    GPU) does not count it, and with NCCL it adds no device synchronisation. Without a process group of
    several ranks it returns its arguments.
    """
    if not distributed() or dist.get_world_size() == 1:
        return failure, micro_batch_size
    from torch.utils._python_dispatch import _disable_current_modes

    group = _host_group()
    with _disable_current_modes():
        flags = torch.tensor([1 if failure is not None else 0, -(micro_batch_size or _NO_SIZE)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        failed, smallest = flags.tolist()
        agreed = None
        if failed:
            errors: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(errors, failure, group=group)
            first = next(r for r, e in enumerate(errors) if e is not None)
            agreed = f"rank {first}: {errors[first]}"
    return agreed, None if -smallest == _NO_SIZE else -smallest


def all_reduce_sum(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` (the default one) in place (nothing to do without one)."""
    if distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def no_sync_of(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager] | None:
    """How ``model`` skips its gradient all-reduce: its public ``no_sync`` (DDP, FSDP1), or None.

    DDP all-reduces during every backward; under accumulation only the window's last backward needs
    to, the others just add into local ``.grad``. A plain module has no ``no_sync``, so a single
    process runs the same code without one. FSDP2 (``fully_shard``) has none either, on purpose here:
    its gradients are reduce-scattered after every micro-batch so that they stay sharded (the memory
    the plan counted on); see ``batchfit.train.fsdp``.
    """
    no_sync = getattr(model, "no_sync", None)
    return no_sync if callable(no_sync) else None
