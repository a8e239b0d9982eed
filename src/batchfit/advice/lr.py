"""The learning rate that goes with a batch size: linear or square-root scaling, and a linear warm-up.

A larger global batch averages away gradient noise, so each step can move further. How much further
depends on the optimizer:

* SGD (with or without momentum): scale the learning rate **linearly** with the batch, and warm it up
  over the first steps, when the loss surface changes fastest (Goyal et al. 2017, "Accurate, Large
  Minibatch SGD", sections 2.1-2.2: it holds up to 8k images for ResNet-50 on ImageNet, not beyond).
* Adam-type optimizers (Adam, AdamW, their variants, RMSprop, Adafactor, LAMB): scale by the
  **square root** of the batch ratio. Their update is divided by a running gradient scale, and the
  stochastic differential equation they approximate stays the same when the learning rate grows
  like ``sqrt(B)`` (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
  Algorithms", the square-root scaling rule, which also adjusts Adam's betas and epsilon: only the
  learning rate is scaled here; You et al. 2019 use the square root for LAMB).

Both rules hold only below the critical batch size (McCandlish et al. 2018): past it a larger batch
buys few fewer steps, and no learning rate recovers them. ``batchfit.advice.noise_scale`` measures it.

Example:
    >>> from batchfit.advice.lr import scale_lr
    >>> scale_lr(0.1, 256, 1024, rule="linear")
    0.4
    >>> scale_lr(1e-3, 256, 1024, rule="auto", optimizer="adamw")
    0.002
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..batching import check_batch_size
from ..errors import ConfigError

LINEAR = "linear"
SQRT = "sqrt"
AUTO = "auto"
RULES = (LINEAR, SQRT, AUTO)

# Lower-cased class names (or fragments of them) that get the square-root rule under ``rule="auto"``.
# Any name containing "adam" counts (Adam, AdamW, NAdam, RAdam, Adamax, SparseAdam, bitsandbytes'
# AdamW8bit, ...). RMSprop and Adafactor normalise the update the same way; LAMB is Adam with a
# layer-wise trust ratio and was scaled by the square root in its paper. Everything else (SGD, LARS,
# Adagrad, Lion, unknown optimizers) gets the linear rule.
_SQRT_FRAGMENTS = ("adam", "rmsprop", "adafactor", "lamb")


def _optimizer_name(optimizer: Any) -> str:
    """The class name of an Optimizer instance, an Optimizer class, a ``partial`` of one, a factory by name
    (``optimizer_factory("lion_8bit")``, a workload's ``optimizer``), or a name."""
    if isinstance(optimizer, str):
        return optimizer
    if isinstance(optimizer, functools.partial):
        return _optimizer_name(optimizer.func)
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    if isinstance(optimizer, type):
        return optimizer.__name__
    named = getattr(optimizer, "name", None)
    if callable(optimizer) and isinstance(named, str) and named:  # a factory by name (sources.optim, args.optim)
        return named
    raise ConfigError(
        f"optimizer must be an Optimizer, an Optimizer class or a name like 'adamw', got {type(optimizer).__name__}"
    )


def is_adam_type(optimizer: Any) -> bool:
    """True when ``optimizer`` (instance, class, ``partial`` or name) takes the square-root rule.

    A class also counts when one of its base classes is Adam-type (a subclass of ``torch.optim.AdamW``).
    """
    if isinstance(optimizer, functools.partial):
        optimizer = optimizer.func
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer = type(optimizer)
    names = [c.__name__ for c in optimizer.__mro__] if isinstance(optimizer, type) else [_optimizer_name(optimizer)]
    return any(fragment in name.lower() for name in names for fragment in _SQRT_FRAGMENTS)


def resolve_rule(rule: str, optimizer: Any = None) -> str:
    """``"linear"`` or ``"sqrt"``: ``rule`` itself, or for ``"auto"`` the rule of ``optimizer``'s family.

    Raises:
        ConfigError: an unknown rule, or ``"auto"`` without an optimizer to decide by.
    """
    if rule not in RULES:
        raise ConfigError(f"unknown learning-rate rule {rule!r}; use 'linear' (SGD), 'sqrt' (Adam-type) or 'auto'")
    if rule != AUTO:
        return rule
    if optimizer is None:
        raise ConfigError(
            "rule='auto' picks 'sqrt' for Adam-type optimizers and 'linear' otherwise, so it needs the optimizer: "
            "pass optimizer= (an Optimizer, its class, or a name like 'adamw' or 'sgd'), or rule='linear' or 'sqrt'"
        )
    return SQRT if is_adam_type(optimizer) else LINEAR


def _check(base_lr: Any, base_batch_size: Any, new_batch_size: Any) -> None:
    if isinstance(base_lr, bool) or not isinstance(base_lr, (int, float)) or not 0 < base_lr < math.inf:
        raise ConfigError(f"base_lr must be a positive number, got {base_lr!r}; e.g. 3e-4")
    check_batch_size(base_batch_size, "base_batch_size")
    check_batch_size(new_batch_size, "new_batch_size")


def scale_lr(
    base_lr: float,
    base_batch_size: int,
    new_batch_size: int,
    rule: str = AUTO,
    *,
    optimizer: Any = None,
) -> float:
    """The learning rate for ``new_batch_size`` given one that worked at ``base_batch_size``.

    ``linear``: ``base_lr * new / base``; ``sqrt``: ``base_lr * sqrt(new / base)``; ``auto``: ``sqrt``
    for Adam-type optimizers and ``linear`` otherwise (see the module docstring for the sources).

    Args:
        base_lr: a learning rate known to work at ``base_batch_size``.
        base_batch_size: the global batch ``base_lr`` was tuned at.
        new_batch_size: the global batch to train at.
        rule: ``"linear"``, ``"sqrt"`` or ``"auto"``.
        optimizer: for ``rule="auto"``: an Optimizer, an Optimizer class, a ``functools.partial`` of
            one, or a class name such as ``"adamw"`` or ``"sgd"``.

    Returns:
        The scaled learning rate (a float).

    Raises:
        ConfigError: a non-positive learning rate or batch size, an unknown rule, or ``rule="auto"``
            without an optimizer.

    Example:
        >>> scale_lr(0.1, 256, 8192, rule="linear")  # Goyal et al.: ResNet-50 at 8k images
        3.2
    """
    _check(base_lr, base_batch_size, new_batch_size)
    ratio = new_batch_size / base_batch_size
    factor = ratio if resolve_rule(rule, optimizer) == LINEAR else math.sqrt(ratio)
    return float(base_lr * factor)


@dataclass(frozen=True)
class LrScaling:
    """A scaled learning rate and how it was obtained, for plans and reports."""

    base_lr: float
    base_batch_size: int
    global_batch_size: int
    rule: str
    """The rule applied: ``"linear"`` or ``"sqrt"`` (``"auto"`` resolved)."""
    optimizer: str | None
    """The optimizer's class name, when one was given."""
    lr: float
    """The scaled learning rate."""

    def describe(self) -> str:
        """One line: what was scaled, by which rule and why, and what to set."""
        why = "Adam-type optimizer" if self.rule == SQRT else "SGD-type optimizer"
        who = f"{self.optimizer}, " if self.optimizer else ""
        factor = self.lr / self.base_lr
        return (
            f"lr {self.lr:.4g} for a global batch of {self.global_batch_size} ({self.rule} rule, {who}{why}: "
            f"x{factor:.3g} from lr {self.base_lr:.4g} at batch {self.base_batch_size}); warm it up over the first "
            "steps (batchfit.advice.lr.warmup_schedule)"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        return dict(self.__dict__)


def lr_scaling(
    base_lr: float,
    base_batch_size: int,
    global_batch_size: int,
    rule: str = AUTO,
    *,
    optimizer: Any = None,
) -> LrScaling:
    """``scale_lr`` with its inputs and the resolved rule kept, for a plan or a report.

    Args:
        optimizer: as for ``scale_lr``; a ``Workload``'s optimizer factory (a ``partial`` of an
            Optimizer class, or any function returning an Optimizer) is accepted too.

    Raises:
        ConfigError: as ``scale_lr``.
    """
    if optimizer is not None and callable(optimizer) and not isinstance(optimizer, (type, functools.partial)):
        optimizer = optimizer_class_of(optimizer)
    lr = scale_lr(base_lr, base_batch_size, global_batch_size, rule, optimizer=optimizer)
    return LrScaling(
        base_lr=float(base_lr),
        base_batch_size=base_batch_size,
        global_batch_size=global_batch_size,
        rule=resolve_rule(rule, optimizer),
        optimizer=None if optimizer is None else _optimizer_name(optimizer),
        lr=lr,
    )


def optimizer_class_of(factory: Callable[..., torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The Optimizer class a factory ``params -> Optimizer`` builds, found by building one on a dummy parameter.

    Raises:
        ConfigError: the factory does not return a ``torch.optim.Optimizer``.
    """
    if isinstance(factory, functools.partial) and isinstance(factory.func, type):
        return factory.func
    dummy = torch.nn.Parameter(torch.zeros(1))  # 4 bytes: cheaper than reasoning about the factory
    built = factory([dummy])
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer")
    return type(built)


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    *,
    start_factor: float | None = None,
    after: Callable[[int], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that raises the learning rate linearly over ``warmup_steps`` optimizer steps.

    Set the optimizer's learning rate to the scaled one first; the schedule multiplies it by a factor
    that rises linearly from ``start_factor`` at step 0 to 1 at step ``warmup_steps`` and stays at 1
    (or follows ``after``). Goyal et al. 2017 (section 2.2, "gradual warmup") start from the small
    batch's learning rate: ``start_factor = base_lr / scaled_lr``. Step it once per optimizer step
    (``batchfit.Trainer`` does, when passed as ``scheduler=``).

    Args:
        optimizer: the optimizer, its ``lr`` already the scaled learning rate.
        warmup_steps: optimizer steps to reach the full learning rate (0: no warm-up).
        start_factor: the factor at step 0, in ``(0, 1]``; default ``1 / warmup_steps`` (the first step
            already moves, unlike a ramp from 0, which wastes it).
        after: optional multiplier once warm-up is over, called with the steps since it ended
            (``lambda s: 0.5 * (1 + math.cos(math.pi * s / decay_steps))`` for a cosine decay).

    Returns:
        A ``torch.optim.lr_scheduler.LambdaLR``.

    Raises:
        ConfigError: negative ``warmup_steps`` or ``start_factor`` outside ``(0, 1]``.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
        >>> sched = warmup_schedule(opt, 4, start_factor=0.25)
        >>> lrs = []
        >>> for _ in range(6):
        ...     lrs.append(round(opt.param_groups[0]["lr"], 3))
        ...     opt.step(); sched.step()
        >>> lrs
        [0.1, 0.175, 0.25, 0.325, 0.4, 0.4]
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be a whole number >= 0, got {warmup_steps!r}")
    start = (1.0 / warmup_steps if warmup_steps else 1.0) if start_factor is None else float(start_factor)
    if not 0.0 < start <= 1.0:
        raise ConfigError(f"start_factor must be in (0, 1], got {start_factor!r}; e.g. base_lr / scaled_lr")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return start + (1.0 - start) * step / warmup_steps
        return 1.0 if after is None else float(after(step - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
