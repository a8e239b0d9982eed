"""Activation checkpointing of whole blocks, for any model: keep block inputs, recompute inside.

Used the same way by the estimator (on fake tensors) and the trainer (on real ones), so that what is
estimated is what runs. A transformers model is checkpointed the way its own training turns it on
(NOTE [ Checkpointing a transformers model as it checkpoints itself ]); any other module's blocks get
their ``forward`` wrapped in ``torch.utils.checkpoint.checkpoint``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import ConfigError

Checkpointing = bool | str | Sequence[type[nn.Module]] | None


class UseReentrant(nn.Module):
    """A marker among the checkpointed classes (never built): checkpoint them with ``use_reentrant=True``.

    Reentrant checkpointing (``torch.utils.checkpoint``'s older variant, transformers' default before
    5.0, and what ``gradient_checkpointing_kwargs={"use_reentrant": True}`` asks for) recomputes a block
    inside a backward of its own and needs its input to require grad, which is why transformers then
    makes the embeddings' output require grad. Carried in the tuple of classes, it reaches every place
    that checkpoints (trace, measurement, trainer) and every cache key without a parameter of its own.
    """


class NonReentrant(nn.Module):
    """A marker like ``UseReentrant``, for ``use_reentrant=False`` asked for explicitly: a transformers model
    is then told so, where without a marker it keeps its own default (True before transformers 5.0)."""


_MARKERS = (UseReentrant, NonReentrant)


def with_reentrant(blocks: tuple[type[nn.Module], ...], reentrant: bool) -> tuple[type[nn.Module], ...]:
    """``blocks`` checkpointed with ``use_reentrant`` asked for: its marker in place of any other."""
    return (*(b for b in blocks if b not in _MARKERS), UseReentrant if reentrant else NonReentrant)


def checkpoint_classes(checkpointing: Checkpointing, blocks: tuple[type[nn.Module], ...]) -> tuple[type, ...]:
    """The module classes to checkpoint (with ``UseReentrant`` among them for reentrant checkpointing).

    Args:
        checkpointing: None/False (none), True or ``"blocks"`` (the workload's blocks, checkpointed as
            the workload's training does), ``"reentrant"`` (the same blocks with ``use_reentrant=True``),
            or a list of module classes (for user models).
        blocks: the workload's ``checkpoint_blocks``.

    Raises:
        ConfigError: blocks were asked for but the workload names none, or the value is not understood.
    """
    checkpointing = checked_checkpointing(checkpointing)
    if checkpointing is None:
        return ()
    if checkpointing in ("blocks", "reentrant"):
        if not [b for b in blocks if b not in _MARKERS]:
            raise ConfigError(
                "this workload names no blocks to checkpoint; pass checkpointing=[YourBlockClass] "
                "or set Workload(checkpoint_blocks=(YourBlockClass,))"
            )
        if checkpointing == "reentrant":
            return with_reentrant(tuple(blocks), True)
        return tuple(blocks)
    return checkpointing  # type: ignore[return-value]


def checked_checkpointing(value: Any, *, auto: bool = False) -> Checkpointing:
    """``value`` in one spelling per meaning (False: None, True: ``"blocks"``, a list: a tuple), checked
    for its shape (whether a workload has the blocks is checked against it, by ``checkpoint_classes``);
    ``auto`` also allows ``"auto"`` (a plan's choice).

    Raises:
        ConfigError: the value is not understood.
    """
    if value is None or value is False:
        return None
    if value is True:
        return "blocks"
    if isinstance(value, str):
        if value not in ("blocks", "reentrant", *(("auto",) if auto else ())):
            raise ConfigError(f"unknown checkpointing {value!r}; use 'blocks', 'reentrant' or a list of module classes")
        return value
    try:
        classes = tuple(value)
    except TypeError:
        classes = ()
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ConfigError("checkpointing must be 'blocks', 'reentrant' or a list of nn.Module classes")
    return classes


def model_layers(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The layer classes a transformers model checkpoints: its ``GradientCheckpointingLayer`` subclasses
    (transformers >= 4.52), else the classes its ``_no_split_modules`` names (its repeated blocks).

    The one rule for every model named by a hub id, a directory or a config, and for the framework
    adapters; a model of none of them (no transformers model inside) has none.
    """
    layer: Any = None
    with contextlib.suppress(ImportError):  # transformers < 4.52, or not installed
        from transformers.modeling_layers import GradientCheckpointingLayer as layer
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    found: dict[type, None] = {}
    for module in model.modules():
        if (layer is not None and isinstance(module, layer)) or (layer is None and type(module).__name__ in names):
            found.setdefault(type(module), None)
    return tuple(found)


# NOTE [ Checkpointing a transformers model as it checkpoints itself ]
# A user training a transformers model turns checkpointing on with the model's own
# `gradient_checkpointing_enable()` (the HF Trainer's `gradient_checkpointing=True`, peft's
# `prepare_model_for_kbit_training`): `_set_gradient_checkpointing` gives every
# `GradientCheckpointingLayer` a `torch.utils.checkpoint` partial with the kwargs (transformers' own
# default `use_reentrant` when none: False from 5.0, True before), and for a text model it calls
# `enable_input_require_grads()`, a forward hook making the embeddings' output require grad
# (transformers/modeling_utils.py, `_activation_checkpointing_enable`). With frozen weights (LoRA,
# QLoRA) that hook is a difference in memory: the first layers' frozen matmuls then save their inputs
# and backward computes a gradient for the embeddings' output, which a block wrapper never does. So a
# transformers model whose checkpointed layers are all asked for is checkpointed by the model itself,
# exactly as training would; other classes (or a model that does not support it) are wrapped here.


def _quietly(call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call`` with transformers' deprecation warnings and logs kept off the terminal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


def _enable_in_transformers(
    model: nn.Module, classes: tuple[type, ...], reentrant: bool | None
) -> tuple[set[int], int]:
    """Turn checkpointing on through each outermost transformers model whose layers are all in ``classes``;
    the ids of the modules it covers (left alone by the block wrapper), and how many layers it checkpoints."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return set(), 0
    covered: set[int] = set()
    layers_on = 0
    for module in model.modules():
        if id(module) in covered or not isinstance(module, PreTrainedModel):
            continue
        if not getattr(module, "supports_gradient_checkpointing", False):
            continue
        layers = model_layers(module)
        if not layers or not set(layers) <= set(classes):
            continue
        enable = getattr(module, "activation_checkpointing_enable", None) or module.gradient_checkpointing_enable
        kwargs = None if reentrant is None else {"use_reentrant": reentrant}  # None: transformers' own default
        try:
            _quietly(enable, kwargs)
        except (ValueError, TypeError, NotImplementedError):
            continue  # a model that refuses: its blocks are wrapped below instead
        covered.update(id(m) for m in module.modules())
        layers_on += sum(isinstance(m, layers) for m in module.modules())
    return covered, layers_on


def _checkpointed_forward(forward: Any, reentrant: bool, *args: Any, **kwargs: Any) -> Any:
    if reentrant:  # the reentrant variant takes no keyword arguments: bind them, as transformers does
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=True)
    # Non-reentrant checkpointing: works with keyword arguments, inputs that do not require grad,
    # and nested autograd hooks (the reentrant variant supports none of these; torch warns likewise).
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(model: nn.Module, classes: tuple[type, ...]) -> int:
    """Checkpoint every outermost module of ``classes``; returns how many are checkpointed.

    A transformers model whose layers are all among ``classes`` checkpoints itself (NOTE [ Checkpointing
    a transformers model as it checkpoints itself ]). Elsewhere a block nested inside another checkpointed
    block is left alone: the outer recomputation already covers it, and checkpointing both would
    recompute it twice.
    """
    reentrant = UseReentrant in classes
    asked = True if reentrant else (False if NonReentrant in classes else None)
    classes = tuple(c for c in classes if c not in _MARKERS)
    if not classes:
        return 0
    covered, wrapped = _enable_in_transformers(model, classes, asked)

    def wrap(module: nn.Module) -> None:
        nonlocal wrapped
        module.forward = functools.partial(_checkpointed_forward, module.forward, reentrant)  # type: ignore[method-assign]
        wrapped += 1

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in covered:
                continue
            if isinstance(child, classes):
                wrap(child)
            else:
                visit(child)

    if id(model) in covered:
        return wrapped
    if isinstance(model, classes):
        wrap(model)
        return 1
    visit(model)
    return wrapped
