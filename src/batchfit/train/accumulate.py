"""Exact gradient accumulation: micro-batches whose gradients add up to exactly the global batch's.

Accumulation is easy to get subtly wrong: summing instead of averaging, averaging per-micro-batch means
(which over-weights micro-batches with few loss-carrying tokens), or dividing by a count that the last,
shorter window does not have. Here every micro-batch's loss is weighted by its *count* of items, the
divisor is the count of the whole global batch over every rank, and the optimizer, the clipping, the
scheduler and ``zero_grad`` each run once per global batch (see "Exact large-batch emulation" in the
design notes).

``Accumulator`` is the piece for people who keep their own loop; ``batchfit.Trainer`` is built on it.
On the way it measures the gradient noise scale (see NOTE [ Gradient noise scale from the window ]).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from batchfit.batching import split_batch
    >>> from batchfit.train.accumulate import Accumulator, micro_batch_sizes
    >>> model = nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> acc = Accumulator(model, optimizer, global_batch_size=10)
    >>> batch = (torch.randn(10, 4), torch.randn(10, 1))
    >>> sizes = micro_batch_sizes(10, 4)
    >>> sizes
    [4, 3, 3]
    >>> for i, (x, y) in enumerate(split_batch(batch, sizes)):
    ...     with acc.accumulate((x, y), last=i == len(sizes) - 1) as micro:
    ...         loss = micro.backward_weighted(nn.functional.mse_loss(model(x), y))
    >>> result = acc.step()
    >>> result.n_items, result.accumulation_steps
    (10, 3)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..advice.noise_scale import GradientNoiseScale, grad_sq_norm
from ..batching import Batch, batch_size_of
from ..errors import ConfigError
from ..precision import Precision, policy_for
from .distributed import all_reduce_sum, distributed, no_sync_of, world_size
from .fsdp import is_sharded

if TYPE_CHECKING:
    from .oom import Replan

MEAN = "mean"
"""The loss returned a scalar: the mean over the micro-batch's items (leading dimension)."""
TOKENS = "tokens"
"""The loss returned ``(loss_sum, n_items)``: a sum over loss-carrying units (non-padding tokens)."""


def micro_batch_sizes(n_items: int, micro_batch_size: int) -> list[int]:
    """The split rule: ``ceil(n / micro)`` micro-batches whose sizes differ by at most one, larger first.

    The fewest micro-batches that respect ``micro_batch_size`` (so the fewest optimizer-free passes),
    and balanced, so that no micro-batch is a sliver: 10 items with micro 4 give ``[4, 3, 3]``, not
    ``[4, 4, 2]``. Larger ones come first so a micro-batch that is too big fails as early as possible.

    Raises:
        ConfigError: a non-positive size or count.
    """
    if n_items < 1 or micro_batch_size < 1:
        raise ConfigError(f"cannot split {n_items} items into micro-batches of {micro_batch_size}; both must be >= 1")
    k = -(-n_items // micro_batch_size)
    q, r = divmod(n_items, k)
    return [q + 1] * r + [q] * (k - r)


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, for logs, progress bars and JSON."""

    loss: float
    """The global batch's loss: the sum of every item's (token's) loss over all ranks, divided by ``n_items``."""
    n_items: int
    """The divisor of ``loss``: items (mean losses) or loss-carrying tokens (token losses), over all ranks."""
    micro_batch_size: int
    """The micro-batch size in effect at the end of the step (smaller than at its start after an OOM)."""
    accumulation_steps: int
    """Micro-batches whose gradients make up this step on this rank."""
    micro_batch_sizes: tuple[int, ...]
    """Their sizes, in order (this rank)."""
    grad_norm: float | None = None
    """Total gradient norm before clipping (None without ``max_grad_norm``)."""
    skipped: bool = False
    """True when the fp16 ``GradScaler`` found inf/NaN gradients and skipped the optimizer step."""
    replanned: tuple[Replan, ...] = field(default=())
    """Re-plans after out-of-memory errors during this step (see ``batchfit.train.oom``)."""
    step: int = 0
    """Index of this optimizer step, from 0."""
    noise_scale: float | None = None
    """The gradient noise scale ``B_simple`` measured so far (None while off or not yet resolved)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        out = asdict(self)
        out["micro_batch_sizes"] = list(self.micro_batch_sizes)
        out["replanned"] = [asdict(r) for r in self.replanned]
        return out


# -- loss forms ---------------------------------------------------------------------------------------
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


# NOTE [ Dividing by a count known only at the end ]
# The global loss is sum(per-item losses) / N. For a mean loss N is the number of items, known before
# anything runs: micro-batch m contributes mean_m * n_m * W / G (W ranks, G the global batch; DDP then
# averages over W, which the factor W undoes). For a token loss N counts non-padding tokens and is
# known only after the forward of every micro-batch on every rank, but each backward must happen before
# the next forward (the activations would not fit otherwise). So each micro-batch backpropagates
# loss_sum * W / N_prev, where N_prev is the previous step's all-reduced count (G on the first step):
# a constant shared by every micro-batch and every rank, so gradients stay an exact, scaled sum. At the
# end of the window the true N is summed (and all-reduced) and every gradient is multiplied once by
# N_prev / N: one in-place op per parameter, exact up to rounding (float64: ~1e-16 relative). Scaling by
# N_prev rather than 1 keeps gradients at the size of a mean, which fp16's GradScaler needs (a sum over
# thousands of tokens would overflow its scaled activation gradients).


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s global value (``clip_grad_norm_`` of sharded gradients returns a DTensor)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class MicroStep:
    """One micro-batch (a context manager from ``Accumulator.accumulate``): call ``backward_weighted`` once.

    Entering it enters autocast (for the forward) and, unless it is the window's last micro-batch,
    the model's ``no_sync``; leaving it checks that the backward ran, and marks the window as needing
    a ``reset`` if an error struck part-way through the backward.
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
        if no_sync is None and acc._autocast is None:
            return self  # nothing to enter: the plain single-process fp32 loop pays nothing here
        stack = contextlib.ExitStack()
        with stack:
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
            return
        if not self.done:
            raise ConfigError("call backward_weighted(loss) once inside each accumulate() block")

    def backward_weighted(self, out: Any) -> torch.Tensor:
        """Backpropagate the loss weighted by this micro-batch's share of the global batch's count.

        Args:
            out: what the loss returned for this micro-batch: a scalar mean over its items, or
                ``(loss_sum, n_items)`` for token losses (padding excluded from both).

        Returns:
            The unweighted loss value (detached): the mean, or the sum for token losses.

        Raises:
            ConfigError: the loss is neither form, mixes forms within a window, or is called twice.
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
            weighted = value * (acc.world_size / acc._token_divisor)  # loss_sum / N_prev (NOTE above)
        if acc.grad_scaler is not None:
            weighted = acc.grad_scaler.scale(weighted)
        self.backward_started = True
        if acc._autocast is not None:  # backward outside autocast, as torch.amp recommends
            with torch.autocast(acc.device_type, enabled=False):
                weighted.backward()
        else:
            weighted.backward()
        self.done = True
        detached = value.detach()
        acc._values.append(torch.zeros_like(detached) if padding else detached)
        acc._counts.append(self.n_items if count is None or padding else count)
        acc._sizes.append(self.n_items)
        if acc.noise_scale is not None and not self.last and not padding and len(acc._values) == 1:
            acc._read_small_gradient(self.n_items if count is None else count)
        return detached


class Accumulator:
    """Count-weighted gradient accumulation for your own loop: a context per micro-batch, one ``step``.

    Gradients of the micro-batches passed to ``accumulate`` between two ``step`` calls add up to the
    gradient of one batch holding all their items (and every rank's), whatever the split. ``step``
    then unscales (fp16), clips, steps the optimizer and the scheduler once and frees the gradients.

    Args:
        model: the module whose parameters the optimizer updates (a DDP wrapper is fine: its
            ``no_sync`` is used on every micro-batch but the last).
        optimizer: any ``torch.optim.Optimizer``.
        global_batch_size: items of one global batch over all ranks; mean losses are weighted by it.
        max_grad_norm: clip the total gradient norm to this once per step (None: no clipping).
        scheduler: stepped once per optimizer step (not when fp16 skipped the step).
        grad_scaler: a ``torch.amp.GradScaler``; by default one is made for ``precision="fp16"`` (a
            ``ShardedGradScaler`` once the model is sharded with FSDP: see ``match_sharding``).
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast of the forward) or ``bf16-true``.
        device_type: ``"cpu"`` or ``"cuda"`` for autocast; by default that of the first parameter.
        noise_scale: measure the gradient noise scale into this ``GradientNoiseScale`` (True: a new
            one, False: off); see NOTE [ Gradient noise scale from the window ].

    Windows start from no gradients: any the parameters hold when the Accumulator is built are dropped.

    Raises:
        ConfigError: a non-positive global batch or ``max_grad_norm``, an unknown precision, or a
            ``noise_scale`` that is neither a bool nor a ``GradientNoiseScale``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        global_batch_size: int,
        max_grad_norm: float | None = None,
        scheduler: Any = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        precision: str | Precision = "fp32",
        device_type: str | None = None,
        noise_scale: GradientNoiseScale | bool = True,
    ) -> None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be a whole number >= 1, got {global_batch_size!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf):
            raise ConfigError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(noise_scale, (bool, GradientNoiseScale)):
            raise ConfigError(f"noise_scale must be True, False or a GradientNoiseScale, got {noise_scale!r}")
        self.model = model
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.scheduler = scheduler
        if device_type is None:
            first = next(model.parameters(), None)
            device_type = first.device.type if first is not None else "cpu"
        self.device_type = device_type
        policy = policy_for(precision)
        self._autocast: Callable[[], contextlib.AbstractContextManager] | None = policy.autocast(device_type)
        self._own_scaler = grad_scaler is None
        if grad_scaler is None and policy.precision is Precision.FP16:
            grad_scaler = torch.amp.GradScaler(device_type)
        self.grad_scaler = grad_scaler
        self.world_size = world_size()
        self._token_divisor = float(global_batch_size)  # N_prev; see NOTE [ Dividing by a count known only at the end ]
        self._step = 0
        self._form: str | None = None
        self._values: list[torch.Tensor] = []
        self._counts: list[int | torch.Tensor] = []
        self._sizes: list[int] = []
        self._dirty = False
        self.noise_scale: GradientNoiseScale | None = (
            GradientNoiseScale() if noise_scale is True else noise_scale or None
        )
        """The running gradient noise scale estimate (None when off)."""
        self._small: torch.Tensor | None = None  # (3,) float64; see NOTE [ Gradient noise scale from the window ]
        self.reset()

    # -- per micro-batch ------------------------------------------------------------------------------
    def accumulate(self, micro_batch: Batch, *, last: bool, n_items: int | None = None) -> MicroStep:
        """The context of one micro-batch: autocast for its forward, ``no_sync`` unless ``last``.

        Inside, compute the loss and call ``backward_weighted`` on it exactly once.

        Args:
            micro_batch: the micro-batch (its leading dimension counts the items of a mean loss).
            last: True for the window's last micro-batch, whose backward synchronises DDP gradients.
            n_items: the micro-batch's leading dimension when the caller knows it already; 0 marks a
                *padding* micro-batch (a rank with fewer items than FSDP's common micro-batch count
                runs a real item for the collectives, its gradient weighted by exactly zero).

        Raises:
            ConfigError: the previous window failed mid-backward and was not ``reset``, or (on leaving
                the block) the body did not call ``backward_weighted``.
        """
        if self._dirty:
            raise ConfigError(
                "a backward failed part-way, so this window's gradients are incomplete; call reset() and run "
                "the window's micro-batches again"
            )
        if self.grad_scaler is not None and not self._values:
            self.match_sharding()
        return MicroStep(self, batch_size_of(micro_batch) if n_items is None else n_items, last)

    @property
    def needs_reset(self) -> bool:
        """True after a backward failed part-way: the window's gradients hold a partial sum."""
        return self._dirty

    def reset(self) -> None:
        """Drop the window's gradients and counts, so that its micro-batches can be run again."""
        for p in self._params():
            p.grad = None
        for p in self.model.parameters():
            p.grad = None
        self._form = None
        self._values.clear()
        self._counts.clear()
        self._sizes.clear()
        self._small = None
        self._dirty = False

    # -- per optimizer step ---------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Finish the window: divide by the true count, unscale, clip, step, schedule, free gradients.

        Values are read from the device once, after the optimizer step (the loss, the count, the
        clipping norm and the noise scale's norms together); DDP with a mean loss reads the item count
        before.

        Raises:
            ConfigError: no micro-batch was accumulated, the window is incomplete after a failed
                backward, or a mean loss's items do not add up to ``global_batch_size``.
        """
        if self._dirty:
            raise ConfigError("a backward failed part-way; call reset() and run the window again before step()")
        if not self._values:
            raise ConfigError("step() needs at least one micro-batch passed through accumulate() first")
        params = self._params()
        local = self._form == MEAN and not distributed()
        small = self._small
        if small is None and self.noise_scale is not None and distributed():
            small = self._values[0].new_zeros(3, dtype=torch.float64)  # every rank joins the one all-reduce
        if local:  # one process, counts known on the host: no arithmetic on the device at all
            self._check_item_count(sum(self._sizes))
            pending = torch.stack(self._values)  # (k,) the micro-batches' mean losses, read after the step
        else:
            pending = self._totals(small)  # (2,) float64: [loss_sum, n_items] over all ranks, then `small`'s 3
            if self._form == MEAN:
                self._check_item_count(int(pending[1].item()))
            else:  # multiply by N_prev / N: see NOTE [ Dividing by a count known only at the end ]
                factor = self._token_divisor / pending[1].clamp_min(1.0)
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, factor.to(grads[0].device))
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        norm = None
        if self.max_grad_norm is not None:
            norm = _whole(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        tail = [small] if local and small is not None else []  # read with `pending`, in one transfer
        if norm is not None:
            tail.append(norm.detach().double()[None])
        if small is not None:  # the window's mean gradient, unscaled and not yet clipped: |G_big|²
            if norm is not None:
                big_sq = norm.detach().double().square()
            else:  # sharded gradients: each rank holds the squares of its slices only
                big_sq = all_reduce_sum(grad_sq_norm(params)) if self.sharded else grad_sq_norm(params)
            tail.append(big_sq[None])
        skipped, scale_before = False, 1.0
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            skipped = scaler.get_scale() < scale_before  # the scale only drops when inf/NaN skipped the step
        else:
            self.optimizer.step()
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if tail:  # float64 holds the losses exactly: they read back as the same Python floats
            pending = torch.cat([pending.double(), *(t.to(pending.device) for t in tail)])
        read = pending.tolist()
        sizes = tuple(self._sizes)
        head = len(sizes) if local else 2
        extra = read[head:]  # [small's 3 when measuring] [norm when clipping] [|G_big|² when measuring]
        if local:
            loss_sum, n_items = math.fsum(v * n for v, n in zip(read, sizes)), float(sum(sizes))
        else:
            loss_sum, n_items = read[:2]
        if small is not None and not skipped:  # a step fp16 skipped for inf/NaN measures nothing
            self._measure(extra[:3], extra[-1], n_items, scale_before)
        result = StepResult(
            loss=loss_sum / n_items if n_items > 0 else 0.0,
            n_items=int(round(n_items)),
            micro_batch_size=max(sizes),
            accumulation_steps=len(sizes),
            micro_batch_sizes=sizes,
            grad_norm=extra[3 if small is not None else 0] if norm is not None else None,
            skipped=skipped,
            step=self._step,
            noise_scale=self.noise_scale.b_simple if self.noise_scale is not None else None,
        )
        if self._form == TOKENS and n_items > 0:
            self._token_divisor = n_items
        self._step += 1
        self._form = None
        self._values.clear()
        self._counts.clear()
        self._sizes.clear()
        self._small = None
        return result

    @property
    def sharded(self) -> bool:
        """True when the model is sharded with FSDP2 (``fully_shard``): gradients are slices (DTensors)."""
        return is_sharded(self.model)

    # -- helpers --------------------------------------------------------------------------------------
    def match_sharding(self) -> None:
        """Under FSDP, a scaler that agrees across ranks on whether to skip the step.

        A ``GradScaler`` looks for inf/NaN in this rank's gradient slices only: one rank would skip a
        step the others take. ``ShardedGradScaler`` all-reduces what it found. The one made here is
        replaced (its state carried over); one passed in must already be a ``ShardedGradScaler``.
        Call it after sharding the model (the Trainer does); every window's start checks it again.
        """
        if not self.sharded:
            return
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = self.grad_scaler
        if scaler is None or isinstance(scaler, ShardedGradScaler):
            return
        if not self._own_scaler:
            raise ConfigError(
                "the model is sharded with FSDP but grad_scaler is a GradScaler, which sees only this rank's "
                "gradient slices; pass torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler instead"
            )
        sharded = ShardedGradScaler(self.device_type)
        sharded.load_state_dict(scaler.state_dict())
        self.grad_scaler = sharded

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _totals(self, small: torch.Tensor | None) -> torch.Tensor:
        """``[loss_sum, n_items]`` of the window in float64, then ``small``'s terms, summed over ranks."""
        values = torch.stack(self._values).to(torch.float64)  # (k,)
        if self._form == MEAN:
            counts = torch.tensor(self._counts, dtype=torch.float64, device=values.device)  # (k,)
            loss_sum = values @ counts  # sum of mean_m * n_m
        else:
            counts = torch.stack(
                [torch.as_tensor(c, dtype=torch.float64, device=values.device) for c in self._counts]
            )  # (k,)
            loss_sum = values.sum()
        totals = torch.stack([loss_sum, counts.sum()])  # (2,)
        return all_reduce_sum(totals if small is None else torch.cat([totals, small.to(totals.device)]))

    # NOTE [ Gradient noise scale from the window ]
    # B_simple (batchfit.advice.noise_scale) needs |G|² at a small and a large batch; a window holds both.
    # After its first backward (if not the last), .grad is that micro-batch's rank-local gradient (no_sync)
    # times backward_weighted's weight (n W / G per mean, W / N_prev per token sum) and the GradScaler's S:
    # undone right there into the micro-batch's mean gradient's |g|², on the device (one norm per parameter,
    # no copy, no host read; S is divided out on the host). Under DDP every rank's first micro-batch is a
    # small batch: their [|g|², 1/n, 1] ride the step's one all-reduce, and as E|g_n|² = |G|² + tr(Σ)/n,
    # the ranks' mean |g|² is that of one batch of the harmonic mean of their n. Under FSDP (no no_sync:
    # every micro-batch is reduce-scattered) the first micro-batches of all ranks make *one* small batch
    # of N = sum n items: .grad slices hold (N / divisor) times its mean gradient, whose |.|² is the sum
    # over ranks of the slices' squares (divisor: G, or N_prev, not divided by W). The large batch is the
    # window's mean gradient after the division and unscale_, before clipping (clipping's norm, else one
    # norm per parameter). Both join the step's one host read. Windows of one micro-batch on every rank,
    # and steps fp16 skipped, measure nothing. Token losses count tokens as independent items (they are not).
    def _read_small_gradient(self, count: int | torch.Tensor) -> None:
        """The first micro-batch's ``[|mean gradient|² S², 1/n, 1]`` (n its count), on the device (NOTE above)."""
        sq = grad_sq_norm(self._params())  # 0-d float64
        # A fill, not a host-to-device copy of an int count: that copy would wait for the device.
        n = count.to(sq.device, torch.float64) if isinstance(count, torch.Tensor) else sq.new_full((), float(count))
        divisor = float(self.global_batch_size if self._form == MEAN else self._token_divisor)
        copies = 1.0
        if self.sharded:  # one small batch over all ranks (NOTE above); every rank then holds the same terms,
            sq, n = all_reduce_sum(torch.stack([sq, n])).unbind()  # which the step's all-reduce adds W times
            copies = float(self.world_size)
        else:
            divisor /= self.world_size
        measured = (n > 0).double()  # a token micro-batch may hold no loss-carrying token
        n = n.clamp_min(1.0)
        self._small = torch.stack([sq * measured * (divisor / n) ** 2, measured / n, measured]) / copies  # (3,)

    def _measure(self, small: list[float], big_sq: float, big_n: float, scale: float) -> None:
        """Feed the ranks' mean small-batch norm and the window's norm to the noise scale (NOTE above)."""
        sq_sum, inv_sum, measured = small
        if self.noise_scale is not None and measured > 0 and inv_sum > 0 and 1 <= measured / inv_sum < big_n:
            self.noise_scale.update(sq_sum / measured / scale**2, measured / inv_sum, big_sq, big_n)

    def _check_item_count(self, n: int) -> None:
        if n != self.global_batch_size:
            self.reset()
            raise ConfigError(
                f"the micro-batches of this step held {n} items in total but global_batch_size is "
                f"{self.global_batch_size}; pass every item of the global batch exactly once per step"
            )
