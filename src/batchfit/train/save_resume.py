"""Checkpoints that survive a crash mid-write and resume on any number of GPUs.

A checkpoint holds the model, optimizer, scheduler and grad-scaler states, the sampler's position
(in global batches, so it means the same on any world size), every RNG state and the plan. It is
written to a temporary file in the same directory, flushed and fsynced, then renamed over the old
one: a crash at any moment leaves either the old checkpoint or the new one, never a partial file.
It is read with ``torch.load(weights_only=True)``, which runs no pickled code; a file that is
truncated, corrupt, or from another model is refused with one line and nothing is overwritten.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, DoesNotFitError
from .distributed import rank
from .fsdp import full_states, is_sharded, load_full_states
from .oom_errors import is_out_of_memory, oom_summary
from .tensor_parallel import is_split

FORMAT = "batchfit-checkpoint-1"


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (its state dict has no ``module.`` prefix)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def rng_state() -> dict[str, Any]:
    """torch, CUDA and Python RNG states, as tensors and plain values ``weights_only`` can load."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    state["python_version"] = random.getstate()[0]
    state["python_gauss"] = random.getstate()[2]
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_and_optimizer_states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, Any]:
    """Whole states, the same on any world size: gathered on rank 0 under FSDP (a collective), else local."""
    if is_sharded(model) or is_split(model):
        return full_states(model, optimizer)
    return _unwrap(model).state_dict(), optimizer.state_dict() if optimizer is not None else None


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    grad_scaler: Any = None,
    sampler: Any = None,
    plan: dict[str, Any] | None = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically (temp file, fsync, rename); returns its path.

    Under ``torch.distributed`` call it on every rank: a sharded (FSDP) model's states are gathered
    whole first (a collective), and only rank 0 writes.

    Raises:
        DoesNotFitError: gathering or writing the states ran out of device memory; the file at ``path``
            is as it was.
    """
    path = Path(path)
    try:
        return _save(path, model, optimizer, scheduler, grad_scaler, sampler, plan, step, extra)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        summary = oom_summary(exc)
    raise DoesNotFitError(
        f"writing the checkpoint {path} ran out of memory ({summary}); the file is as it was. The states are "
        "gathered whole to be written: use a GPU with more memory or a smaller model"
    )


def _save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    grad_scaler: Any,
    sampler: Any,
    plan: dict[str, Any] | None,
    step: int,
    extra: dict[str, Any] | None,
) -> Path:
    model_state, optimizer_state = model_and_optimizer_states(model, optimizer)
    if rank() != 0:
        return path
    payload = {
        "format": FORMAT,
        "step": step,
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        "sampler": sampler.state_dict() if sampler is not None else None,
        "plan": plan,
        "rng": rng_state(),
        "extra": extra or {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and check a checkpoint file (no state is applied).

    Raises:
        CheckpointError: missing, unreadable, truncated or not a batchfit checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"no checkpoint file at {path!s}; give the path of a checkpoint file (`batchfit train --checkpoint "
            "PATH` writes one there)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, corrupt bytes, a pickle weights_only refuses
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt: {reason}); nothing was loaded or "
            "overwritten - resume from an earlier checkpoint"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a batchfit checkpoint; resume from one written by `batchfit train`")
    return payload


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    grad_scaler: Any = None,
    sampler: Any = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Apply a checkpoint to the given objects; returns the payload (step, plan, extra).

    The model's keys and shapes are checked before anything is applied, so a checkpoint of another
    model leaves every object as it was. A sharded (FSDP) model takes its slices of the whole states
    (call it on every rank); a checkpoint written on any world size, sharded or not, loads.

    Raises:
        CheckpointError: unreadable, or saved from a model with other parameters.
    """
    payload = read_checkpoint(path)
    target = _unwrap(model)
    own = target.state_dict()
    saved = payload["model"]
    missing = sorted(set(own) - set(saved))
    unexpected = sorted(set(saved) - set(own))
    mismatched = sorted(k for k in set(own) & set(saved) if tuple(own[k].shape) != tuple(saved[k].shape))
    if missing or unexpected or mismatched:
        details = []
        if missing:
            details.append(f"missing {missing[:3]}")
        if unexpected:
            details.append(f"unexpected {unexpected[:3]}")
        if mismatched:
            details.append(f"shape differs for {mismatched[:3]}")
        raise CheckpointError(
            f"checkpoint {path} was saved from another model ({'; '.join(details)}); "
            "resume with the same model and settings"
        )
    if is_sharded(model) or is_split(model):
        load_full_states(model, optimizer, saved, payload.get("optimizer"))
    else:
        target.load_state_dict(saved)
        if optimizer is not None and payload.get("optimizer") is not None:
            optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    if grad_scaler is not None and payload.get("grad_scaler") is not None:
        grad_scaler.load_state_dict(payload["grad_scaler"])
    if sampler is not None and payload.get("sampler") is not None:
        sampler.load_state_dict(payload["sampler"])
    if restore_rng and payload.get("rng") is not None:
        set_rng_state(payload["rng"])
    return payload
