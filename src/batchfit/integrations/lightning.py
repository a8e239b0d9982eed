"""Lightning: ``BatchfitTuner``, a callback that sets the batch size and the accumulation for a global batch.

Lightning's ``BatchSizeFinder`` (and ``Tuner.scale_batch_size``) finds the largest batch by running real
steps at growing sizes until one runs out of memory (``steps_per_trial`` steps per size, about
``log2 N`` sizes), refuses distributed strategies, and finds memory only: the global batch then depends
on the GPU. ``BatchfitTuner(global_batch_size=256, device="A100-80GB")`` instead traces the module's own
``training_step`` on fake tensors at fit start, with one batch of its train dataloader for the shapes and
the optimizer Lightning built from ``configure_optimizers``, and sets

- ``batch_size`` where ``BatchSizeFinder`` sets it (the module, its ``hparams``, the datamodule), and
- ``trainer.accumulate_grad_batches``,

so that ``batch_size x accumulate_grad_batches x world_size`` is the global batch, exactly. Under DDP rank 0
decides and the strategy broadcasts its answer, so every rank runs the same split.

Example:
    >>> trainer = Trainer(callbacks=[BatchfitTuner(256, device="A100-80GB")], precision="bf16-mixed")  # doctest: +SKIP
    >>> trainer.fit(module, datamodule=data)  # doctest: +SKIP

Limitations:
    The batch is taken before ``on_before_batch_transfer``/``on_after_batch_transfer``; a step that
    changes its shapes there is traced with the loader's shapes. ``16-true`` runs as the module's own
    fp16 weights without autocast (batchfit has no fp16-weights precision); manual optimization and
    several optimizers are refused. Nothing checks the answer with real steps on the GPU.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..batching import check_batch_size
from ..errors import BatchfitError, ConfigError
from ..workload import Workload, trainable_parameters
from ._common import RepeatedItems, equal_plan, one_line, require

require("lightning", "lightning", "lightning")
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_info  # noqa: E402

__all__ = ["BatchfitTuner"]

FRAMEWORK = "Lightning"

# Trainer(precision=...) -> batchfit's precision. "-true" precisions are applied to the module before
# on_fit_start (the strategy's precision plugin converts it), so the module's own dtype is what is traced;
# "bf16-true" also builds tensors in bf16 inside the step, as batchfit's "bf16-true" does.
_PRECISIONS = {
    "32-true": "fp32", "32": "fp32", "64-true": "fp32", "64": "fp32", "16-true": "fp32",
    "bf16-true": "bf16-true", "bf16-mixed": "bf16", "16-mixed": "fp16", "16": "fp16", "bf16": "bf16",
}  # fmt: skip


class TrainingStepLoss:
    """``(module, batch) -> loss``: the module's own ``training_step`` (a tensor, or a dict with ``"loss"``)."""

    def __call__(self, module: nn.Module, batch: Any) -> torch.Tensor:
        out = module.training_step(batch, 0)  # type: ignore[operator]
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(
                f"{type(module).__name__}.training_step returned {type(out).__name__}; BatchfitTuner needs the loss "
                "Lightning backpropagates (a tensor, or a dict with 'loss')"
            )
        return loss


class RebuiltOptimizer:
    """``params -> Optimizer``: an optimizer of the same class, groups and hyper-parameters as ``optimizer``,
    over other parameters in the same order (the fake copy of the module the estimator traces)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params_in_order: list[nn.Parameter]) -> None:
        index = {id(p): i for i, p in enumerate(params_in_order)}
        self.cls = type(optimizer)
        self.groups = [
            ({k: v for k, v in g.items() if k != "params"}, [index[id(p)] for p in g["params"] if id(p) in index])
            for g in optimizer.param_groups
        ]
        accepted = inspect.signature(self.cls.__init__).parameters
        self.kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        params = list(params)
        groups = [{**settings, "params": [params[i] for i in idx]} for settings, idx in self.groups if idx]
        return self.cls(groups, **self.kwargs)


def _no_optimizer(params: Any) -> torch.optim.Optimizer:
    """What ``configure_optimizers`` returning None costs: no optimizer state (plain SGD keeps none)."""
    return torch.optim.SGD(params, lr=0.0)


def _one_loader(trainer: Any) -> Any:
    """The train dataloader, reloaded as ``BatchSizeFinder`` reloads it."""
    loop = trainer.fit_loop
    loop._combined_loader = None  # force a reload (Lightning's own tuner does the same)
    loop.setup_data()
    loaders = trainer.train_dataloader
    if isinstance(loaders, (Mapping, list, tuple)):
        raise ConfigError("BatchfitTuner plans one train dataloader; this module returns several")
    if loaders is None:
        raise ConfigError("the module has no train dataloader to take a batch from")
    return loaders


def _reload_dataloaders(trainer: Any) -> None:
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    val = loop.epoch_loop.val_loop
    val._combined_loader = None
    val.setup_data()


def module_workload(trainer: Any, module: nn.Module, batch: Any) -> Workload:
    """The ``Workload`` of one automatic-optimization step of ``module`` on items like ``batch``'s."""
    optimizers = list(getattr(trainer, "optimizers", []) or [])
    if len(optimizers) > 1:
        raise ConfigError("BatchfitTuner plans one optimizer per step; this module configures several")
    params = trainable_parameters(module)
    optimizer = RebuiltOptimizer(optimizers[0], params) if optimizers else _no_optimizer
    return Workload(
        model=module,
        batch=RepeatedItems(batch),
        loss=TrainingStepLoss(),
        optimizer=optimizer,
        name=f"{type(module).__name__} (training_step)",
    )


def lightning_precision(trainer: Any) -> str:
    """batchfit's precision for ``Trainer(precision=...)``.

    Raises:
        ConfigError: a precision batchfit does not model (transformer-engine, fp8, ...).
    """
    name = str(getattr(trainer, "precision", "32-true"))
    if name not in _PRECISIONS:
        raise ConfigError(f"Lightning precision {name!r} is not modelled; use one of {', '.join(sorted(_PRECISIONS))}")
    return _PRECISIONS[name]


class BatchfitTuner(Callback):
    """Sets ``batch_size`` and ``trainer.accumulate_grad_batches`` at fit start, so that
    ``batch_size x accumulate_grad_batches x world_size == global_batch_size``, the largest batch that fits.

    Args:
        global_batch_size: items per optimizer step over all processes.
        device: the GPU each process trains on, to plan for: a catalog name (``"A100-80GB"``), a capacity
            (``"24GiB"``) or a ``SimulatedDevice``; None: the trainer's own CUDA GPU, read from torch.
        batch_arg_name: the attribute the train dataloader reads, found where ``BatchSizeFinder`` looks.
        margin: fraction of each GPU's memory to keep free.

    Attributes:
        plan: the ``Plan`` every rank received (None before fit starts).
    """

    def __init__(
        self, global_batch_size: int, device: Any = None, *, batch_arg_name: str = "batch_size", margin: float = 0.0
    ) -> None:
        check_batch_size(global_batch_size, "the global batch size")
        self.global_batch_size = global_batch_size
        self.device = device
        self.batch_arg_name = batch_arg_name
        self.margin = margin
        self.plan: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if stage not in (None, "fit"):
            return
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(
                f"BatchfitTuner sets `{self.batch_arg_name}` on the LightningModule, its hparams or its datamodule (as "
                f"BatchSizeFinder does), and none has it; add self.{self.batch_arg_name} and read it in "
                "train_dataloader()"
            )
        if not pl_module.automatic_optimization:
            raise ConfigError("BatchfitTuner sets accumulate_grad_batches, which manual optimization ignores")
        for callback in trainer.callbacks:
            if type(callback).__name__ in ("GradientAccumulationScheduler", "BatchSizeFinder"):
                raise ConfigError(f"BatchfitTuner replaces {type(callback).__name__}; remove it from the callbacks")

    def _device(self, trainer: Any) -> Any:
        if self.device is not None:
            return self.device
        if trainer.strategy.root_device.type == "cuda":
            return "cuda"
        raise ConfigError(
            "BatchfitTuner on a trainer without a CUDA GPU needs device= (the GPU to plan for, e.g. 'A100-80GB' "
            "or '24GiB')"
        )

    def _decide(self, trainer: Any, pl_module: Any, loader: Any) -> Any:
        """Rank 0's plan (run with the module's warnings about logging outside a trainer silenced)."""
        batch = next(iter(loader))
        workload = module_workload(trainer, pl_module, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() on the traced copy, which no trainer holds
            return equal_plan(
                workload,
                self.global_batch_size,
                device=self._device(trainer),
                world_size=trainer.world_size,
                rungs=[(lightning_precision(trainer), False)],
                framework=FRAMEWORK,
                margin=self.margin,
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        loader = _one_loader(trainer)  # on every rank: loading the data waits at a barrier
        outcome: tuple[bool, Any] = (False, None)
        if trainer.global_rank == 0:
            try:
                outcome = (True, self._decide(trainer, pl_module, loader))
            except BatchfitError as e:  # every rank raises it, instead of waiting for rank 0's answer
                outcome = (False, e)
            except Exception as e:  # noqa: BLE001 - the module's own step failed: one line on every rank
                outcome = (False, ConfigError(f"planning {type(pl_module).__name__} failed: {one_line(e)}"))
        ok, value = trainer.strategy.broadcast(outcome, src=0)
        if not ok:
            raise value
        self.plan = value
        lightning_setattr(pl_module, self.batch_arg_name, value.micro_batch_size)
        trainer.accumulate_grad_batches = value.accumulation_steps
        _reload_dataloaders(trainer)
        rank_zero_info(
            f"batchfit: global batch {value.global_batch_size} = {self.batch_arg_name} {value.micro_batch_size} x "
            f"accumulate_grad_batches {value.accumulation_steps} x {value.gpus} processes ({value.device}, "
            f"{value.precision}; largest micro-batch that fits: {value.max_micro_batch_size})"
        )
