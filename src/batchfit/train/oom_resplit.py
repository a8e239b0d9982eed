"""Out-of-memory recovery that keeps the maths: halve the micro-batch, keep the global batch.

When a micro-batch runs out of memory, tools usually crash, or shrink the global batch and so change
the training. Here the failing micro-batch's memory is released, the micro-batch size is halved, and
the remaining items of the same global batch are re-split; the global batch, the count weights and
so the gradient stay what they were. The new size is kept for later steps.

NOTE [ Recovering from OOM without changing the gradient ]
Where the error strikes decides what is still valid:
- In the forward pass (or the loss, the slicing of the batch or the copy to the device), no gradient
  of that micro-batch exists yet. Earlier micro-batches' gradients are complete and weighted by item count, not by the
  number of micro-batches, so they stay valid under any re-split: the failing micro-batch and the
  ones after it are re-split with the halved size and the window continues.
- In the backward pass, autograd may already have added part of the micro-batch into some ``.grad``
  (the layers nearest the loss first) but not into others. The partial sum cannot be subtracted
  (the values added are gone), and keeping a copy of every gradient before each backward would cost
  a gradient's worth of memory exactly when memory is short. Instead the whole window is discarded
  (``Accumulator.reset``: gradients to None) and run again from its first item with the halved size.
  Every item of the window is still in the batch, so this is exact; it costs the compute of the
  micro-batches already done, once.
- In what follows the window (clipping, the optimizer step, the scheduler), a smaller micro-batch
  would not help (activations are gone by then): ``DoesNotFitError`` naming the stage (see NOTE
  [ Out of memory while finishing the window ] in ``finish``).
Items are never skipped, repeated or dropped from the gradient: the window's cursor only advances
past micro-batches whose backward finished. A micro-batch of one item that runs out of memory
cannot be split further: ``DoesNotFitError``, naming the remedies.
Under DDP the other ranks hear of a rank that cannot go on, and of the smaller micro-batch size a
re-plan chose, before their synchronising backward (NOTE [ One rank out of memory under DDP ] in
``micro_step``): every rank stops with the same error, or all continue with the smallest size.
Limitations: under DDP, an OOM in the window's last (synchronising) backward leaves the other ranks
inside its all-reduce, so it is not redone: a ``DoesNotFitError`` on that rank names a smaller
micro-batch. Under FSDP every micro-batch's forward and backward are collectives, so one rank cannot
re-split on its own: an OOM there is a ``DoesNotFitError`` naming a smaller micro-batch size. A
forward that failed may have advanced the random generator (dropout) and BatchNorm's running
statistics; neither is covered by the exactness guarantee (both already depend on the split; see
``batchfit.advice.batchnorm``).
Memory is freed by leaving the ``except`` block before cleaning up (its traceback holds the failed
micro-batch's frames and so its activations), then ``gc.collect()`` and the device's cache release.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..batching import Batch, slice_batch
from ..errors import DoesNotFitError
from .accumulate import Accumulator, micro_batch_sizes
from .distributed import agree
from .oom_errors import (
    CacheReleaser,
    CudaCache,
    MicroBatchOutOfMemory,
    NoCache,
    is_out_of_memory,
    oom_summary,
    release_memory,
)
from .results import Replan

__all__ = ["CacheReleaser", "CudaCache", "NoCache", "Replan", "is_out_of_memory", "release_memory", "run_window"]

log = logging.getLogger("batchfit")

RunMicro = Callable[[Batch, int, bool], None]
"""``(micro_batch, n_items, last) -> None``: move one micro-batch to the device, forward, loss, weighted
backward; ``last`` marks the window's last micro-batch."""


def _attempt(
    run_micro: RunMicro, acc: Accumulator, batch: Batch, start: int, size: int, last: bool
) -> tuple[str, str] | None:
    """Slice one micro-batch and run it; on OOM return ``(phase, summary)`` after its frames are released."""
    try:
        # A piece of 0 items is FSDP padding (batching.make_splits): a real item, weighted zero.
        piece = slice_batch(batch, start, start + size) if size else slice_batch(batch, 0, 1)
        run_micro(piece, size, last)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        phase = exc.phase if isinstance(exc, MicroBatchOutOfMemory) else None
        phase = phase or ("backward" if acc.needs_reset else "forward")
        if phase == "backward" and last and acc.synchronising:  # its all-reduce has started: see the NOTE
            log.error("out of memory in the synchronising backward of a DDP window: cannot redo it on one rank")
            raise
        return phase, oom_summary(exc)  # leaving the except drops the traceback and the frames it holds
    return None


def _stop(acc: Accumulator, message: str) -> DoesNotFitError:
    """The error that ends this window on every rank: DDP ranks hear of it before their last backward."""
    acc.reset()
    if acc.synchronising:
        agreed, _ = agree(message, None)
        message = agreed or message
    return DoesNotFitError(message)


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
        acc: the accumulator the micro-batches add into (reset when a backward fails part-way). Its
            ``planned_micro_batch_size`` is set to each re-plan's size (under DDP the ranks then agree
            on the smallest, at the window's last micro-batch).
        batch: this rank's share of one global batch.
        sizes: the planned micro-batch sizes, summing to the share's size.
        run_micro: runs one micro-batch.
        cache: what releases the device's cached memory after an OOM.
        where: the device's name, for messages.

    Returns:
        The micro-batch size in effect at the end (``max(sizes)`` if nothing ran out of memory) and
        the re-plans made.

    Raises:
        DoesNotFitError: a micro-batch of one item ran out of memory, or (FSDP) any micro-batch did,
            or (DDP) another rank could not finish its window.
    """
    n = sum(sizes)
    pending = list(sizes)
    micro_batch_size = max(sizes)
    done = 0  # items of the share whose gradients are in acc
    replans: list[Replan] = []
    while pending:
        size = pending[0]
        failure = _attempt(run_micro, acc, batch, done, size, len(pending) == 1)
        if failure is None:
            done += size
            pending.pop(0)
            continue
        phase, summary = failure
        release_memory(cache)
        if phase == "after":  # its gradient is in: count it, and re-split the rest smaller
            done += size
            pending.pop(0)
            if not pending:
                break
        if size <= 1 and phase != "after":
            raise _stop(
                acc,
                f"one item does not fit on {where}: out of memory in the {phase} pass of a micro-batch of 1 "
                f"({summary}); use activation checkpointing, --precision bf16, shorter sequences, a smaller "
                "model or a GPU with more memory",
            )
        if acc.sharded or acc.split:
            acc.reset()
            under = "FSDP" if acc.sharded else "tensor parallelism"
            raise DoesNotFitError(
                f"out of memory on {where} in the {phase} pass of a micro-batch of {size} under {under} ({summary}); "
                "a rank cannot re-split alone there (every micro-batch is a collective of all ranks): restart "
                f"with a micro-batch size of at most {size // 2}"
            )
        halved = micro_batch_size // 2  # halve the micro-batch size, or the failing piece if already smaller
        micro_batch_size, at, redone = max(1, halved if halved < size else size // 2), done, 0
        if phase == "backward":  # partial gradients: discard the window and redo it (NOTE above)
            acc.reset()
            redone, done = done, 0
        acc.planned_micro_batch_size = micro_batch_size
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

