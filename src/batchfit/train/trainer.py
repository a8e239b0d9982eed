"""Trainer: one call per global batch; splits it, accumulates exactly, recovers from OOM, steps once.

Built on ``Accumulator`` (the maths) and ``run_window`` (the OOM recovery); this module adds what a
loop around them needs: where tensors go (CPU, CUDA or a simulated GPU), the micro-batch size (given,
or planned from the workload's memory), this rank's share of the global batch, and the BatchNorm
advice.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from batchfit.train.trainer import Trainer
    >>> model = nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])
    >>> trainer = Trainer(model, optimizer, loss, global_batch_size=10, micro_batch_size=4)
    >>> result = trainer.step((torch.randn(10, 4), torch.randn(10, 1)))
    >>> result.micro_batch_sizes, result.accumulation_steps
    ((4, 3, 3), 3)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..advice.batchnorm import warn_batchnorm
from ..advice.noise_scale import GradientNoiseScale
from ..batching import Batch, batch_size_of, make_splits, map_tensors, rank_shares
from ..errors import ConfigError, DoesNotFitError, UnknownNameError
from ..precision import Precision, parse_precision
from ..simulated import SimulatedDevice
from ..units import format_bytes
from ..workload import Workload
from .accumulate import Accumulator, StepResult, micro_batch_sizes
from .distributed import decided_on_main, rank, world_size, wrap_model
from .fsdp import is_sharded
from .oom import CacheReleaser, CudaCache, NoCache, is_out_of_memory, release_memory, run_window

LossFn = Callable[[nn.Module, Batch], Any]

log = logging.getLogger("batchfit")


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where a micro-batch goes and how the device's memory is released: the trainer's device seam."""

    device: torch.device
    """Where tensors live (the CPU for a simulated GPU)."""
    name: str
    """For messages: ``cpu``, ``cuda:0``, ``a simulated A100-40GB GPU``."""
    cache: CacheReleaser
    simulated: SimulatedDevice | None = None

    def move(self, batch: Batch) -> Batch:
        """The micro-batch on the device, copied only now, when it is about to run."""
        if self.simulated is not None:  # a host-to-device copy the simulated allocator must see
            return map_tensors(batch, torch.clone)
        device = self.device
        return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def _placement(device: str | torch.device | SimulatedDevice) -> _Placement:
    if isinstance(device, SimulatedDevice):
        generic = device.device.name.startswith("simulated")  # a bare capacity, not a catalog GPU
        name = f"a simulated {format_bytes(device.capacity_bytes) if generic else device.device.name} GPU"
        return _Placement(torch.device("cpu"), name, device, device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N' or a SimulatedDevice, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for but no GPU is visible; use 'cpu' or a SimulatedDevice")
        return _Placement(dev, str(dev), CudaCache())
    return _Placement(dev, "cpu", NoCache())


def _cuda_profile(index: int) -> Any:
    """The catalog entry of the visible GPU, or a generic GPU of its total memory if not in the catalog."""
    from ..devices import generic_device, get_device

    try:
        return get_device(torch.cuda.get_device_name(index))
    except UnknownNameError:
        return generic_device(f"{torch.cuda.get_device_properties(index).total_memory}B")


def _like(spec: Batch, batch_size: int) -> Batch:
    """A batch of ``batch_size`` zero items shaped like ``spec``'s (runs under ``FakeTensorMode``)."""
    return map_tensors(spec, lambda t: torch.zeros((batch_size, *t.shape[1:]), dtype=t.dtype))


def _same_optimizer(cls: type, defaults: dict[str, Any], params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """``cls(params, **defaults)``, minus defaults its constructor does not take (AdamW's are Adam's)."""
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    return cls(params, **defaults)


class Trainer:
    """Train on global batches of any size: micro-batches, exact accumulation, OOM recovery.

    ``step(batch)`` takes this rank's share of one global batch (a tensor, tuple or dict of tensors
    with a leading batch dimension), splits it into micro-batches (``micro_batch_sizes``: the fewest
    that respect the micro-batch size, sizes differing by at most one), and gives the gradient of the
    whole global batch to one optimizer step. See ``batchfit.train.accumulate`` for the weighting and
    ``batchfit.train.oom`` for what happens when a micro-batch runs out of memory.

    Args:
        model: the model, already on ``device`` (a DDP wrapper is fine).
        optimizer: its optimizer.
        loss: ``(model, batch) -> loss``: a scalar mean over the batch's items, or ``(loss_sum,
            n_items)`` for token losses (padding excluded from both).
        global_batch_size: items per optimizer step over all ranks.
        micro_batch_size: items per forward/backward, or ``"auto"`` to take it from
            ``batchfit.plan.plan`` at the first step (which needs the first batch's shapes); on the
            plain CPU, which has no capacity to plan against, ``"auto"`` is the whole share.
        device: ``"cpu"``, ``"cuda"``/``"cuda:N"``, or an entered ``SimulatedDevice`` (tensors stay
            on the CPU; the simulated GPU's allocator decides what fits).
        precision: ``fp32``, ``bf16``, ``fp16`` (with a GradScaler) or ``bf16-true``.
        max_grad_norm: clip the global gradient's norm once per step; None: no clipping.
        scheduler: stepped once per optimizer step.
        grad_scaler: a ``torch.amp.GradScaler`` (a ``ShardedGradScaler`` under FSDP); one is made for fp16 when None.
        workload: what ``micro_batch_size="auto"`` plans with; by default one made of ``model``,
            ``loss``, the optimizer's class and defaults, and batches shaped like the first one.
        noise_scale: measure the gradient noise scale (``trainer.noise_scale``, ``StepResult.noise_scale``)
            from the windows' first micro-batches, into this ``GradientNoiseScale`` (True: a new one,
            False: off); steps of one micro-batch per rank measure nothing.
        sharded: under torchrun, shard parameters, gradients and optimizer states across the ranks
            with FSDP2 (``fully_shard``; see ``batchfit.train.fsdp``) instead of DDP. A plan made by
            ``micro_batch_size="auto"`` turns it on by itself when only sharding fits. Nothing to do
            on a single process.

    Several processes (torchrun): the model is wrapped here, so that the same script runs on one
    process and on many: in DDP, or sharded with FSDP (the optimizer is re-pointed at the sharded
    parameters; build it on the plain model as usual). With ``micro_batch_size="auto"`` the wrap
    waits for the plan at the first step. Under FSDP every rank runs the same number of
    micro-batches (``batching.make_splits``), and an out-of-memory error is not re-split (ranks
    cannot re-split alone when every micro-batch is a collective); like one in the optimizer step,
    it stops this rank with ``DoesNotFitError`` while the others wait in a collective until torchrun
    (or the process group's timeout) ends them. With ``"auto"``, rank 0 plans for every rank.

    Raises:
        ConfigError: a non-positive or too small global batch, a micro-batch size that is not
            ``"auto"`` or 1..global, ``max_grad_norm <= 0``, a model not on ``device``.
        DoesNotFitError: the model itself does not fit on a simulated device.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: LossFn,
        *,
        global_batch_size: int,
        micro_batch_size: int | str = "auto",
        device: str | torch.device | SimulatedDevice = "cpu",
        precision: str | Precision = "fp32",
        max_grad_norm: float | None = None,
        scheduler: Any = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        workload: Workload | None = None,
        noise_scale: GradientNoiseScale | bool = True,
        sharded: bool = False,
    ) -> None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be a whole number >= 1, got {global_batch_size!r}")
        if micro_batch_size != "auto":
            if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
                raise ConfigError(f"micro_batch_size must be 'auto' or a whole number >= 1, got {micro_batch_size!r}")
            if micro_batch_size > global_batch_size:
                raise ConfigError(
                    f"micro_batch_size {micro_batch_size} exceeds global_batch_size {global_batch_size}; "
                    f"use at most {global_batch_size} (a micro-batch is a part of the global batch)"
                )
        if not callable(loss):
            raise ConfigError(f"loss must be a function (model, batch) -> loss, got {type(loss).__name__}")
        self.world_size = world_size()
        if global_batch_size < self.world_size:
            raise ConfigError(
                f"global_batch_size {global_batch_size} is smaller than the {self.world_size} ranks; "
                "give every rank at least one item"
            )
        self.rank = rank()
        self._where = _placement(device)
        on_cpu = self._where.simulated is None and self._where.device.type == "cpu"
        self._move = None if on_cpu else self._where.move  # on the CPU, ``.to`` would return the same tensors
        first = next(model.parameters(), None)
        if first is not None and first.device.type != self._where.device.type:
            raise ConfigError(
                f"the model is on {first.device} but device is {self._where.name}; move it first "
                f"(model.to({self._where.device.type!r})) and build the optimizer after"
            )
        self.precision = parse_precision(precision)
        self.sharded = is_sharded(model) or (bool(sharded) and self.world_size > 1)
        """Parameters sharded with FSDP across the ranks (always False on a single process)."""
        if self.sharded and micro_batch_size == "auto" and is_sharded(model):
            raise ConfigError(
                "a model sharded before the Trainer cannot be planned (micro_batch_size='auto'); pass "
                "micro_batch_size=N, or pass the plain model with sharded=True"
            )
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.global_batch_size = global_batch_size
        self.accumulator = Accumulator(
            model,
            optimizer,
            global_batch_size=global_batch_size,
            max_grad_norm=max_grad_norm,
            scheduler=scheduler,
            grad_scaler=grad_scaler,
            precision=self.precision,
            device_type=self._where.device.type,
            noise_scale=noise_scale,
        )
        self.share = rank_shares(global_batch_size, self.world_size)[self.rank]
        """Items of each global batch that this rank's ``step`` receives."""
        self.micro_batch_size: int | None = None if micro_batch_size == "auto" else int(micro_batch_size)
        """The current micro-batch size (None until ``"auto"`` has planned it at the first step)."""
        self.plan: Any = None
        """The ``Plan`` of ``micro_batch_size="auto"``, after the first step."""
        self._splits: list[int] | None = None
        self._workload = workload
        self._bn_warned = False
        if self._where.simulated is not None:
            self._put_on_simulated(self._where.simulated)
        if self.micro_batch_size is not None:
            self._wrap()
            self._advise_batchnorm()

    @property
    def noise_scale(self) -> GradientNoiseScale | None:
        """The running gradient noise scale (``.b_simple``, ``.recommendation(...)``); None when off."""
        return self.accumulator.noise_scale

    def step(self, batch: Batch) -> StepResult:
        """One optimizer step on this rank's share of one global batch.

        Raises:
            ConfigError: tensors disagree on the leading dimension, the share has the wrong number
                of items, or the loss returns neither a mean nor ``(loss_sum, n_items)``.
            DoesNotFitError: a micro-batch of one item, or the optimizer step, runs out of memory.
        """
        n = batch_size_of(batch)
        if n != self.share:
            whose = f"rank {self.rank}'s share of " if self.world_size > 1 else ""
            raise ConfigError(
                f"step() got a batch of {n} items, expected {self.share} ({whose}the global batch of "
                f"{self.global_batch_size}); pass exactly one global batch per step"
            )
        sim = self._where.simulated
        if sim is not None and not sim.active:
            raise ConfigError("enter the simulated device before training: `with SimulatedDevice(...) as gpu:`")
        if self.micro_batch_size is None:
            self._plan_micro_batch(batch)
            self._wrap()
            self._advise_batchnorm()
        assert self.micro_batch_size is not None
        sizes = self._splits or micro_batch_sizes(n, self.micro_batch_size)
        micro, replans = run_window(
            self.accumulator, batch, sizes, self._run_micro, cache=self._where.cache, where=self._where.name
        )
        if replans:
            self.micro_batch_size, self._splits = micro, None
            self._advise_batchnorm()
        try:
            result = self.accumulator.step()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            summary = " ".join(str(exc).split())[:160]
            release_memory(self._where.cache)
            raise DoesNotFitError(
                f"the optimizer step ran out of memory on {self._where.name} ({summary}): parameters, gradients "
                "and optimizer states do not fit, whatever the micro-batch; use a lighter optimizer (SGD), "
                "--precision bf16-true, a smaller model or a GPU with more memory"
            ) from exc
        return dataclasses.replace(result, micro_batch_size=self.micro_batch_size, replanned=tuple(replans))

    # -- internals ------------------------------------------------------------------------------------
    def _run_micro(self, micro: Batch, n_items: int, last: bool) -> None:
        if self._move is not None:
            micro = self._move(micro)
        with self.accumulator.accumulate(micro, last=last, n_items=n_items) as step:
            step.backward_weighted(self.loss(self.model, micro))  # weighted by its share of the count

    def _wrap(self) -> None:
        """DDP, or FSDP when sharded, on several ranks; the FSDP split (see the class docstring)."""
        if self.world_size == 1:
            return
        if self.sharded and self._where.simulated is not None:
            raise ConfigError(
                f"FSDP sharding does not run on {self._where.name}: the simulated allocator cannot follow "
                "sharded tensors across processes; use real GPUs, --device cpu, or a larger simulated GPU"
            )
        self.model = wrap_model(self.model, self._where.device, sharded=self.sharded, optimizer=self.optimizer)
        self.accumulator.model = self.model
        self.sharded = is_sharded(self.model)
        self.accumulator.match_sharding()  # fp16: a ShardedGradScaler from now on (trainer.accumulator.grad_scaler)
        if self.sharded and self._splits is None:
            assert self.micro_batch_size is not None
            splits = make_splits(self.global_batch_size, self.world_size, self.micro_batch_size, same_count=True)
            self._splits = splits[self.rank]

    def _advise_batchnorm(self) -> None:
        if self._bn_warned or self.micro_batch_size is None:
            return
        # stacklevel 4: warnings.warn <- warn_batchnorm <- this <- __init__/step <- the caller
        advice = warn_batchnorm(
            self.model, self.micro_batch_size, self.global_batch_size, self.world_size, stacklevel=4
        )
        self._bn_warned = advice is not None

    def _put_on_simulated(self, sim: SimulatedDevice) -> None:
        """Account the model and any optimizer state on the simulated GPU (idempotent)."""
        states = [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        try:
            sim.track(self.model, states)
        except torch.OutOfMemoryError as exc:
            raise DoesNotFitError(
                f"the model does not fit on {self._where.name}: its parameters and buffers alone exceed the "
                "capacity; use a smaller model, --precision bf16-true or a GPU with more memory"
            ) from exc

    def _plan_device(self) -> Any:
        if self._where.simulated is not None:
            return self._where.simulated.device
        if self._where.device.type == "cuda":
            return _cuda_profile(self._where.device.index or 0)
        return "cpu"

    def _plan_micro_batch(self, batch: Batch) -> None:
        """``micro_batch_size="auto"``: plan from the workload's traced memory on this device.

        On the plain CPU there is no capacity to plan against: each share runs as one micro-batch (the
        largest share's size on every rank: under FSDP the ranks must agree on the split).
        """
        if self._where.simulated is None and self._where.device.type == "cpu":
            self.micro_batch_size = rank_shares(self.global_batch_size, self.world_size)[0]
            return
        try:
            from ..plan import plan as make_plan  # imports the estimator: only when asked for
        except ImportError as exc:
            raise ConfigError(
                f"micro_batch_size='auto' needs batchfit.plan, which could not be imported ({exc}); "
                "pass micro_batch_size=N"
            ) from exc
        workload = self._workload or self._own_workload(batch)
        run: Callable[[], Any] = partial(
            make_plan,
            workload,
            self.global_batch_size,
            device=self._plan_device(),
            gpus=self.world_size,
            precision=self.precision.value,
        )
        if self._where.simulated is not None:
            # Dispatch modes are per thread: planning traces fake tensors, which the simulated device's
            # mode (active in this thread) would otherwise count as allocations of its own.
            planner = run

            def in_a_thread() -> Any:
                with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                    return pool.submit(planner).result()

            run = in_a_thread
        plan = decided_on_main(run)  # rank 0 plans for every rank (they must agree on the split)
        if getattr(plan, "checkpointing", False):
            from ..checkpointing import apply_checkpointing, checkpoint_classes

            classes = checkpoint_classes("blocks", workload.checkpoint_blocks)
            wrapped = apply_checkpointing(self.model, classes)
            log.info("the plan needs activation checkpointing: %d blocks of %s wrapped", wrapped, classes)
        micro = getattr(plan, "micro_batch_size", None)
        if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
            raise ConfigError(f"the plan gave micro_batch_size={micro!r}; pass micro_batch_size=N instead")
        self.plan, self.micro_batch_size = plan, min(micro, self.global_batch_size)
        splits = getattr(plan, "splits", None)
        mine = list(splits[self.rank]) if splits and len(splits) > self.rank else None
        self.sharded = self.sharded or (bool(getattr(plan, "sharded", False)) and self.world_size > 1)
        smallest = 0 if self.sharded else 1  # FSDP plans may end a share with padding (batching.make_splits)
        valid = mine and sum(mine) == self.share and max(mine) <= self.micro_batch_size and min(mine) >= smallest
        if valid and (not self.sharded or len({len(s) for s in splits}) == 1):  # FSDP: ranks agree on the count
            self._splits = mine  # execute the plan exactly as it was made

    def _own_workload(self, batch: Batch) -> Workload:
        spec = map_tensors(batch, lambda t: torch.empty((0, *t.shape[1:]), dtype=t.dtype, device="meta"))
        model = self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model
        opt = self.optimizer
        return Workload(
            model=model,
            batch=partial(_like, spec),
            loss=self.loss,
            optimizer=partial(_same_optimizer, type(opt), dict(opt.defaults)),
            name="trainer",
        )
