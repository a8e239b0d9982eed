"""Trainer: one call per global batch; splits it, accumulates exactly, recovers from OOM, steps once.

Built on ``Accumulator`` (the maths) and ``run_window`` (the OOM recovery); this module adds what a
loop around them needs: where tensors go (``placement``: CPU, CUDA or a simulated GPU), the micro-batch
size (given, or planned from the workload's memory: ``auto_plan``), this rank's share of the global
batch, and the BatchNorm advice.

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

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..advice.batchnorm import warn_batchnorm
from ..advice.noise_scale import GradientNoiseScale
from ..batching import Batch, batch_size_of, check_batch_size, make_splits, rank_shares
from ..errors import ConfigError, DoesNotFitError
from ..precision import Precision, parse_precision
from ..runtime.simulated import SimulatedDevice
from ..workload import Workload
from .accumulate import Accumulator, StepResult, micro_batch_sizes
from .auto_plan import make_plan, own_workload, planned_micro_batch_size, planned_splits
from .distributed import rank, world_size, wrap_model
from .fsdp import is_sharded
from .oom_resplit import release_memory, run_window
from .placement import Placement, cuda_profile, placement
from .tensor_parallel import check_tensor_parallel

LossFn = Callable[[nn.Module, Batch], Any]

log = logging.getLogger("batchfit")

_Placement = Placement  # the names tests and older code reach for
_cuda_profile = cuda_profile


class Trainer:
    """Train on global batches of any size: micro-batches, exact accumulation, OOM recovery.

    ``step(batch)`` takes this rank's share of one global batch (a tensor, tuple or dict of tensors
    with a leading batch dimension), splits it into micro-batches (``micro_batch_sizes``: the fewest
    that respect the micro-batch size, sizes differing by at most one), and gives the gradient of the
    whole global batch to one optimizer step. See ``batchfit.train.accumulate`` for the weighting and
    ``batchfit.train.oom_resplit`` for what happens when a micro-batch runs out of memory.

    Args:
        model: the model, already on ``device`` (a DDP wrapper is fine).
        optimizer: its optimizer.
        loss: ``(model, batch) -> loss``: a scalar mean over the batch's items, or ``(loss_sum,
            n_items)`` for token losses (padding excluded from both).
        global_batch_size: items per optimizer step over all ranks.
        micro_batch_size: items per forward/backward, or ``"auto"`` to take it from
            ``batchfit.plan.plan`` at the first step (which needs the first batch's shapes); on the
            plain CPU, which has no capacity to plan against, ``"auto"`` is the whole share.
        device: ``"cpu"``, ``"cuda"``/``"cuda:N"``, or a ``SimulatedDevice``, entered by the caller or
            not: the Trainer uses it as a GPU (tensors stay on the CPU; the simulated allocator decides
            what fits). The model's parameters and buffers are placed on it here, each micro-batch is
            copied there when it runs; the global batch passed to ``step`` stays host memory.
        precision: ``fp32``, ``bf16``, ``fp16`` (with a GradScaler), ``bf16-true`` or ``bf16-true-autocast``.
        max_grad_norm: clip the global gradient's norm once per step; None: no clipping.
        scheduler: stepped once per optimizer step.
        grad_scaler: a ``torch.amp.GradScaler`` (a ``ShardedGradScaler`` under FSDP); one is made for fp16 when None.
        workload: what ``micro_batch_size="auto"`` plans with; by default one made of ``model``,
            ``loss``, the optimizer's class and defaults, and batches shaped like the first one.
        noise_scale: measure the gradient noise scale (``trainer.noise_scale``, ``StepResult.noise_scale``)
            from the windows' first micro-batches, into this ``GradientNoiseScale`` (True: a new one,
            False: off); steps of one micro-batch per rank measure nothing.
        tensor_parallel: under torchrun, split the model across groups of this many consecutive ranks
            (inside a node) by its tensor-parallel plan, FSDP across the groups: the layout
            ``batchfit.plan`` estimates (``batchfit.train.tensor_parallel``). The ranks of a group pass the
            group's share of each global batch to ``step``. With ``micro_batch_size="auto"`` only on the
            CPU (a GPU plan is made before launching: ``batchfit plan --tp N``).
        sequence_parallel: with ``tensor_parallel``, split the blocks' activations along the sequence.
        tp_plan: the tensor-parallel plan (module paths to styles, as ``Workload.tp_plan``); None: the
            workload's, else the one the model publishes (transformers' ``base_model_tp_plan``).
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
    (or the process group's timeout) ends them. With ``"auto"``, rank 0 plans for every rank. Under
    DDP a rank re-splits alone (its micro-batches but the last run under ``no_sync``), every rank then
    takes the smallest micro-batch size any of them needed, and a rank that cannot go on stops all of
    them with the same ``DoesNotFitError`` (NOTE [ One rank out of memory under DDP ] in ``micro_step``).

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
        tensor_parallel: int = 1,
        sequence_parallel: bool = False,
        tp_plan: Mapping[str, Any] | None = None,
    ) -> None:
        check_batch_size(global_batch_size, "global_batch_size")
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
        self.tensor_parallel = check_tensor_parallel(tensor_parallel, self.world_size)
        """Processes of one tensor-parallel group (1: none; see ``batchfit.train.tensor_parallel``)."""
        self.sequence_parallel = bool(sequence_parallel) and self.tensor_parallel > 1
        self.data_parallel = self.world_size // self.tensor_parallel
        """Ranks that take different items: the processes, or the tensor-parallel groups."""
        if global_batch_size < self.data_parallel:
            raise ConfigError(
                f"global_batch_size {global_batch_size} is smaller than the {self.data_parallel} ranks; "
                "give every rank at least one item"
            )
        self.rank = rank()
        if self.tensor_parallel > 1:
            if micro_batch_size == "auto" and placement(device).device.type != "cpu":
                raise ConfigError(
                    "micro_batch_size='auto' cannot plan tensor parallelism inside torchrun (a rank is traced on a "
                    "fake process group); run batchfit plan --tp N first and pass its micro-batch size"
                )
            noise_scale = False  # not measured under tensor parallelism (README: limitations)
        self._where = placement(device)
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
            device=self._where.simulated,  # places the model there (DoesNotFitError if it does not fit)
        )
        self.share = rank_shares(global_batch_size, self.data_parallel)[self.rank // self.tensor_parallel]
        """Items of each global batch that this rank's ``step`` receives (the same for the ranks of a
        tensor-parallel group: its share)."""
        self._loss_context: Any = contextlib.nullcontext
        self._tp_plan = tp_plan if tp_plan is not None else getattr(workload, "tp_plan", None)
        self.micro_batch_size: int | None = None if micro_batch_size == "auto" else int(micro_batch_size)
        """The current micro-batch size (None until ``"auto"`` has planned it at the first step)."""
        self.plan: Any = None
        """The ``Plan`` of ``micro_batch_size="auto"``, after the first step."""
        self._splits: list[int] | None = None
        self._workload = workload
        self._bn_warned = False
        if self.micro_batch_size is not None:
            self._wrap()
            self._advise_batchnorm(stacklevel=4)

    @property
    def noise_scale(self) -> GradientNoiseScale | None:
        """The running gradient noise scale (``.b_simple``, ``.recommendation(...)``); None when off."""
        return self.accumulator.noise_scale

    def step(self, batch: Batch) -> StepResult:
        """One optimizer step on this rank's share of one global batch.

        An out-of-memory error anywhere in the step re-splits the micro-batches (see
        ``batchfit.train.oom_resplit``) or ends in one ``DoesNotFitError`` naming where it struck and what to
        change; none escapes as a raw ``torch.OutOfMemoryError``.

        Raises:
            ConfigError: tensors disagree on the leading dimension, the share has the wrong number
                of items, or the loss returns neither a mean nor ``(loss_sum, n_items)``.
            DoesNotFitError: a micro-batch of one item, the optimizer step or another stage after the
                micro-batches runs out of memory (or, under DDP, another rank could not go on).
        """
        n = batch_size_of(batch)
        if n != self.share:
            whose = f"rank {self.rank}'s share of " if self.data_parallel > 1 else ""
            raise ConfigError(
                f"step() got a batch of {n} items, expected {self.share} ({whose}the global batch of "
                f"{self.global_batch_size}); pass exactly one global batch per step"
            )
        with self._where.using():  # a simulated GPU given but not entered is the Trainer's to enter
            return self._step(batch, n)

    def _step(self, batch: Batch, n: int) -> StepResult:
        if self.micro_batch_size is None:
            self._plan_micro_batch(batch)
            self._wrap()
            self._advise_batchnorm()
        assert self.micro_batch_size is not None
        acc = self.accumulator
        acc.where = self._where.name
        acc.planned_micro_batch_size = self.micro_batch_size
        sizes = self._splits or micro_batch_sizes(n, self.micro_batch_size)
        micro, replans = run_window(acc, batch, sizes, self._run_micro, cache=self._where.cache, where=acc.where)
        planned = micro if replans else self.micro_batch_size
        agreed = acc.planned_micro_batch_size  # under DDP: the smallest size any rank needs from now on
        if agreed is not None and agreed < planned:
            planned = agreed
        if planned != self.micro_batch_size:
            self.micro_batch_size, self._splits = planned, None
            self._advise_batchnorm()
        try:
            result = acc.step()
        except DoesNotFitError:
            release_memory(self._where.cache)
            raise
        return dataclasses.replace(result, micro_batch_size=self.micro_batch_size, replanned=tuple(replans))

    # -- internals ------------------------------------------------------------------------------------
    def _run_micro(self, micro: Batch, n_items: int, last: bool) -> None:
        if self._move is not None:
            micro = self._move(micro)
        with self._loss_context(), self.accumulator.accumulate(micro, last=last, n_items=n_items) as step:
            step.backward_weighted(self.loss(self.model, micro))  # weighted by its share of the count

    def _wrap(self) -> None:
        """DDP, or FSDP when sharded, on several ranks; the FSDP split (see the class docstring)."""
        if self.world_size == 1:
            return
        if self.tensor_parallel > 1:
            self._split()
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

    def _split(self) -> None:
        """Tensor parallelism (and FSDP across the groups): ``batchfit.train.tensor_parallel``."""
        from ..workload import ParallelLayout
        from .tensor_parallel import data_parallel_group, loss_context, split_model

        if self._where.simulated is not None:
            raise ConfigError(
                f"tensor parallelism does not run on {self._where.name}: the simulated allocator cannot follow "
                "split tensors across processes; use real GPUs or --device cpu"
            )
        layout = ParallelLayout(self.tensor_parallel, self.sequence_parallel, fsdp=self.data_parallel)
        plan = self._tp_plan
        self.model, mesh = split_model(self.model, self.optimizer, layout, self._where.device, plan)
        self.accumulator.model = self.model
        self.accumulator.use_group(data_parallel_group(mesh), self.data_parallel)
        self.sharded = is_sharded(self.model)
        self.accumulator.match_sharding()
        self._loss_context = loss_context(self.model, layout, plan)
        assert self.micro_batch_size is not None
        splits = make_splits(self.global_batch_size, self.data_parallel, self.micro_batch_size, same_count=True)
        self._splits = splits[self.rank // self.tensor_parallel]

    def _advise_batchnorm(self, stacklevel: int = 5) -> None:
        if self._bn_warned or self.micro_batch_size is None:
            return
        # stacklevel 5: warnings.warn <- warn_batchnorm <- this <- _step <- step <- the caller (4 from __init__)
        advice = warn_batchnorm(
            self.model, self.micro_batch_size, self.global_batch_size, self.world_size, stacklevel=stacklevel
        )
        self._bn_warned = advice is not None

    def _plan_device(self) -> Any:
        if self._where.simulated is not None:
            return self._where.simulated.device
        if self._where.device.type == "cuda":
            return cuda_profile(self._where.device.index or 0)
        return "cpu"

    def _plan_micro_batch(self, batch: Batch) -> None:
        """``micro_batch_size="auto"``: plan from the workload's traced memory on this device.

        On the plain CPU there is no capacity to plan against: each share runs as one micro-batch (the
        largest share's size on every rank: under FSDP the ranks must agree on the split).
        """
        if self._where.simulated is None and self._where.device.type == "cpu":
            self.micro_batch_size = rank_shares(self.global_batch_size, self.data_parallel)[0]
            return
        workload = self._workload or own_workload(self.model, self.optimizer, self.loss, batch)
        plan = make_plan(
            workload,
            self.global_batch_size,
            device=self._plan_device(),
            gpus=self.world_size,
            precision=self.precision.value,
            in_a_thread=self._where.simulated is not None,
        )
        if getattr(plan, "checkpointing", False):
            from ..activation_checkpointing import apply_checkpointing, checkpoint_classes

            # every block, or the fewest first blocks the plan needs (the rest selectively, where it chose so)
            classes = checkpoint_classes(plan.checkpointing_setting, workload.checkpoint_blocks)
            wrapped = apply_checkpointing(self.model, classes)
            log.info("the plan needs activation checkpointing: %d blocks of %s checkpointed", wrapped, classes)
        self.plan, self.micro_batch_size = plan, planned_micro_batch_size(plan, self.global_batch_size)
        self.sharded = self.sharded or (bool(getattr(plan, "sharded", False)) and self.world_size > 1)
        mine = planned_splits(
            plan, rank=self.rank, share=self.share, micro_batch_size=self.micro_batch_size, sharded=self.sharded
        )
        if mine is not None:
            self._splits = mine  # execute the plan exactly as it was made
