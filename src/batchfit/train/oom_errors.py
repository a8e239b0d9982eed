"""Out-of-memory errors as the trainer sees them: recognised, summarised in one line, memory released.

Three small things every stage of a step needs when memory runs out, kept apart from the recovery
itself (``batchfit.train.oom_resplit``) so that the accumulator, the recovery and the trainer can all use them
without importing each other.
"""

from __future__ import annotations

import gc
import re
from typing import Protocol

import torch

from ..errors import DoesNotFitError


def is_out_of_memory(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError``; for other RuntimeErrors only if the message says so."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def oom_summary(exc: BaseException) -> str:
    """The useful part of an OOM message, on one line ("Tried to allocate 20.00 MiB")."""
    text = " ".join(str(exc).split())
    m = re.search(r"Tried to allocate [0-9.]+ [KMGT]?i?B", text)
    return m.group(0) if m else text[:120]


class MicroBatchOutOfMemory(DoesNotFitError, torch.OutOfMemoryError):
    """One micro-batch ran out of memory; smaller micro-batches may fit.

    Raised by an ``Accumulator``'s micro-batch block (``batchfit.Trainer`` re-splits on it by itself). It
    is also a ``torch.OutOfMemoryError``, so code that caught the raw error still catches it.
    """

    def __init__(self, message: str, *, phase: str, n_items: int) -> None:
        super().__init__(message)
        self.phase = phase
        """``forward`` (no gradient of it yet: earlier micro-batches' stay valid), ``backward`` (some
        ``.grad`` hold part of it: the window must be reset and redone) or ``after`` (its gradient is
        complete; what ran after its backward failed)."""
        self.n_items = n_items


class CacheReleaser(Protocol):
    """Anything that returns a device's cached memory: ``torch.cuda``, a ``SimulatedDevice``, a fake."""

    def empty_cache(self) -> None: ...


class CudaCache:
    """``torch.cuda.empty_cache()``: returns the caching allocator's unused segments to the driver."""

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class NoCache:
    """The CPU's allocator keeps no cache of its own to release."""

    def empty_cache(self) -> None:
        return None


def release_memory(cache: CacheReleaser) -> None:
    """Collect reference cycles still holding tensors, then hand the device's cached blocks back."""
    gc.collect()
    cache.empty_cache()
