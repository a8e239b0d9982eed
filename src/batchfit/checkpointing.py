"""Activation checkpointing of whole blocks, for any model: keep block inputs, recompute inside.

Used the same way by the estimator (on fake tensors) and the trainer (on real ones), so that what is
estimated is what runs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import ConfigError

Checkpointing = bool | str | Sequence[type[nn.Module]] | None


def checkpoint_classes(checkpointing: Checkpointing, blocks: tuple[type[nn.Module], ...]) -> tuple[type, ...]:
    """The module classes to checkpoint.

    Args:
        checkpointing: None/False (none), True or ``"blocks"`` (the workload's blocks), or a list of
            module classes (for user models).
        blocks: the workload's ``checkpoint_blocks``.

    Raises:
        ConfigError: blocks were asked for but the workload names none, or the value is not understood.
    """
    if checkpointing is None or checkpointing is False:
        return ()
    if checkpointing is True or checkpointing == "blocks":
        if not blocks:
            raise ConfigError(
                "this workload names no blocks to checkpoint; pass checkpointing=[YourBlockClass] "
                "or set Workload(checkpoint_blocks=(YourBlockClass,))"
            )
        return tuple(blocks)
    if isinstance(checkpointing, str):
        raise ConfigError(f"unknown checkpointing {checkpointing!r}; use 'blocks' or a list of module classes")
    classes = tuple(checkpointing)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ConfigError("checkpointing must be 'blocks' or a list of nn.Module classes")
    return classes


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant checkpointing: works with keyword arguments, inputs that do not require grad,
    # and nested autograd hooks (the reentrant variant supports none of these; torch warns likewise).
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(model: nn.Module, classes: tuple[type, ...]) -> int:
    """Wrap the forward of every outermost module of ``classes`` in checkpointing; returns how many.

    A block nested inside another checkpointed block is left alone: the outer recomputation already
    covers it, and checkpointing both would recompute it twice.
    """
    if not classes:
        return 0
    wrapped = 0

    def visit(module: nn.Module) -> None:
        nonlocal wrapped
        for child in module.children():
            if isinstance(child, classes):
                child.forward = functools.partial(_checkpointed_forward, child.forward)  # type: ignore[method-assign]
                wrapped += 1
            else:
                visit(child)

    if isinstance(model, classes):
        model.forward = functools.partial(_checkpointed_forward, model.forward)  # type: ignore[method-assign]
        return 1
    visit(model)
    return wrapped
