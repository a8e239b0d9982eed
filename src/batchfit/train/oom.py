"""Out-of-memory recovery that keeps the maths: halve the micro-batch, keep the global batch.

When a micro-batch runs out of memory, tools usually crash, or shrink the global batch and so change
the training. Here the failing micro-batch's memory is released, the micro-batch size is halved, and
the remaining items of the same global batch are re-split; the global batch, the count weights and
so the gradient stay what they were. The new size is kept for later steps.

NOTE [ Recovering from OOM without changing the gradient ]
Where the error strikes decides what is still valid:
- In the forward pass (or the loss, or the copy to the device), no gradient of that micro-batch
  exists yet. Earlier micro-batches' gradients are complete and weighted by item count, not by the
  number of micro-batches, so they stay valid under any re-split: the failing micro-batch and the
  ones after it are re-split with the halved size and the window continues.
- In the backward pass, autograd may already have added part of the micro-batch into some ``.grad``
  (the layers nearest the loss first) but not into others. The partial sum cannot be subtracted
  (the values added are gone), and keeping a copy of every gradient before each backward would cost
  a gradient's worth of memory exactly when memory is short. Instead the whole window is discarded
  (``Accumulator.reset``: gradients to None) and run again from its first item with the halved size.
  Every item of the window is still in the batch, so this is exact; it costs the compute of the
  micro-batches already done, once.
- In the optimizer step or clipping, parameters may be partly updated; nothing can be redone, and a
  smaller micro-batch would not help (activations are gone by then): ``DoesNotFitError``.
Items are never skipped, repeated or dropped from the gradient: the window's cursor only advances
past micro-batches whose backward finished. A micro-batch of one item that runs out of memory
cannot be split further: ``DoesNotFitError``, naming the remedies.
Limitations: under DDP, an OOM in the window's last (synchronising) backward leaves the other ranks
inside its all-reduce, so it is re-raised rather than redone. Under FSDP every micro-batch's forward
and backward are collectives, so one rank cannot re-split on its own: an OOM there is a
``DoesNotFitError`` naming a smaller micro-batch size. A forward that failed may have
advanced the random generator (dropout) and BatchNorm's running statistics; neither is covered by
the exactness guarantee (both already depend on the split; see ``batchfit.advice.batchnorm``).
Memory is freed by leaving the ``except`` block before cleaning up (its traceback holds the failed
micro-batch's frames and so its activations), then ``gc.collect()`` and the device's cache release.
"""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..batching import Batch, slice_batch
from ..errors import DoesNotFitError
from .accumulate import Accumulator, micro_batch_sizes

log = logging.getLogger("batchfit")

RunMicro = Callable[[Batch, int, bool], None]
"""``(micro_batch, n_items, last) -> None``: move one micro-batch to the device, forward, loss, weighted
backward; ``last`` marks the window's last micro-batch."""


@dataclass(frozen=True)
class Replan:
    """One re-plan after an out-of-memory error, as reported in ``StepResult.replanned`` and the log."""

    from_micro_batch_size: int
    """Size of the micro-batch that ran out of memory."""
    to_micro_batch_size: int
    """The micro-batch size used from then on: half the one in effect (half the failing micro-batch if
    that was a remainder no larger than the half)."""
    phase: str
    """``"forward"`` (the window continued) or ``"backward"`` (the window was discarded and redone)."""
    at_item: int
    """Position in this rank's share of the first item of the failing micro-batch."""
    redone_items: int
    """Items whose finished gradients were discarded and computed again (backward phase only)."""


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


def is_out_of_memory(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError``; for other RuntimeErrors only if the message says so."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _summary(exc: BaseException) -> str:
    """The useful part of an OOM message, on one line ("Tried to allocate 20.00 MiB")."""
    text = " ".join(str(exc).split())
    m = re.search(r"Tried to allocate [0-9.]+ [KMGT]?i?B", text)
    return m.group(0) if m else text[:120]


def _attempt(run_micro: RunMicro, acc: Accumulator, micro: Batch, size: int, last: bool) -> tuple[str, str] | None:
    """Run one micro-batch; on OOM return ``(phase, summary)`` after its frames are released."""
    try:
        run_micro(micro, size, last)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        phase = "backward" if acc.needs_reset else "forward"
        if phase == "backward" and last and acc.world_size > 1 and not acc.sharded:  # FSDP: run_window's error
            log.error("out of memory in the synchronising backward of a DDP window: cannot redo it on one rank")
            raise
        return phase, _summary(exc)  # leaving the except drops the traceback and the frames it holds
    return None


def run_window(
    acc: Accumulator,
    batch: Batch,
    sizes: list[int],
    run_micro: RunMicro,
    *,
    cache: CacheReleaser,
    where: str,
) -> tuple[int, list[Replan]]:
    """Pass every item of ``batch`` through ``run_micro`` once, in micro-batches, recovering from OOM.

    See NOTE [ Recovering from OOM without changing the gradient ].

    Args:
        acc: the accumulator the micro-batches add into (reset when a backward fails part-way).
        batch: this rank's share of one global batch.
        sizes: the planned micro-batch sizes, summing to the share's size.
        run_micro: runs one micro-batch.
        cache: what releases the device's cached memory after an OOM.
        where: the device's name, for messages.

    Returns:
        The micro-batch size in effect at the end (``max(sizes)`` if nothing ran out of memory) and
        the re-plans made.

    Raises:
        DoesNotFitError: a micro-batch of one item ran out of memory.
    """
    n = sum(sizes)
    pending = list(sizes)
    micro_batch_size = max(sizes)
    done = 0  # items of the share whose gradients are in acc
    replans: list[Replan] = []
    while pending:
        size = pending[0]
        # A piece of 0 items is FSDP padding (batching.make_splits): a real item, weighted zero.
        piece = slice_batch(batch, done, done + size) if size else slice_batch(batch, 0, 1)
        failure = _attempt(run_micro, acc, piece, size, len(pending) == 1)
        if failure is None:
            done += size
            pending.pop(0)
            continue
        phase, summary = failure
        release_memory(cache)
        if size <= 1:
            acc.reset()
            raise DoesNotFitError(
                f"one item does not fit on {where}: out of memory in the {phase} pass of a micro-batch of 1 "
                f"({summary}); use activation checkpointing, --precision bf16, shorter sequences, a smaller "
                "model or a GPU with more memory"
            )
        if acc.sharded:
            acc.reset()
            raise DoesNotFitError(
                f"out of memory on {where} in the {phase} pass of a micro-batch of {size} under FSDP ({summary}); "
                "a rank cannot re-split alone there (every micro-batch is a collective of all ranks): restart "
                f"with a micro-batch size of at most {size // 2}"
            )
        halved = micro_batch_size // 2  # halve the micro-batch size, or the failing piece if already smaller
        micro_batch_size, at, redone = halved if halved < size else size // 2, done, 0
        if phase == "backward":  # partial gradients: discard the window and redo it (NOTE above)
            acc.reset()
            redone, done = done, 0
        replans.append(Replan(size, micro_batch_size, phase, at, redone))
        log.warning(
            "out of memory on %s in the %s pass of a micro-batch of %d (%s); micro-batch %d -> %d, "
            "global batch unchanged%s",
            where,
            phase,
            size,
            summary,
            size,
            micro_batch_size,
            f", window redone from its first item ({redone} items recomputed)" if phase == "backward" else "",
        )
        pending = micro_batch_sizes(n - done, micro_batch_size)
    return micro_batch_size, replans
