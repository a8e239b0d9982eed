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

import contextlib
import dataclasses
import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..workload import Workload
from ._common import RepeatedItems, equal_plan, one_line, plan_device, require

require("transformers", "transformers", "transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

__all__ = ["BatchfitCallback", "plan_trainer", "plan_training_arguments", "training_argument_fields"]

FRAMEWORK = "the Hugging Face Trainer"


# -- the workload the Trainer runs -----------------------------------------------------------------
def _base(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (for its config, class and forward signature)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def checkpoint_layers(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The layer classes ``activation_checkpointing_enable`` checkpoints: ``GradientCheckpointingLayer``
    subclasses (transformers >= 4.52), else the model's ``_no_split_modules`` (its repeated blocks)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer as layer
    except ImportError:  # transformers < 4.52
        layer = None
    names = set(getattr(_base(model), "_no_split_modules", None) or ())
    found: dict[type, None] = {}
    for module in model.modules():
        if (layer is not None and isinstance(module, layer)) or (layer is None and type(module).__name__ in names):
            found.setdefault(type(module), None)
    return tuple(found)


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether the ``Trainer`` passes ``num_items_in_batch`` to ``model`` (its own test, in ``__init__``)."""
    base = _base(model)
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


class TrainerLoss:
    """``(model, batch) -> loss`` as ``Trainer.compute_loss`` takes it: the model's own loss, given
    ``num_items_in_batch`` (the count of labels that are not -100) when the model accepts loss kwargs.

    The count only scales the loss (transformers versions differ in whether a causal LM's first label is
    counted); what it changes in memory is one scalar, which is what matters here.
    """

    def __init__(self, pass_num_items: bool) -> None:
        self.pass_num_items = pass_num_items

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        inputs = dict(batch)
        labels = inputs.get("labels")
        if self.pass_num_items and isinstance(labels, torch.Tensor):
            inputs["num_items_in_batch"] = labels.ne(-100).sum()
        out = model(**inputs)
        loss = out.get("loss") if isinstance(out, Mapping) else (out[0] if isinstance(out, (tuple, list)) else None)
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(
                f"{type(model).__name__} returned no loss for a batch with keys {sorted(batch)}; the Trainer trains on "
                "the model's own loss, so the sample needs labels (or pass a model that computes its loss)"
            )
        return loss


class TrainerOptimizer:
    """``params -> Optimizer`` as ``Trainer.create_optimizer`` builds it: the class and arguments of
    ``args.optim``, with weight decay on the parameters it names and none on biases and norms."""

    def __init__(self, cls: type, kwargs: dict[str, Any], decay: list[bool], weight_decay: float) -> None:
        self.cls, self.kwargs, self.decay, self.weight_decay = cls, kwargs, decay, weight_decay

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        params = list(params)
        decay = self.decay if len(self.decay) == len(params) else [True] * len(params)
        groups = [
            {"params": [p for p, d in zip(params, decay) if d], "weight_decay": self.weight_decay},
            {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0},
        ]
        return self.cls([g for g in groups if g["params"]], **self.kwargs)


def trainer_optimizer(model: nn.Module, args: TrainingArguments) -> TrainerOptimizer:
    """The optimizer ``args.optim`` names, through the ``Trainer``'s own lookup.

    Raises:
        ConfigError: an optimizer the ``Trainer`` cannot build here (unknown, or its package is missing).
    """
    try:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    except Exception as e:  # noqa: BLE001 - ValueError (unknown), ImportError (bitsandbytes, ...): one line
        raise ConfigError(f"the Trainer cannot build optimizer {_optim_name(args)!r}: {one_line(e)}") from e
    kwargs = {k: v for k, v in kwargs.items() if k not in ("params", "model", "optimizer_dict")}
    try:  # an instance method that reads no instance state; called unbound so no Trainer is built
        names = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - older or patched transformers: one group, as before the split
        names = {n for n, _ in model.named_parameters()}
    decay = [n in names for n, p in model.named_parameters() if p.requires_grad]
    return TrainerOptimizer(cls, dict(kwargs), decay, float(args.weight_decay))


def _signature_columns(model: nn.Module, args: TrainingArguments) -> set[str] | None:
    """Keys the ``Trainer`` keeps (``remove_unused_columns``): the forward's parameters and the labels."""
    if not args.remove_unused_columns:
        return None
    from transformers.utils import find_labels

    base = _base(model)
    labels = find_labels(type(base)) if args.label_names is None else args.label_names  # the Trainer's default
    return set(inspect.signature(base.forward).parameters) | {"label", "label_ids", *labels}


def sample_batch(model: nn.Module, args: TrainingArguments, sample: Mapping[str, Any]) -> dict[str, Any]:
    """One collated batch from ``sample``: a dataset example (collated alone by ``default_data_collator``,
    as the ``Trainer`` does without a tokenizer) or an already collated batch.

    A batch is recognised by every value being a tensor with a leading dimension and the model's main
    input (``input_ids``, ``pixel_values``, ...) having at least two; anything else is one example.

    Raises:
        ConfigError: the sample is not a mapping, or cannot be collated.
    """
    if not isinstance(sample, Mapping):
        raise ConfigError(
            f"sample must be a dict (one dataset example, or a collated batch), got {type(sample).__name__}"
        )
    main = sample.get(getattr(_base(model), "main_input_name", "input_ids"))
    collated = (
        isinstance(main, torch.Tensor)
        and main.dim() >= 2
        and all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in sample.values())
    )
    if collated:
        batch = dict(sample)
    else:
        from transformers import default_data_collator

        try:
            batch = default_data_collator([dict(sample)])
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"cannot collate the sample into a batch ({one_line(e)}); pass a collated batch") from e
    keep = _signature_columns(model, args)
    if keep is not None:
        batch = {k: v for k, v in batch.items() if k in keep}
    return batch


def _synthetic_batch(model: nn.Module, seq_len: int | None) -> tuple[Callable[[int], Any], int | None, str]:
    """``(batch_fn, tokens_per_item, what)``: the batch the model's task head trains on, from its config."""
    from ..sources.hf_tasks import (
        choose_task,
        default_length,
        item_shape,
        make_batch_fn,
        max_positions,
        task_of_architecture,
    )

    base = _base(model)
    config = getattr(base, "config", None)
    if config is None:
        raise ConfigError(
            f"{type(base).__name__} has no transformers config to make a batch from; pass sample= (one example of "
            "the training data)"
        )
    task = task_of_architecture(type(base).__name__) or choose_task(config, None)
    length = default_length(config, task) if seq_len is None else int(seq_len)
    limit = max_positions(config)
    if length < 1 or (task.modality in ("text", "seq2seq") and limit and length > limit):
        raise ConfigError(f"seq_len must be between 1 and the model's {limit or 'maximum'} positions, got {length}")
    batch_fn, tokens = make_batch_fn(config, task, length)
    return batch_fn, tokens, f"{task.name}, {item_shape(config, task, length)}"


def trainer_workload(
    model: nn.Module, args: TrainingArguments, *, seq_len: int | None = None, sample: Mapping[str, Any] | None = None
) -> Workload:
    """The ``Workload`` of one ``Trainer`` step of ``model`` under ``args``.

    Raises:
        ConfigError: not an ``nn.Module``, both or neither usable source of shapes, an optimizer the
            ``Trainer`` cannot build.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the Trainer trains a torch nn.Module (a transformers model); got {type(model).__name__}")
    if sample is not None and seq_len is not None:
        raise ConfigError("give sample= (its shapes are used) or seq_len= (a synthetic batch), not both")
    if sample is not None:
        batch: Callable[[int], Any] = RepeatedItems(sample_batch(model, args, sample))
        tokens, what = None, "from the sample"
    else:
        batch, tokens, what = _synthetic_batch(model, seq_len)
    return Workload(
        model=model,
        batch=batch,
        loss=TrainerLoss(accepts_loss_kwargs(model)),
        optimizer=trainer_optimizer(model, args),
        name=f"{type(_base(model)).__name__} ({what}, optim={_optim_name(args)})",
        tokens_per_item=tokens,
        checkpoint_blocks=checkpoint_layers(model),
    )


@contextlib.contextmanager
def trainer_config(model: nn.Module, args: TrainingArguments) -> Iterator[None]:
    """The model's config as the ``Trainer`` sets it when built, for as long as the step is traced.

    transformers >= 5's ``Trainer.__init__`` sets ``model.config.use_cache = args.use_cache`` (False by
    default): a model left with ``use_cache=True`` would otherwise keep every layer's keys and values in a
    cache through the training step, which the ``Trainer`` never does. Restored afterwards.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(args, "use_cache"):
        yield
        return
    had, old = hasattr(config, "use_cache"), getattr(config, "use_cache", None)
    config.use_cache = args.use_cache
    try:
        yield
    finally:
        if had:
            config.use_cache = old
        else:
            del config.use_cache


def _optim_name(args: TrainingArguments) -> str:
    return str(getattr(args.optim, "value", args.optim))


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

    from ..train.distributed import decided_on_main

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
    from ..memory.trace import fake_model

    return dataclasses.replace(workload, checkpoint_blocks=checkpoint_layers(fake_model(workload)))


# -- while it trains -------------------------------------------------------------------------------
class BatchfitCallback(TrainerCallback):
    """Prints the plan when training starts, and per logging step the measured peak memory beside the estimate.

    Args:
        plan: the ``Plan`` from ``plan_training_arguments``.
        cuda: the seam for ``torch.cuda``'s memory functions (tests pass a fake); the peaks are read only
            when it reports a GPU.
        nvml: the seam for ``pynvml`` (None: imported if installed).
        write: where lines go (``print`` by default); only the main process writes.

    The readings (``batchfit.monitor.StepMemory``) are kept in ``history`` on every process, and added to
    the logs as ``peak_reserved_gib`` and ``estimated_reserved_gib`` for the loggers after this callback.
    """

    def __init__(self, plan: Any, *, cuda: Any = None, nvml: Any = None, write: Callable[[str], Any] = print) -> None:
        from ..monitor import MemoryMonitor

        self.plan = plan
        self.monitor = MemoryMonitor(plan.estimate, cuda=cuda if cuda is not None else torch.cuda, nvml=nvml)
        self.write = write
        self.history: list[Any] = []

    def _gpu(self) -> bool:
        return bool(self.monitor.cuda.is_available())

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        p = self.plan
        world = args.world_size
        ran = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        if state.is_world_process_zero:
            from ..units import format_bytes

            self.write(
                f"batchfit: global batch {p.global_batch_size} = {p.micro_batch_size} per device x "
                f"{p.accumulation_steps} accumulation x {p.gpus} GPUs on {p.device}, {p.precision}"
                f"{', activation checkpointing' if p.checkpointing else ''}; estimated peak "
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
