"""The end of an accumulation window: the stages from the window's totals to the next window.

``Accumulator.step`` sums the window's losses and counts (all-reduced across ranks), then hands over to
``finish_window``: the token-count division, fp16 unscaling, clipping, the noise scale's norm, the
optimizer step, the scheduler, freeing the gradients and the one host read of the step's numbers.

NOTE [ Out of memory while finishing the window ]
None of these stages depends on the micro-batch size (the activations are gone), so none can be
re-planned: an out-of-memory error before the optimizer step discards the window's gradients and
raises one ``DoesNotFitError`` naming the stage (the parameters are as before the step); one in the
optimizer step (whose first call allocates the optimizer's state) or later says that the parameters
may be partly updated. The noise scale is advice: an OOM while measuring it skips this step's
measurement. Stacking the losses for the one host read, and concatenating the numbers for it, are
skipped when they do not fit (the values are then read one tensor at a time, which allocates nothing).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..errors import DoesNotFitError
from .micro_step import TOKENS
from .oom_errors import is_out_of_memory, oom_summary
from .results import StepResult
from .window_noise import big_batch_sq_norm, measure

if TYPE_CHECKING:
    from .accumulate import Accumulator

_STATES_REMEDY = (
    "parameters, gradients and optimizer states do not fit, whatever the micro-batch; use a lighter optimizer "
    "(SGD), --precision bf16-true, a smaller model or a GPU with more memory"
)

Reads = dict[str, "torch.Tensor | list[torch.Tensor]"]


@contextlib.contextmanager
def refusing(acc: Accumulator, what: str, *, updated: bool, note: str = "") -> Iterator[None]:
    """Turn an out-of-memory error in the stage ``what`` into one ``DoesNotFitError`` (NOTE above).

    The window is discarded (``acc.reset``) once the failed stage's frames are gone, which frees its
    memory and the gradients.
    """
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        summary = oom_summary(exc)
    else:
        return
    acc.reset()
    state = (
        "the parameters may be partly updated: resume from your last checkpoint"
        if updated
        else "the parameters are as before this step"
    )
    raise DoesNotFitError(f"{what} ran out of memory on {acc.where} ({summary}{note}); {state}; {_STATES_REMEDY}")


def finish_window(acc: Accumulator, reads: Reads, sizes: tuple[int, ...], *, measuring: bool) -> StepResult:
    """Every stage after the totals, then the step's result.

    Args:
        acc: the accumulator whose window ends.
        reads: what the step reads back: ``losses`` (one process, mean loss: the micro-batches' means)
            or ``totals`` (``[loss_sum, n_items]`` over all ranks, then the noise scale's 3 terms).
        sizes: the window's micro-batch sizes on this rank.
        measuring: the noise scale measures this window.
    """
    params = acc._params()
    with refusing(acc, "reducing the gradients held as partial sums", updated=False):
        _reduce_partial_gradients(params)
    local = "losses" in reads
    if "totals" in reads and acc._form == TOKENS:
        with refusing(acc, "dividing the gradients by the token count", updated=False):
            totals = reads["totals"]
            assert isinstance(totals, torch.Tensor)
            factor = acc._token_divisor / totals[1].clamp_min(1.0)  # N_prev / N: see NOTE in accumulate
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor.to(grads[0].device))
    scaler = acc.grad_scaler
    if scaler is not None:
        with refusing(acc, "unscaling the fp16 gradients", updated=False):
            scaler.unscale_(acc.optimizer)
    norm = None
    if acc.max_grad_norm is not None:
        with refusing(acc, "clipping the gradient norm", updated=False):
            norm = _whole(torch.nn.utils.clip_grad_norm_(params, acc.max_grad_norm)).detach().double()[None]
            reads["norm"] = norm
    if measuring and local:
        reads["small"] = acc._small  # type: ignore[assignment]
    if measuring:
        big_sq = big_batch_sq_norm(params, norm, sharded=acc.sharded, where=acc.where)
        if big_sq is None:
            measuring = False
            reads.pop("small", None)
        else:
            reads["big_sq"] = big_sq
    skipped, scale_before = False, 1.0
    first = "; it was the optimizer's first step, which allocates its state" if not acc.optimizer.state else ""
    with refusing(acc, "the optimizer step", updated=True, note=first):
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(acc.optimizer)
            scaler.update()
            skipped = scaler.get_scale() < scale_before  # the scale only drops when inf/NaN skipped the step
        else:
            acc.optimizer.step()
    if acc.scheduler is not None and not skipped:
        with refusing(acc, "the scheduler step", updated=True):
            acc.scheduler.step()
    acc.optimizer.zero_grad(set_to_none=True)
    values = read_floats(reads)  # float64 holds the losses exactly: they read back as the same Python floats
    if local:
        loss_sum, n_items = math.fsum(v * n for v, n in zip(values["losses"], sizes)), float(sum(sizes))
        small = values.get("small")
    else:
        loss_sum, n_items = values["totals"][:2]
        small = values["totals"][2:5] if measuring else None
    if measuring and small is not None and not skipped:  # a step fp16 skipped for inf/NaN measures nothing
        measure(acc.noise_scale, small, values["big_sq"][0], n_items, scale_before)  # type: ignore[arg-type]
    result = StepResult(
        loss=loss_sum / n_items if n_items > 0 else 0.0,
        n_items=int(round(n_items)),
        micro_batch_size=max(sizes),
        accumulation_steps=len(sizes),
        micro_batch_sizes=sizes,
        grad_norm=values["norm"][0] if norm is not None else None,
        skipped=skipped,
        step=acc._step,
        noise_scale=acc.noise_scale.b_simple if acc.noise_scale is not None else None,
    )
    acc._end_window(n_items)
    return result


# NOTE [ Gradients left as partial sums ]
# Under sequence parallelism a norm's weight sees its part of the sequence on each tensor-parallel rank, so its
# gradient is a DTensor placed ``Partial("sum")``: each rank holds its part of the sum, reduced when an op needs
# the whole. torch 2.13's ops reduce it there; torch 2.11's ``clip_grad_norm_`` does not (its norm and the
# scaling read the partial sums as they are: the clipped weights then move by the wrong amount, 3% of the largest
# gradient in a two-layer Llama, far more where clipping bites). The window reduces such gradients itself, once,
# before anything reads them: the same values on every torch, for the all-reduce the later ops ran anyway.
def _reduce_partial_gradients(params: list[torch.Tensor]) -> None:
    """Each ``Partial`` DTensor gradient of ``params`` replaced by its reduced (``Replicate``) form (NOTE above)."""
    for p in params:
        g = p.grad
        placements = getattr(g, "placements", None)
        if placements is None or not any(pl.is_partial() for pl in placements):
            continue
        from torch.distributed.tensor import Replicate

        p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in placements])


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s global value (``clip_grad_norm_`` of sharded gradients returns a DTensor)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def stacked(values: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """``torch.stack(values)`` for one read, or the list itself when stacking runs out of memory."""
    try:
        return torch.stack(values)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
    return list(values)


def read_floats(parts: Reads) -> dict[str, list[float]]:
    """Every part's values as Python floats: one host read of their concatenation in float64, or (when
    concatenating runs out of memory) one read per tensor, which allocates nothing on the device."""
    flat = {k: v if isinstance(v, list) else [v] for k, v in parts.items()}
    tensors = [t.reshape(-1) for ts in flat.values() for t in ts]
    try:
        merged = torch.cat([t.double().to(tensors[0].device) for t in tensors]).tolist()
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        merged = [v for t in tensors for v in t.tolist()]  # float32 values read as the same Python floats
    out: dict[str, list[float]] = {}
    i = 0
    for k, ts in flat.items():
        n = sum(t.numel() for t in ts)
        out[k], i = merged[i : i + n], i + n
    return out
