"""Activation checkpointing of whole blocks, for any model: keep block inputs, recompute inside.

Used the same way by the estimator (on fake tensors) and the trainer (on real ones), so that what is
estimated is what runs. A transformers model is checkpointed the way its own training turns it on
(NOTE [ Checkpointing a transformers model as it checkpoints itself ]); any other module's blocks get
their ``forward`` wrapped in ``torch.utils.checkpoint.checkpoint``. Some of the blocks can be
checkpointed instead of all (NOTE [ Checkpointing some blocks ]).
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import ConfigError

Checkpointing = bool | int | str | Sequence[type[nn.Module]] | Sequence[int] | None


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


# NOTE [ Checkpointing some blocks ]
# Checkpointing every block recomputes the whole forward in backward (about a third more compute per
# step) when often a few blocks' saved activations are all that stands between a batch and the
# memory. ``checkpointing=k`` checkpoints the model's first k blocks, ``checkpointing=[0, 5, 9]`` the
# blocks of those indices: blocks are numbered in the order ``model.modules()`` meets them (the
# outermost module of a checkpointed class, as ``apply_checkpointing`` wraps them: for a decoder,
# layer i is block i). The first k, not k spread over the stack: every block's saved activations are
# alive together at the end of the forward either way, but backward recomputes a block only when it
# reaches it, and it reaches the first blocks last, when the later blocks' activations are freed; a
# recomputed last block would add its activations at the very peak, when backward starts.
#
# The selection travels as a marker class among the checkpointed classes (``Only``, made by
# ``only_blocks``), like ``UseReentrant``: it reaches the trace, the measurement, the trainer and every
# cache key without a parameter of its own. A transformers model is first checkpointed as it does it
# itself, then its unchosen layers' ``gradient_checkpointing`` flags are turned off (the per-layer switch
# of its ``GradientCheckpointingLayer``), which keeps everything else its own switch does (the hook that
# makes the embeddings' output require grad).


class Only(nn.Module):
    """A marker among the checkpointed classes (never built): only the blocks numbered ``blocks`` are checkpointed.

    Made by ``only_blocks``, one class per selection (so a selection is part of every key the classes are);
    its name says the selection, and ``pickle`` finds it by that name in any process (``__getattr__`` below).
    """

    blocks: tuple[int, ...] = ()


_PREFIX = "Only_blocks_"


@functools.cache
def only_blocks(blocks: tuple[int, ...]) -> type[Only]:
    """The ``Only`` marker of the block indices ``blocks`` (sorted, distinct, >= 0)."""
    name = _PREFIX + "_".join(map(str, blocks))
    return type(name, (Only,), {"blocks": tuple(blocks), "__module__": __name__, "__qualname__": name})


def __getattr__(name: str) -> Any:
    """The ``Only`` markers by name (what ``pickle`` looks up), made on first use in this process."""
    if name.startswith(_PREFIX):
        digits = name[len(_PREFIX) :].split("_") if name != _PREFIX else []
        if all(d.isdigit() for d in digits):
            return only_blocks(tuple(int(d) for d in digits))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def selected_blocks(classes: tuple[type, ...]) -> tuple[int, ...] | None:
    """The block indices an ``Only`` marker among ``classes`` selects; None: every block."""
    for c in classes:
        if _is_selection(c):
            return c.blocks  # type: ignore[attr-defined]
    return None


def without_selection(classes: tuple[type, ...]) -> tuple[type, ...]:
    """``classes`` without their ``Only`` marker: every block of theirs checkpointed as the others say."""
    return tuple(c for c in classes if not _is_selection(c))


def _is_selection(c: Any) -> bool:
    return isinstance(c, type) and issubclass(c, Only)


# NOTE [ Selective checkpointing ]
# Between keeping a block's activations and recomputing all of them lies PyTorch's selective activation
# checkpointing (``create_selective_checkpoint_contexts``, torch >= 2.4): inside a checkpointed block an
# op policy says which outputs are saved and which recomputed. ``checkpointing="selective"`` keeps the
# outputs of the matmuls and attention kernels (most of the compute) and recomputes everything else
# (pointwise ops, norms, activations, dropout masks: most of the memory and little compute), the
# policy torchtitan and Megatron's selective recompute follow. It runs non-reentrant (SAC needs it), and a
# transformers model gets the policy through its own switch (``gradient_checkpointing_kwargs``).


class Selective(nn.Module):
    """A marker among the checkpointed classes (never built): checkpoint them selectively (NOTE above)."""


# NOTE [ Some blocks whole, the rest selectively ]
# Checkpointing the first k blocks leaves the other N - k blocks' activations all kept; selective
# checkpointing of every block keeps only their matmul outputs, and recomputes the rest for a few percent
# of a block's forward. Between them: the first k blocks recomputed whole and the rest selectively
# (``checkpointing=(*range(k), "selective")``, on the command line ``K+selective``). Each selective block
# holds less than a block that keeps everything, so fewer blocks need whole recomputation for a micro-batch
# to fit, and a block recomputed selectively costs far less than one recomputed whole: the plan weighs both
# (``planning/partial.py``). The selection travels as the ``Only`` marker of the whole blocks with
# ``SelectiveRest`` beside it.


class SelectiveRest(nn.Module):
    """A marker beside an ``Only`` marker (never built): the blocks it leaves out are checkpointed selectively
    (NOTE [ Some blocks whole, the rest selectively ])."""


SELECTIVE = "selective"

_MARKERS = (UseReentrant, NonReentrant, Selective, SelectiveRest)


def _is_marker(c: type) -> bool:
    return c in _MARKERS or _is_selection(c)


def with_reentrant(blocks: tuple[type[nn.Module], ...], reentrant: bool) -> tuple[type[nn.Module], ...]:
    """``blocks`` checkpointed with ``use_reentrant`` asked for: its marker in place of any other."""
    kept = (b for b in blocks if b not in (UseReentrant, NonReentrant))
    return (*kept, UseReentrant if reentrant else NonReentrant)


def checkpoint_classes(checkpointing: Checkpointing, blocks: tuple[type[nn.Module], ...]) -> tuple[type, ...]:
    """The module classes to checkpoint (with ``UseReentrant`` among them for reentrant checkpointing).

    Args:
        checkpointing: None/False (none), True or ``"blocks"`` (the workload's blocks, checkpointed as
            the workload's training does), ``"reentrant"`` (the same blocks with ``use_reentrant=True``),
            ``"selective"`` (the same blocks, their matmul outputs kept: NOTE [ Selective checkpointing ]),
            a list of module classes (for user models), a number k (the first k of the workload's blocks),
            a list of block indices (those blocks: NOTE [ Checkpointing some blocks ]), or such a list
            followed by ``"selective"`` (the other blocks selectively: NOTE [ Some blocks whole, the rest
            selectively ]).
        blocks: the workload's ``checkpoint_blocks``.

    Raises:
        ConfigError: blocks were asked for but the workload names none, or the value is not understood.
    """
    checkpointing = checked_checkpointing(checkpointing)
    if checkpointing is None:
        return ()
    if isinstance(checkpointing, tuple) and checkpointing and checkpointing[-1] == SELECTIVE:
        whole = checkpointing[:-1]
        return (*checkpoint_classes("blocks", blocks), only_blocks(whole), SelectiveRest)  # type: ignore[arg-type]
    if isinstance(checkpointing, tuple) and checkpointing and isinstance(checkpointing[0], int):
        return (*checkpoint_classes("blocks", blocks), only_blocks(checkpointing))
    if checkpointing == "selective":
        return (*checkpoint_classes("blocks", blocks), Selective)
    if checkpointing in ("blocks", "reentrant"):
        if not [b for b in blocks if not _is_marker(b)]:
            raise ConfigError(
                "this workload names no blocks to checkpoint; pass checkpointing=[YourBlockClass] "
                "or set Workload(checkpoint_blocks=(YourBlockClass,))"
            )
        if checkpointing == "reentrant":
            return with_reentrant(tuple(blocks), True)
        return tuple(blocks)
    return checkpointing  # type: ignore[return-value]


_WHOLE_AND_SELECTIVE = re.compile(r"^(\d+(?:,\d+)*)\+selective$")


def checked_checkpointing(value: Any, *, auto: bool = False) -> Checkpointing:
    """``value`` in one spelling per meaning (False and 0: None, True: ``"blocks"``, a list: a tuple, a number
    k: the indices of the first k blocks; blocks whole and the rest selectively: their indices then
    ``"selective"``, from ``"K+selective"`` (the first K), ``"i,j+selective"`` or ``(i, j, "selective")``;
    with no block whole: ``"selective"``), checked for its shape (whether a workload has the blocks is
    checked against it, by ``checkpoint_classes``); ``auto`` also allows ``"auto"`` (a plan's choice).

    Raises:
        ConfigError: the value is not understood.
    """
    if value is None or value is False:
        return None
    if value is True:
        return "blocks"
    if isinstance(value, str):
        mixed = _WHOLE_AND_SELECTIVE.match(value.strip())
        if mixed:
            numbers = tuple(int(n) for n in mixed.group(1).split(","))
            return _with_selective_rest(numbers[0] if len(numbers) == 1 else numbers)
        if value not in ("blocks", "reentrant", SELECTIVE, *(("auto",) if auto else ())):
            raise ConfigError(
                f"unknown checkpointing {value!r}; use 'blocks', 'reentrant', 'selective', a number of blocks, a list "
                "of block indices, 'K+selective' (the first K blocks whole, the rest selectively) or a list of "
                "module classes"
            )
        return value
    if isinstance(value, (tuple, list)) and len(value) > 1 and value[-1] == SELECTIVE:
        return _with_selective_rest(tuple(value[:-1]))  # indices, as a plain list of them is
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"checkpointing={value} blocks: pass a number >= 0 (the first k blocks are checkpointed)")
        return tuple(range(value)) or None
    try:
        items = tuple(value)
    except TypeError:
        items = ()
    if items and all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        if min(items) < 0:
            raise ConfigError(f"checkpointing={list(items)}: block indices count from 0 (the first block)")
        return tuple(sorted(set(items)))
    if not items or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in items):
        raise ConfigError(
            "checkpointing must be 'blocks', 'reentrant', 'selective', a number of blocks, a list of block indices "
            "(then 'selective' for the other blocks selectively) or a list of nn.Module classes"
        )
    return items


def _with_selective_rest(whole: Any) -> Checkpointing:
    """The blocks ``whole`` (a number or indices) checkpointed whole and the others selectively, as one value."""
    checked = checked_checkpointing(whole)
    if checked is None:
        return SELECTIVE  # no block whole: every block selectively
    if not (isinstance(checked, tuple) and all(isinstance(i, int) for i in checked)):
        raise ConfigError(f"checkpointing={whole!r} + selective: name the blocks recomputed whole by indices")
    return (*checked, SELECTIVE)  # type: ignore[return-value]


def _non_reentrant(context: Any) -> Any:
    """A transformers layer's checkpoint function (its ``_gradient_checkpointing_func``), non-reentrant, with the
    selective policy's ``context`` (None: the whole block recomputed)."""
    kwargs = {} if context is None else {"context_fn": context}
    return functools.partial(checkpoint, use_reentrant=False, **kwargs)


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
    model: nn.Module, classes: tuple[type, ...], kwargs: dict[str, Any] | None, per_layer: bool
) -> tuple[set[int], set[int]]:
    """Turn checkpointing on through each outermost transformers model whose layers are all in ``classes``;
    the ids of the modules it covers (left alone by the block wrapper) and of the layers it checkpoints.
    ``per_layer``: only models whose layers each have their own switch (``GradientCheckpointingLayer``)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return set(), set()
    switch: Any = None
    with contextlib.suppress(ImportError):  # transformers < 4.52: one switch per model
        from transformers.modeling_layers import GradientCheckpointingLayer as switch
    covered: set[int] = set()
    on: set[int] = set()
    for module in model.modules():
        if id(module) in covered or not isinstance(module, PreTrainedModel):
            continue
        if not getattr(module, "supports_gradient_checkpointing", False):
            continue
        layers = model_layers(module)
        if not layers or not set(layers) <= set(classes):
            continue
        found = [m for m in module.modules() if isinstance(m, layers)]
        if per_layer and (switch is None or not all(isinstance(m, switch) for m in found)):
            continue  # its blocks are wrapped below, one by one
        enable = getattr(module, "activation_checkpointing_enable", None) or module.gradient_checkpointing_enable
        try:
            _quietly(enable, kwargs)
        except (ValueError, TypeError, NotImplementedError):
            continue  # a model that refuses: its blocks are wrapped below instead
        covered.update(id(m) for m in module.modules())
        on.update(id(m) for m in found)
    return covered, on


def selective_context() -> Any:
    """The ``context_fn`` of selective checkpointing (NOTE [ Selective checkpointing ]).

    Raises:
        ConfigError: a torch without selective checkpointing (before 2.4).
    """
    try:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    except ImportError as exc:
        raise ConfigError("checkpointing='selective' needs torch >= 2.4; use checkpointing='blocks'") from exc
    import torch

    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward")  # fmt: skip
    saved = {getattr(aten, n).default for n in names if hasattr(aten, n) and hasattr(getattr(aten, n), "default")}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _checkpointed_forward(forward: Any, reentrant: bool, context: Any, *args: Any, **kwargs: Any) -> Any:
    if context is not None:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
    if reentrant:  # the reentrant variant takes no keyword arguments: bind them, as transformers does
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=True)
    # Non-reentrant checkpointing: works with keyword arguments, inputs that do not require grad,
    # and nested autograd hooks (the reentrant variant supports none of these; torch warns likewise).
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(model: nn.Module, classes: tuple[type, ...], whole: dict[int, bool] | None = None) -> int:
    """Checkpoint every outermost module of ``classes`` (or the ones an ``Only`` marker among them selects:
    NOTE [ Checkpointing some blocks ]; the others selectively beside ``SelectiveRest``: NOTE [ Some blocks
    whole, the rest selectively ]); returns how many are checkpointed, whole or selectively. ``whole``, when
    given, gets each block's id and whether the selection checkpoints it whole (depth synthesis cuts a stack
    where its blocks are alike: ``memory/synthesis/stackplan.py``).

    A transformers model whose layers are all among ``classes`` checkpoints itself (NOTE [ Checkpointing
    a transformers model as it checkpoints itself ]). Elsewhere a block nested inside another checkpointed
    block is left alone: the outer recomputation already covers it, and checkpointing both would
    recompute it twice.
    """
    reentrant = UseReentrant in classes
    asked = True if reentrant else (False if NonReentrant in classes else None)
    context = rest = None
    if Selective in classes or SelectiveRest in classes:
        if reentrant:
            raise ConfigError("selective checkpointing runs non-reentrant; drop use_reentrant=True")
        if Selective in classes:
            context = selective_context()
        else:
            rest, asked = selective_context(), False  # one variant for the whole and the selective blocks
    chosen = selected_blocks(classes)
    classes = tuple(c for c in classes if not _is_marker(c))
    if not classes:
        return 0
    kwargs = None if asked is None else {"use_reentrant": asked}  # None: transformers' own default
    if context is not None:
        kwargs = {"use_reentrant": False, "context_fn": context}
    covered, layers = _enable_in_transformers(model, classes, kwargs, per_layer=chosen is not None)
    checkpointed = 0
    blocks = checkpoint_blocks_of(model, classes, covered, layers)
    beyond = sorted(i for i in chosen or () if i >= len(blocks))
    if beyond:  # a block that does not exist: one line, not a step that silently checkpoints less
        has = f"{len(blocks)} blocks to checkpoint (0 to {len(blocks) - 1})" if blocks else "no blocks to checkpoint"
        raise ConfigError(f"checkpointing block{'s' if len(beyond) > 1 else ''} {', '.join(map(str, beyond))}: the "
                          f"model has {has}; pass indices or a number of first blocks within them")  # fmt: skip
    for index, block in enumerate(blocks):
        block_context = context
        if whole is not None:
            whole[id(block)] = chosen is None or index in chosen
        if chosen is not None and index not in chosen:
            if rest is None:
                if id(block) in layers:
                    block.gradient_checkpointing = False  # its model's switch turned it on with the others
                continue
            block_context = rest
            if id(block) in layers:  # the layer's own checkpoint call, with the selective policy
                block._gradient_checkpointing_func = _non_reentrant(rest)
        if id(block) not in layers:
            block.forward = functools.partial(_checkpointed_forward, block.forward, reentrant, block_context)  # type: ignore[method-assign]
        checkpointed += 1
    return checkpointed


def checkpoint_blocks_of(
    model: nn.Module,
    classes: tuple[type, ...],
    covered: AbstractSet[int] = frozenset(),
    layers: AbstractSet[int] = frozenset(),
) -> list[nn.Module]:
    """The blocks checkpointing ``classes`` numbers, in order: each outermost module of ``classes`` (a layer a
    transformers model checkpoints itself, among ``covered``, counts as one; other modules it covers do not)."""
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if id(module) in layers or (id(module) not in covered and isinstance(module, classes)):
            out.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return out


def keep_first_blocks(model: nn.Module, classes: tuple[type, ...], blocks: int, selective: bool = False) -> int:
    """Turn checkpointing off in every block of ``classes`` after the first ``blocks`` that a transformers model
    switched on itself (its layers' ``gradient_checkpointing`` flags: what a ``Trainer`` turns on for every layer
    when a plan needs only the first ``blocks``), or with ``selective`` make those blocks checkpoint selectively
    (NOTE [ Some blocks whole, the rest selectively ]); returns how many stay checkpointed whole."""
    kept = 0
    rest = selective_context() if selective else None
    for index, block in enumerate(checkpoint_blocks_of(model, tuple(c for c in classes if not _is_marker(c)))):
        if getattr(block, "gradient_checkpointing", False):
            if rest is not None:  # every layer non-reentrant, as ``apply_checkpointing`` runs this setting
                block._gradient_checkpointing_func = _non_reentrant(None if index < blocks else rest)
            if index < blocks:
                kept += 1
            elif rest is None:
                block.gradient_checkpointing = False
    return kept
