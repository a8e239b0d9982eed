"""Exact gradient accumulation: micro-batches whose gradients add up to exactly the global batch's.

Accumulation is easy to get subtly wrong: summing instead of averaging, averaging per-micro-batch means
(which over-weights micro-batches with few loss-carrying tokens), or dividing by a count that the last,
shorter window does not have. Here every micro-batch's loss is weighted by its *count* of items, the
divisor is the count of the whole global batch over every rank, and the optimizer, the clipping, the
scheduler and ``zero_grad`` each run once per global batch (see "Exact large-batch emulation" in the
design notes).

``Accumulator`` is the piece for people who keep their own loop; ``batchfit.Trainer`` is built on it.
On the way it measures the gradient noise scale (see NOTE [ Gradient noise scale from the window ] in
``window_noise``). One micro-batch's context and its weighted backward live in ``micro_step``, the
stages of ``step`` after the window's totals in ``finish``, the step's result in ``results``.

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
from typing import Any

import torch
from torch import nn

from ..advice.noise_scale import GradientNoiseScale
from ..batching import Batch, batch_size_of, check_batch_size
from ..errors import ConfigError, DoesNotFitError
from ..precision import Precision, policy_for
from ..runtime.simulated import SimulatedDevice
from .distributed import all_reduce_sum, distributed, world_size
from .finish import finish_window, refusing, stacked
from .fsdp import is_sharded
from .micro_step import MEAN, TOKENS, MicroStep, loss_terms
from .results import StepResult
from .window_noise import small_batch_terms

__all__ = ["MEAN", "TOKENS", "Accumulator", "MicroStep", "StepResult", "loss_terms", "micro_batch_sizes"]

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
        precision: ``fp32``, ``bf16``, ``fp16``, ``bf16-true-autocast`` (autocast of the forward) or ``bf16-true``.
        device_type: ``"cpu"`` or ``"cuda"`` for autocast; by default that of the first parameter.
        noise_scale: measure the gradient noise scale into this ``GradientNoiseScale`` (True: a new
            one, False: off); see NOTE [ Gradient noise scale from the window ].
        device: a ``SimulatedDevice`` to train on, entered or not: the model's parameters, buffers
            and optimizer state are placed on it now, and every ``accumulate`` block and ``step`` run
            on it. Copy micro-batches there with ``device.to_device(batch)``, as ``.to("cuda")`` would.
            Real devices need nothing here: the tensors say where they are.

    Windows start from no gradients: any the parameters hold when the Accumulator is built are dropped.
    An out-of-memory error in a micro-batch block leaves it as a ``MicroBatchOutOfMemory`` saying what
    still holds; one in ``step`` as a ``DoesNotFitError`` naming the stage (see NOTE [ Out of memory
    while finishing the window ] in ``finish``).

    Raises:
        ConfigError: a non-positive global batch or ``max_grad_norm``, an unknown precision, or a
            ``noise_scale`` that is neither a bool nor a ``GradientNoiseScale``.
        DoesNotFitError: the model does not fit on the simulated ``device``.
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
        device: SimulatedDevice | None = None,
    ) -> None:
        check_batch_size(global_batch_size, "global_batch_size")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf):
            raise ConfigError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(noise_scale, (bool, GradientNoiseScale)):
            raise ConfigError(f"noise_scale must be True, False or a GradientNoiseScale, got {noise_scale!r}")
        if device is not None and not isinstance(device, SimulatedDevice):
            raise ConfigError(f"device must be a SimulatedDevice or None, got {type(device).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.scheduler = scheduler
        if device_type is None:
            first = next(model.parameters(), None)
            device_type = first.device.type if first is not None else "cpu"
        self.device_type = device_type
        self.simulated = device
        """The simulated GPU the window runs on (None: wherever the tensors are)."""
        self.where = device.label if device is not None else device_type
        """The device in messages (the Trainer sets its own name, ``cuda:0``, ``a simulated T4 GPU``)."""
        policy = policy_for(precision)
        self._autocast: Callable[[], contextlib.AbstractContextManager] | None = policy.autocast(device_type)
        self._own_scaler = grad_scaler is None
        if grad_scaler is None and policy.precision is Precision.FP16:
            grad_scaler = torch.amp.GradScaler(device_type)
        self.grad_scaler = grad_scaler
        self.world_size = world_size()
        """Data-parallel ranks whose gradients are averaged (the processes, or the tensor-parallel groups)."""
        self.group: Any = None
        """The process group counts and losses are summed over (None: the default group)."""
        self.planned_micro_batch_size: int | None = None
        """The micro-batch size the caller plans for the next window (the Trainer's, after re-plans); under
        DDP the ranks agree on the smallest at each window's last backward and leave it here."""
        self._token_divisor = float(global_batch_size)  # N_prev; see NOTE [ Dividing by a count known only at the end ]
        self._step = 0
        self._form: str | None = None
        self._values: list[torch.Tensor] = []
        self._counts: list[int | torch.Tensor] = []
        self._sizes: list[int] = []
        self._prepared: torch.Tensor | None = None  # the window's local totals; see NOTE [ One rank out of ... ]
        self._dirty = False
        self.noise_scale: GradientNoiseScale | None = (
            GradientNoiseScale() if noise_scale is True else noise_scale or None
        )
        """The running gradient noise scale estimate (None when off)."""
        self._small: torch.Tensor | None = None  # (3,) float64; see NOTE [ Gradient noise scale from the window ]
        self.reset()
        if device is not None:
            self.place_on(device)

    def use_group(self, group: Any, size: int) -> None:
        """Sum counts and losses over ``group`` of ``size`` data-parallel ranks (tensor parallelism: the
        ranks of a group hold the same loss, and FSDP averages gradients over the groups only)."""
        self.group, self.world_size = group, size

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
            MicroBatchOutOfMemory: (on leaving the block) the micro-batch ran out of memory.
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
        self._prepared = None
        self._small = None
        self._dirty = False

    def place_on(self, device: SimulatedDevice) -> None:
        """Put the model's parameters and buffers, and any optimizer state, on the simulated ``device``.

        What ``model.to("cuda")`` does on a GPU; idempotent (a tensor already there is not counted twice).

        Raises:
            DoesNotFitError: they do not fit.
        """
        states = [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        try:
            device.track(self.model, states)
        except torch.OutOfMemoryError as exc:
            raise DoesNotFitError(
                f"the model does not fit on {self.where}: its parameters and buffers alone exceed the "
                "capacity; use a smaller model, --precision bf16-true or a GPU with more memory"
            ) from exc

    # -- per optimizer step ---------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Finish the window: divide by the true count, unscale, clip, step, schedule, free gradients.

        Values are read from the device once, after the optimizer step (the loss, the count, the
        clipping norm and the noise scale's norms together); DDP with a mean loss reads the item count
        before.

        Raises:
            ConfigError: no micro-batch was accumulated, the window is incomplete after a failed
                backward, or a mean loss's items do not add up to ``global_batch_size``.
            DoesNotFitError: a stage of the step ran out of memory (see NOTE [ Out of memory while
                finishing the window ]); the message names it.
        """
        if self._dirty:
            raise ConfigError("a backward failed part-way; call reset() and run the window again before step()")
        if not self._values:
            raise ConfigError("step() needs at least one micro-batch passed through accumulate() first")
        sim = self.simulated
        with sim.using() if sim is not None else contextlib.nullcontext():
            return self._finish()

    def _finish(self) -> StepResult:
        local = self._form == MEAN and not distributed()
        sizes = tuple(self._sizes)
        reads: dict[str, torch.Tensor | list[torch.Tensor]] = {}  # read back together, after the step
        with refusing(self, "summing the window's losses and counts", updated=False):
            if local:  # one process, counts known on the host: no arithmetic on the device at all
                self._check_item_count(sum(sizes))
                reads["losses"] = stacked(self._values)  # (k,) the micro-batches' mean losses
            else:
                totals = self._prepared if self._prepared is not None else self._prepare_totals()
                # [loss_sum, n_items] over all ranks, then the noise scale's 3 small-batch terms
                group = () if self.group is None else (self.group,)  # the default group, or the data-parallel one
                reads["totals"] = totals = all_reduce_sum(totals, *group)
                if self._form == MEAN:
                    self._check_item_count(int(totals[1].item()))
        measuring = self.noise_scale is not None and (self._small is not None or not local)
        return finish_window(self, reads, sizes, measuring=measuring)

    def _end_window(self, n_items: float) -> None:
        """Forget the finished window; a token loss's count becomes the next window's ``N_prev``."""
        if self._form == TOKENS and n_items > 0:
            self._token_divisor = n_items
        self._step += 1
        self._form = None
        self._values.clear()
        self._counts.clear()
        self._sizes.clear()
        self._prepared = None
        self._small = None

    @property
    def sharded(self) -> bool:
        """True when the model is sharded with FSDP2 (``fully_shard``): gradients are slices (DTensors)."""
        return is_sharded(self.model)

    @property
    def split(self) -> bool:
        """True when the model's parameters are DTensors of tensor parallelism: every micro-batch is a
        collective of a group's ranks, as under FSDP."""
        from .tensor_parallel import is_split

        return is_split(self.model) and not self.sharded

    @property
    def synchronising(self) -> bool:
        """True when the window's last backward all-reduces the gradients of several ranks (DDP)."""
        return self.world_size > 1 and not self.sharded

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

    def _totals_before_sync(self, value: torch.Tensor, count: int | torch.Tensor) -> None:
        """The window's totals, prepared with its last micro-batch when they will be all-reduced."""
        if distributed():
            self._prepare_totals(value, count)

    def _prepare_totals(self, value: torch.Tensor | None = None, count: int | torch.Tensor = 0) -> torch.Tensor:
        """This rank's ``[loss_sum, n_items]`` in float64, then the noise scale's 3 terms (to be all-reduced).

        ``value`` and ``count`` are the last micro-batch's, not yet in the window. Under
        torch.distributed they are prepared before the last backward (NOTE [ One rank out of memory
        under DDP ] in ``micro_step``), so that nothing allocates between it and the all-reduce.
        """
        values = self._values if value is None else [*self._values, value]
        counts = self._counts if value is None else [*self._counts, count]
        form = self._form
        stacked = torch.stack(values).to(torch.float64)  # (k,)
        if form == MEAN:
            n = torch.tensor(counts, dtype=torch.float64, device=stacked.device)  # (k,)
            loss_sum = stacked @ n  # sum of mean_m * n_m
        else:
            n = torch.stack([torch.as_tensor(c, dtype=torch.float64, device=stacked.device) for c in counts])  # (k,)
            loss_sum = stacked.sum()
        totals = torch.stack([loss_sum, n.sum()])  # (2,)
        small = self._small
        if small is None and self.noise_scale is not None:
            small = stacked.new_zeros(3)  # every rank joins the one all-reduce with the same length
        self._prepared = totals if small is None else torch.cat([totals, small.to(totals.device)])
        return self._prepared

    def _read_small_gradient(self, count: int | torch.Tensor) -> None:
        """Keep the first micro-batch's terms (see NOTE [ Gradient noise scale from the window ])."""
        divisor = float(self.global_batch_size if self._form == MEAN else self._token_divisor)
        self._small = small_batch_terms(
            self._params(), count, divisor=divisor, world_size=self.world_size, sharded=self.sharded
        )

    def _check_item_count(self, n: int) -> None:
        if n != self.global_batch_size:
            self.reset()
            raise ConfigError(
                f"the micro-batches of this step held {n} items in total but global_batch_size is "
                f"{self.global_batch_size}; pass every item of the global batch exactly once per step"
            )

