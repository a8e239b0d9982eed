"""The gradient noise scale, measured from an accumulation window at no extra pass (``advice.noise_scale``).

NOTE [ Gradient noise scale from the window ]
B_simple (batchfit.advice.noise_scale) needs |G|² at a small and a large batch; a window holds both.
After its first backward (if not the last), .grad is that micro-batch's rank-local gradient (no_sync)
times backward_weighted's weight (n W / G per mean, W / N_prev per token sum) and the GradScaler's S:
undone right there into the micro-batch's mean gradient's |g|², on the device (one norm per parameter,
no copy, no host read; S is divided out on the host). Under DDP every rank's first micro-batch is a
small batch: their [|g|², 1/n, 1] ride the step's one all-reduce, and as E|g_n|² = |G|² + tr(Σ)/n,
the ranks' mean |g|² is that of one batch of the harmonic mean of their n. Under FSDP (no no_sync:
every micro-batch is reduce-scattered) the first micro-batches of all ranks make *one* small batch
of N = sum n items: .grad slices hold (N / divisor) times its mean gradient, whose |.|² is the sum
over ranks of the slices' squares (divisor: G, or N_prev, not divided by W). The large batch is the
window's mean gradient after the division and unscale_, before clipping (clipping's norm, else one
norm per parameter). Both join the step's one host read. Windows of one micro-batch on every rank,
and steps fp16 skipped, measure nothing. Token losses count tokens as independent items (they are not).
The measurement is advice: where it runs out of memory, that step is not measured and training goes on.
"""

from __future__ import annotations

import logging

import torch

from ..advice.noise_scale import GradientNoiseScale, grad_sq_norm
from .distributed import all_reduce_sum
from .oom_errors import is_out_of_memory, oom_summary

log = logging.getLogger("batchfit")


def small_batch_terms(
    params: list[torch.Tensor], count: int | torch.Tensor, *, divisor: float, world_size: int, sharded: bool
) -> torch.Tensor:
    """The first micro-batch's ``[|mean gradient|² S², 1/n, 1]`` (n its count), on the device (NOTE above).

    Args:
        params: the optimizer's parameters, whose ``.grad`` hold the first micro-batch only.
        count: its items (mean losses) or loss-carrying tokens (token losses).
        divisor: the window's weight denominator: the global batch (mean) or ``N_prev`` (tokens).
        world_size: ranks in the group.
        sharded: gradients are FSDP slices (the ranks' first micro-batches make one small batch).
    """
    sq = grad_sq_norm(params)  # 0-d float64
    # A fill, not a host-to-device copy of an int count: that copy would wait for the device.
    n = count.to(sq.device, torch.float64) if isinstance(count, torch.Tensor) else sq.new_full((), float(count))
    copies = 1.0
    if sharded:  # one small batch over all ranks (NOTE above); every rank then holds the same terms,
        sq, n = all_reduce_sum(torch.stack([sq, n])).unbind()  # which the step's all-reduce adds W times
        copies = float(world_size)
    else:
        divisor /= world_size
    measured = (n > 0).double()  # a token micro-batch may hold no loss-carrying token
    n = n.clamp_min(1.0)
    return torch.stack([sq * measured * (divisor / n) ** 2, measured / n, measured]) / copies  # (3,)


def big_batch_sq_norm(
    params: list[torch.Tensor], norm: torch.Tensor | None, *, sharded: bool, where: str
) -> torch.Tensor | None:
    """``|G_big|²`` (1,) of the window's mean gradient, or None when measuring it ran out of memory.

    Args:
        norm: clipping's norm (1,) when clipping, computed already.
        where: the device, for the warning.
    """
    try:
        if norm is not None:  # the window's mean gradient, unscaled and not yet clipped
            return norm.square()
        # sharded gradients: each rank holds the squares of its slices only
        big_sq = all_reduce_sum(grad_sq_norm(params)) if sharded else grad_sq_norm(params)
        return big_sq[None]
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        summary = oom_summary(exc)
    log.warning("out of memory on %s while measuring the gradient noise scale (%s): this step is not measured",
                where, summary)  # fmt: skip
    return None


def measure(noise_scale: GradientNoiseScale, small: list[float], big_sq: float, big_n: float, scale: float) -> None:
    """Feed the ranks' mean small-batch norm and the window's norm to the noise scale (NOTE above)."""
    sq_sum, inv_sum, measured = small
    if measured > 0 and inv_sum > 0 and 1 <= measured / inv_sum < big_n:
        noise_scale.update(sq_sum / measured / scale**2, measured / inv_sum, big_sq, big_n)
