"""The step the Hugging Face ``Trainer`` runs, as a ``Workload``: its optimizer, its loss, its batches.

Each piece mirrors the ``Trainer``'s own code (transformers 4.40 to 5.x), so that what is traced is what it
trains: ``Trainer.get_optimizer_cls_and_kwargs`` and the weight-decay groups of ``create_optimizer``,
``compute_loss`` with ``num_items_in_batch``, the columns ``remove_unused_columns`` keeps,
``default_data_collator`` for a dataset example, and ``model.config.use_cache = args.use_cache``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..activation_checkpointing import UseReentrant
from ..activation_checkpointing import model_layers as checkpoint_layers
from ..errors import ConfigError
from ..sources.hf_tasks import (
    choose_task,
    default_length,
    item_shape,
    make_batch_fn,
    max_positions,
    task_of_architecture,
)
from ..sources.optim import construct, known_states
from ..third_party import quiet_third_party
from ..workload import Workload
from ._common import RepeatedItems, one_line, require

require("transformers", "transformers", "transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (for its config, class and forward signature)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


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
    ``args.optim``, with weight decay on the parameters it names and none on biases and norms.

    Built as ``--optimizer`` builds the same name (``sources/optim.construct``): without third-party
    chatter, traced as it is or through its stand-in (torchao's, ``memory/kernels/lowbit.py``), paged states
    counted as unified memory on a GPU (``memory/kernels/paged.py``).
    """

    def __init__(
        self, cls: type, kwargs: dict[str, Any], decay: list[bool], weight_decay: float, name: str = ""
    ) -> None:
        self.cls, self.kwargs, self.decay, self.weight_decay = cls, kwargs, decay, weight_decay
        self.name = name
        """The ``args.optim`` it stands for (the analytic estimate reads its states' closed form by it)."""

    @property
    def states(self) -> Any:
        """The closed form of ``args.optim``'s states per tensor (None for a name batchfit does not know: the
        analytic estimate then assumes AdamW's)."""
        return known_states(self.name)

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        params = list(params)
        decay = self.decay if len(self.decay) == len(params) else [True] * len(params)
        groups = [
            {"params": [p for p, d in zip(params, decay) if d], "weight_decay": self.weight_decay},
            {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0},
        ]
        return construct(self.cls, [g for g in groups if g["params"]], **self.kwargs)


def trainer_optimizer(model: nn.Module, args: TrainingArguments) -> TrainerOptimizer:
    """The optimizer ``args.optim`` names, through the ``Trainer``'s own lookup.

    Raises:
        ConfigError: an optimizer the ``Trainer`` cannot build here (unknown, or its package is missing).
    """
    try:
        with quiet_third_party():  # the Trainer imports bitsandbytes or torchao for their names
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    except Exception as e:  # noqa: BLE001 - ValueError (unknown), ImportError (bitsandbytes, ...): one line
        raise ConfigError(f"the Trainer cannot build optimizer {_optim_name(args)!r}: {one_line(e)}") from e
    kwargs = {k: v for k, v in kwargs.items() if k not in ("params", "model", "optimizer_dict")}
    try:  # an instance method that reads no instance state; called unbound so no Trainer is built
        names = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - older or patched transformers: one group, as before the split
        names = {n for n, _ in model.named_parameters()}
    decay = [n in names for n, p in model.named_parameters() if p.requires_grad]
    return TrainerOptimizer(cls, dict(kwargs), decay, float(args.weight_decay), _optim_name(args))


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
        checkpoint_blocks=checkpoint_layers(model) + _reentrant(args),
    )


def _reentrant(args: TrainingArguments) -> tuple[type[nn.Module], ...]:
    """``(UseReentrant,)`` when the arguments ask transformers for reentrant checkpointing
    (``gradient_checkpointing_kwargs={"use_reentrant": True}``); none leaves transformers' own default."""
    kwargs = getattr(args, "activation_checkpointing_kwargs", None)
    kwargs = kwargs or getattr(args, "gradient_checkpointing_kwargs", None)
    return (UseReentrant,) if isinstance(kwargs, Mapping) and kwargs.get("use_reentrant") is True else ()


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
