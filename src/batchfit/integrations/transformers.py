"""Hugging Face ``Trainer``: plan ``TrainingArguments`` for a global batch, and watch memory while it trains.

``plan_training_arguments(model, args, 64, device="A100-80GB")`` traces the step the ``Trainer`` would run
with ``args`` (its optimizer from ``args.optim`` with its weight-decay groups, ``bf16``/``fp16`` autocast,
activation checkpointing of the model's layers, the model's own loss with ``num_items_in_batch``) and
returns a copy of ``args`` whose ``per_device_train_batch_size x gradient_accumulation_steps x world size``
is the global batch, exactly, with the precision and checkpointing that make it fit. Nothing runs on a
GPU and nothing crashes: compare ``auto_find_batch_size``, which retries at 90% after each out-of-memory
error and never raises ``gradient_accumulation_steps``, so the global batch shrinks.

Example:
    >>> from transformers import TrainingArguments  # doctest: +SKIP
    >>> args, plan = plan_training_arguments(model, TrainingArguments("out"), 64, device="A100-80GB")  # doctest: +SKIP
    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[BatchfitCallback(plan)])  # doctest: +SKIP

Limitations:
    Only what ``TrainingArguments`` expresses is chosen: fp32, bf16/fp16 autocast and activation
    checkpointing (not bf16 weights, which come from how the model is loaded, nor FSDP/DeepSpeed).
    ``activation_checkpointing_kwargs={"every_n_layers": n}`` is estimated as every layer; a custom
    ``compute_loss`` or ``optimizers=`` passed to the ``Trainer`` is not seen.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..activation_checkpointing import keep_first_blocks
from ..errors import ConfigError
from ..memory.trace.fake_step import fake_model
from ..report.tables import checkpointing_words
from ..runtime.monitor import MemoryMonitor
from ..train.distributed import decided_on_main
from ..units import format_bytes
from ..workload import Workload
from ._common import equal_plan, plan_device, require

require("transformers", "transformers", "transformers")
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from ._hf_workload import checkpoint_layers, trainer_config, trainer_workload  # noqa: E402

__all__ = [
    "BatchfitCallback",
    "plan_trainer",
    "plan_training_arguments",
    "trainer_workload",
    "training_argument_fields",
]

FRAMEWORK = "the Hugging Face Trainer"


# -- planning --------------------------------------------------------------------------------------
def _rungs(device: Any, precision: str | None, checkpointing: bool | None, has_layers: bool) -> list[tuple[str, bool]]:
    """The configurations ``TrainingArguments`` can express, in batchfit's ladder order (fp32, autocast,
    autocast with checkpointing); a precision or checkpointing the caller fixed stays fixed."""
    if precision == "bf16-true":
        raise ConfigError(
            "the Trainer trains bf16 weights when the model is loaded in bf16 (torch_dtype=torch.bfloat16), not "
            "through TrainingArguments; load it so and plan with bf16=False, or use --precision bf16"
        )
    if checkpointing and not has_layers:
        raise ConfigError("activation checkpointing was asked for, but the model has no layers the Trainer checkpoints")
    low = "bf16" if plan_device(device).bf16 else "fp16"
    if precision is None and checkpointing is None:
        return [("fp32", False), (low, False)] + ([(low, True)] if has_layers else [])
    if precision is None:
        return [("fp32", bool(checkpointing)), (low, bool(checkpointing))]
    if checkpointing is None:
        return [(precision, False)] + ([(precision, True)] if has_layers else [])
    return [(precision, checkpointing)]


def plan_trainer(
    workload: Workload,
    global_batch_size: int,
    *,
    device: Any,
    gpus: int = 1,
    precision: str | None = None,
    checkpointing: Any = None,
    margin: float = 0.0,
    **plan_kwargs: Any,
) -> Any:
    """``plan`` restricted to what the ``Trainer`` can run: equal micro-batches on every rank, fp32 or
    autocast, activation checkpointing of its layers (``workload.checkpoint_blocks``).

    Takes ``plan``'s arguments (``checkpointing``: None to choose, True/"blocks" or False to fix it; the
    learning-rate ones go to ``plan`` as they are).

    Raises:
        ConfigError: see ``batchfit.integrations._common.per_rank_share``; bf16 weights.
        DoesNotFitError: not one item per GPU fits in any configuration the Trainer has.
    """
    fixed = None if checkpointing is None else bool(checkpointing)
    rungs = _rungs(device, precision, fixed, bool(workload.checkpoint_blocks))
    return equal_plan(
        workload,
        global_batch_size,
        device=device,
        world_size=gpus,
        rungs=rungs,
        framework=FRAMEWORK,
        margin=margin,
        choose_blocks=fixed is None,  # the plan turned checkpointing on: the fewest layers (BatchfitCallback)
        **plan_kwargs,
    )


def training_argument_fields(plan: Any) -> dict[str, Any]:
    """The ``TrainingArguments`` fields that run ``plan`` (batch sizes, precision, checkpointing, and the
    learning rate when the plan scaled one)."""
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    fields: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.accumulation_steps,
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
        "auto_find_batch_size": False,  # the plan fits: a search that shrinks the global batch must not run
    }
    # transformers >= 5 renamed gradient_checkpointing (kept as a deprecated alias that mirrors it)
    key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    fields[key] = bool(plan.checkpointing)
    if plan.scaled_lr is not None:
        fields["learning_rate"] = plan.scaled_lr
    return fields


def plan_training_arguments(
    model: nn.Module,
    args: TrainingArguments,
    global_batch_size: int,
    *,
    device: Any,
    seq_len: int | None = None,
    sample: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    margin: float = 0.0,
) -> tuple[TrainingArguments, Any]:
    """A copy of ``args`` that trains ``global_batch_size`` items per optimizer step on ``device``, and its plan.

    Args:
        model: the model the ``Trainer`` will train (a transformers model, peft-wrapped or not).
        args: the ``TrainingArguments`` to start from: their optimizer, and ``bf16``/``fp16`` and
            activation checkpointing if already on, are kept; otherwise the plan may turn them on.
        global_batch_size: items per optimizer step over all processes.
        device: the GPU of each process: a catalog name (``"A100-80GB"``), a capacity (``"24GiB"``), a
            ``SimulatedDevice`` or ``"cuda"`` (the visible GPU, read from torch: nothing runs on it).
        seq_len: tokens (or samples) per item of the synthetic batch made from the model's config.
        sample: one example of the training data, or a collated batch: its shapes instead of
            synthetic ones (give the longest example when lengths vary).
        world_size: processes (GPUs) training; None: ``args.world_size``.
        margin: fraction of each GPU's memory to keep free.

    Returns:
        ``(args_copy, plan)``: ``args_copy.per_device_train_batch_size * gradient_accumulation_steps *
        world_size == global_batch_size``.

    Raises:
        ConfigError: a global batch smaller than the world size or not divisible by it, a model the
            Trainer cannot run, an optimizer it cannot build, bad shapes.
        DoesNotFitError: one item per GPU does not fit even with autocast and checkpointing.
    """
    world = args.world_size if world_size is None else world_size
    fixed_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    checkpointing = getattr(args, "activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(args, "gradient_checkpointing", False)

    def decide() -> Any:
        workload = trainer_workload(model, args, seq_len=seq_len, sample=sample)
        with trainer_config(model, args):
            return plan_trainer(
                workload,
                global_batch_size,
                device=device,
                gpus=world,
                precision=fixed_precision,
                checkpointing=True if checkpointing else None,
                margin=margin,
            )

    plan = decided_on_main(decide)  # under torchrun: rank 0 plans, every rank gets its plan (or its error)
    return dataclasses.replace(args, **training_argument_fields(plan)), plan


def training_arguments_planner(path: str | Path) -> Callable[..., Any]:
    """A function like ``batchfit.plan`` that plans for the ``Trainer`` and writes the fields to set to ``path``
    as JSON (``TrainingArguments(**json.load(f), output_dir=...)``); the command line's ``--hf-args``."""

    def planner(workload: Workload, global_batch_size: int, **kwargs: Any) -> Any:
        if not isinstance(workload.checkpoint_blocks, tuple) or not workload.checkpoint_blocks:
            workload = _with_layers(workload)
        plan = plan_trainer(workload, global_batch_size, **kwargs)
        fields = training_argument_fields(plan)
        Path(path).expanduser().write_text(json.dumps(fields, indent=2) + "\n")
        return plan

    return planner


def _with_layers(workload: Workload) -> Workload:
    """``workload`` whose ``checkpoint_blocks`` are its model's checkpointed layers (found on fake tensors)."""
    return dataclasses.replace(workload, checkpoint_blocks=checkpoint_layers(fake_model(workload)))


def _checkpointing_words(plan: Any) -> str:
    if not plan.checkpointing:
        return ""
    if getattr(plan, "checkpointed_blocks", None) is None:
        return ", activation checkpointing"
    return ", activation checkpointing of " + checkpointing_words(plan, "layer")


# -- while it trains -------------------------------------------------------------------------------
class BatchfitCallback(TrainerCallback):
    """Prints the plan when training starts, and per logging step the measured peak memory beside the estimate.

    Args:
        plan: the ``Plan`` from ``plan_training_arguments``.
        cuda: the seam for ``torch.cuda``'s memory functions (tests pass a fake); the peaks are read only
            when it reports a GPU.
        nvml: the seam for ``pynvml`` (None: imported if installed).
        write: where lines go (``print`` by default); only the main process writes.

    The readings (``batchfit.runtime.monitor.StepMemory``) are kept in ``history`` on every process, and added to
    the logs as ``peak_reserved_gib`` and ``estimated_reserved_gib`` for the loggers after this callback.
    """

    def __init__(self, plan: Any, *, cuda: Any = None, nvml: Any = None, write: Callable[[str], Any] = print) -> None:
        self.plan = plan
        self.monitor = MemoryMonitor(plan.estimate, cuda=cuda if cuda is not None else torch.cuda, nvml=nvml)
        self.write = write
        self.history: list[Any] = []

    def _gpu(self) -> bool:
        return bool(self.monitor.cuda.is_available())

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        p = self.plan
        blocks = getattr(p, "checkpointed_blocks", None)
        model = kwargs.get("model")
        if blocks is not None and model is not None:  # the Trainer switched every layer on: the plan needs fewer
            keep_first_blocks(model, checkpoint_layers(model), blocks, getattr(p, "selective_rest", False))
        world = args.world_size
        ran = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        if state.is_world_process_zero:
            self.write(
                f"batchfit: global batch {p.global_batch_size} = {p.micro_batch_size} per device x "
                f"{p.accumulation_steps} accumulation x {p.gpus} GPUs on {p.device}, {p.precision}"
                f"{_checkpointing_words(p)}; estimated peak "
                f"{format_bytes(p.estimate.peak_reserved_bytes)} reserved, "
                f"{format_bytes(p.estimate.device_total_bytes)} with the CUDA context "
                f"({format_bytes(p.headroom_bytes)} headroom)"
            )
            if ran != p.global_batch_size or world != p.gpus:
                self.write(
                    f"batchfit: warning: these arguments run {args.per_device_train_batch_size} x "
                    f"{args.gradient_accumulation_steps} x {world} = {ran} items per step on {world} processes, not "
                    f"the planned {p.global_batch_size} on {p.gpus}; plan again with the arguments you train with"
                )
        if self._gpu():
            self.monitor.start_step()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self._gpu() or (self.history and self.history[-1].step == state.global_step):
            return  # no GPU, or the end-of-training summary logged at the step already read
        reading = dataclasses.replace(self.monitor.end_step(), step=state.global_step)
        self.history.append(reading)
        if logs is not None:
            logs["peak_reserved_gib"] = round(reading.peak_reserved_bytes / 2**30, 3)
            logs["estimated_reserved_gib"] = round(self.plan.estimate.peak_reserved_bytes / 2**30, 3)
        if state.is_world_process_zero:
            self.write(f"batchfit: {reading.describe()}")
        self.monitor.start_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.close()
