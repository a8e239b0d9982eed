"""One micro-batch of an accumulation window: the loss forms it accepts and its count-weighted backward.

``Accumulator.accumulate`` returns a ``MicroStep``; inside it the caller computes the loss and calls
``backward_weighted`` once. The weighting that makes any split exact is stated here, next to the
backward it scales (see NOTE [ Dividing by a count known only at the end ] in ``accumulate``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError, DoesNotFitError
from .distributed import agree, no_sync_of
from .oom_errors import MicroBatchOutOfMemory, is_out_of_memory, oom_summary

if TYPE_CHECKING:
    from .accumulate import Accumulator

log = logging.getLogger("batchfit")

# NOTE [ One rank out of memory under DDP ]
# Under DDP the ranks meet in collectives twice per window: the gradient all-reduce inside the last
# micro-batch's backward, and the all-reduce of the totals in ``step``. Every other micro-batch runs
# under ``no_sync``, on this rank alone, so an out-of-memory error there is re-split or redone on this
# rank alone (``batchfit.train.oom_resplit``), while the other ranks wait at their last backward. A rank that
# cannot go on (one item does not fit) must still tell them, or they would wait in the all-reduce
# until the process group's timeout. So before the last backward every rank joins one small host-side
# collective (``distributed.agree``): the failing rank joins it with its error instead of a last
# micro-batch, and every rank then raises the same ``DoesNotFitError``; otherwise the ranks learn the
# smallest micro-batch size any of them re-planned to, and all use it from the next window. Before
# that, still in the forward phase where an OOM only re-splits, the window's totals are computed, so
# that nothing needs memory between the last backward and ``step``'s all-reduce. What remains is an
# OOM inside the synchronising backward itself: its all-reduce has started, so it cannot be redone;
# that rank raises a ``DoesNotFitError`` naming a smaller micro-batch, and the others, waiting in the
# all-reduce, fail when its process leaves (gloo reports the closed connection; torchrun stops the
# job) or at the process group's timeout, not never.

MEAN = "mean"
"""The loss returned a scalar: the mean over the micro-batch's items (leading dimension)."""
TOKENS = "tokens"
"""The loss returned ``(loss_sum, n_items)``: a sum over loss-carrying units (non-padding tokens)."""


def loss_terms(out: Any) -> tuple[torch.Tensor, int | torch.Tensor | None]:
    """``(value, count)`` from what a loss returned: ``(mean, None)`` or ``(loss_sum, n_items)``.

    Raises:
        ConfigError: the loss is neither a scalar float tensor nor a pair ``(loss_sum, n_items)``.
    """
    if isinstance(out, torch.Tensor):
        if out.dim() != 0 or not out.is_floating_point():
            raise ConfigError(
                f"the loss returned a tensor of shape {tuple(out.shape)} and dtype {out.dtype}; return a scalar "
                "float tensor (the mean over the micro-batch) or a tuple (loss_sum, n_items)"
            )
        return out, None
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        total, count = out
        if total.dim() != 0 or not total.is_floating_point():
            raise ConfigError(f"the loss's loss_sum has shape {tuple(total.shape)}; it must be a scalar float tensor")
        if isinstance(count, torch.Tensor):
            if count.dim() != 0 or count.is_complex() or count.dtype == torch.bool:
                raise ConfigError("the loss's n_items must be an int or a 0-d tensor (the count it summed over)")
        elif isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"the loss's n_items must be an int >= 0 or a 0-d tensor, got {count!r}")
        return total, count
    raise ConfigError(
        f"the loss returned {type(out).__name__}; return a scalar float tensor (the mean over the micro-batch) "
        "or a tuple (loss_sum, n_items) for token-level losses"
    )


class MicroStep:
    """One micro-batch (a context manager from ``Accumulator.accumulate``): call ``backward_weighted`` once.

    Entering it enters autocast (for the forward), the simulated GPU the accumulator was given (unless
    the caller entered it) and, unless it is the window's last micro-batch, the model's ``no_sync``.
    Leaving it checks that the backward ran, marks the window as needing a ``reset`` if an error
    struck part-way through the backward, and turns an out-of-memory error into a one-line
    ``MicroBatchOutOfMemory`` (see ``batchfit.train.oom_errors``) saying what still holds.
    """

    __slots__ = ("_acc", "n_items", "last", "backward_started", "done", "_stack")

    def __init__(self, acc: Accumulator, n_items: int, last: bool) -> None:
        self._acc = acc
        self.n_items = n_items
        """Items (leading dimension) in this micro-batch."""
        self.last = last
        self.backward_started = False
        self.done = False
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> MicroStep:
        acc = self._acc
        no_sync = None if self.last else no_sync_of(acc.model)
        sim = acc.simulated if acc.simulated is not None and not acc.simulated.active else None
        if no_sync is None and acc._autocast is None and sim is None:
            return self  # nothing to enter: the plain single-process fp32 loop pays nothing here
        stack = contextlib.ExitStack()
        with stack:
            if sim is not None:
                stack.enter_context(sim)
            if no_sync is not None:
                stack.enter_context(no_sync())
            if acc._autocast is not None:
                stack.enter_context(acc._autocast())
            self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._stack is not None:
            self._stack.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            if self.backward_started and not self.done:
                self._acc._dirty = True  # some .grad already hold part of this micro-batch
            if exc is not None and is_out_of_memory(exc) and not isinstance(exc, DoesNotFitError):
                raise self._out_of_memory(exc) from exc
            return
        if not self.done:
            raise ConfigError("call backward_weighted(loss) once inside each accumulate() block")

    def _out_of_memory(self, exc: BaseException) -> MicroBatchOutOfMemory:
        acc, n = self._acc, self.n_items
        where = f"out of memory on {acc.where}"
        summary = oom_summary(exc)
        if self.done:
            phase, then = "after", (
                f"{where} after the backward of a micro-batch of {n} ({summary}); its gradient is in the window: "
                "go on with the next micro-batch"
            )
        elif not self.backward_started:
            phase, then = "forward", (
                f"{where} in the forward pass of a micro-batch of {n} ({summary}); the window's earlier gradients "
                "stay valid: run these items again as smaller micro-batches (batchfit.Trainer re-splits by itself)"
            )
        elif self.last and acc.synchronising:
            phase, then = "backward", (
                f"{where} in the synchronising backward of a micro-batch of {n} under DDP ({summary}); the other "
                "ranks wait in its gradient all-reduce, so it cannot be redone on this rank alone: restart with "
                f"a micro-batch size of at most {max(1, n // 2)}"
            )
        else:
            phase, then = "backward", (
                f"{where} in the backward pass of a micro-batch of {n} ({summary}); some gradients hold part of it: "
                "call reset() and run the window again as smaller micro-batches (batchfit.Trainer does)"
            )
        return MicroBatchOutOfMemory(then, phase=phase, n_items=n)

    def backward_weighted(self, out: Any) -> torch.Tensor:
        """Backpropagate the loss weighted by this micro-batch's share of the global batch's count.

        Args:
            out: what the loss returned for this micro-batch: a scalar mean over its items, or
                ``(loss_sum, n_items)`` for token losses (padding excluded from both).

        Returns:
            The unweighted loss value (detached): the mean, or the sum for token losses.

        Raises:
            ConfigError: the loss is neither form, mixes forms within a window, or is called twice.
            DoesNotFitError: under DDP, another rank could not finish its window (the same error there).
        """
        acc = self._acc
        if self.done or self.backward_started:
            raise ConfigError("backward_weighted was called twice for one micro-batch; call it once per micro-batch")
        value, count = loss_terms(out)
        form = MEAN if count is None else TOKENS
        if acc._form is None:
            acc._form = form
        elif acc._form != form:
            raise ConfigError(
                "the loss returned a mean for some micro-batches and (loss_sum, n_items) for others; "
                "return the same form for every micro-batch"
            )
        padding = self.n_items == 0  # run for its collectives only (FSDP; see batching.make_splits)
        if padding:
            weighted = value * 0.0  # adds exactly zero to every gradient
        elif form == MEAN:
            weighted = value * (self.n_items * acc.world_size / acc.global_batch_size)  # mean * n / N
        else:
            weighted = value * (acc.world_size / acc._token_divisor)  # loss_sum / N_prev (see accumulate)
        if acc.grad_scaler is not None:
            weighted = acc.grad_scaler.scale(weighted)
        detached = value.detach()
        if hasattr(detached, "full_tensor"):  # a loss computed on split logits (loss_parallel): replicated
            detached = detached.full_tensor()
        kept_value = torch.zeros_like(detached) if padding else detached
        kept_count = self.n_items if count is None or padding else count
        if self.last:
            self._before_the_last_backward(kept_value, kept_count)
        self.backward_started = True
        if acc._autocast is not None:  # backward outside autocast, as torch.amp recommends
            with torch.autocast(acc.device_type, enabled=False):
                weighted.backward()
        else:
            weighted.backward()
        self.done = True
        acc._values.append(kept_value)
        acc._counts.append(kept_count)
        acc._sizes.append(self.n_items)
        if acc.noise_scale is not None and not self.last and not padding and len(acc._values) == 1:
            try:
                acc._read_small_gradient(self.n_items if count is None else count)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                acc._small = None  # advice only: see NOTE [ Gradient noise scale from the window ]
                log.warning("out of memory on %s while measuring the gradient noise scale (%s): this step is not "
                            "measured", acc.where, oom_summary(exc))  # fmt: skip
        return detached

    def _before_the_last_backward(self, value: torch.Tensor, count: int | torch.Tensor) -> None:
        """Under torch.distributed: the window's totals, then (DDP) every rank's verdict, before any collective.

        Everything here may still run out of memory as part of the forward (no gradient of this
        micro-batch yet: the window re-splits). After it, the backward synchronises (DDP) and ``step``
        all-reduces the totals prepared here without allocating first; see NOTE [ One rank out of
        memory under DDP ].
        """
        acc = self._acc
        acc._totals_before_sync(value, count)
        if not acc.synchronising:
            return
        failure, smallest = agree(None, acc.planned_micro_batch_size)
        if failure is not None:
            acc.reset()
            raise DoesNotFitError(failure)
        acc.planned_micro_batch_size = smallest
