"""Optimizers by the names users type: batchfit's own three and the Hugging Face ``optim`` names that
matter for memory (``--optimizer``, a preset's or hub model's ``optimizer=``).

``optimizer_factory(name, lr)`` is the ``params -> Optimizer`` a ``Workload`` takes: picklable, it
builds the real class the name stands for (``names()`` lists them; NOTE [ Optimizer states per tensor,
by name ] says what each keeps). Classes come from ``torch``, ``bitsandbytes`` (the ``qlora`` extra),
``torchao`` (the ``lowbit`` extra) or ``transformers`` (the ``hf`` extra), imported only when a factory
runs and without their import-time chatter; a missing package is one line naming the extra that
installs it.

The classes are the training's own: a traced step runs them on fake tensors as they are, except
where one cannot step there (torchao's, whose states are tensor subclasses updated by a compiled
kernel: see ``memory/kernels/lowbit.py``). Paged optimizers' states live in CUDA unified memory on a GPU
(``memory/kernels/paged.py``); on the CPU they are the non-paged ones, as bitsandbytes makes them there.

Example:
    >>> from batchfit.sources.optim import optimizer_factory
    >>> make = optimizer_factory("paged_adamw_8bit")
    >>> make.name, make.lr
    ('paged_adamw_8bit', 0.001)
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, MissingExtraError, UnknownNameError
from ..third_party import NO_CACHE_HASH, quiet_third_party

StateBytes = Callable[[int, "int | None", int], int]
"""``(numel, rows, element_bytes) -> bytes`` of the states an optimizer keeps for one trainable tensor
(``rows``: its first dimension's length, None for a 0-d tensor): the closed form ``memory/analytic.py``
uses."""


# NOTE [ Optimizer states per tensor, by name ]
# - torch's Adam/AdamW: ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype (+ a 0-d step count);
#   SGD with momentum, Adagrad, RMSprop: one buffer (``torch/optim/*.py``).
# - bitsandbytes (``bitsandbytes/optim/optimizer.py``, ``Optimizer2State.init_state`` /
#   ``Optimizer1State.init_state``): 32-bit states are fp32 whatever the parameter's dtype
#   (``get_state_buffer(p, dtype=torch.float32)``); 8-bit ones are uint8 of the parameter's shape plus
#   an fp32 ``absmax`` per block of 256 values (``blocks = n // 256 + bool(n % 256)``), except for
#   tensors under ``min_8bit_size`` (4096) values, which keep fp32 states. Two 256-entry fp32
#   quantisation maps per optimizer (``fill_qmap``) are shared by every tensor.
# - torchao (``torchao/optim/adam.py``, ``_AdamBase._new_buffer``; ``subclass_8bit.py``,
#   ``subclass_4bit.py``): a tensor of at least 4096 values that the block size divides gets uint8
#   codes (one a value; 4-bit: two values a byte), an fp32 scale per block and its own fp32 map (256
#   entries; 4-bit: 16); other tensors keep ``zeros_like(p)``. The Trainer passes ``block_size=256``
#   to both (``transformers/trainer_optimizer.py``, ``_get_torchao_optimizer``).
# - transformers' Adafactor without ``beta1`` (the Trainer's): a row and a column factor of the
#   second moment for a matrix (``exp_avg_sq_row`` / ``_col``), a full one for a vector, in the
#   gradient's dtype, and the parameter's ``RMS`` as a 0-d fp32 tensor (``transformers/optimization.py``,
#   ``Adafactor.step``).
def _moments(k: int) -> StateBytes:
    return lambda n, rows, elem: k * n * elem


def _fp32(k: int) -> StateBytes:
    return lambda n, rows, elem: k * n * 4


def _bnb_8bit(k: int) -> StateBytes:
    return lambda n, rows, elem: k * (n + 4 * -(-n // 256)) if n >= 4096 else k * n * 4


def _torchao(bits: int, block: int = 256) -> StateBytes:
    codes = {8: lambda n: n, 4: lambda n: n // 2}[bits]
    table = 4 * (1 << bits)

    def states(n: int, rows: int | None, elem: int) -> int:
        if n >= 4096 and n % block == 0:
            return 2 * (codes(n) + 4 * (n // block) + table)
        return 2 * n * elem

    return states


def _adafactor(n: int, rows: int | None, elem: int) -> int:
    rms = 4  # the parameter's root mean square, a 0-d fp32 tensor
    if rows is None or rows in (0, n):  # a vector (or a scalar): the full second moment
        return n * elem + rms
    return (rows + n // rows) * elem + rms


@dataclass(frozen=True)
class OptimizerSpec:
    """What a name builds."""

    target: str
    """``module:Class`` of the optimizer."""
    kwargs: tuple[tuple[str, Any], ...]
    """Arguments besides the parameters and the learning rate (the Trainer's, for an HF name)."""
    summary: str
    """What it is, in one line."""
    states: StateBytes
    """Bytes of states per trainable tensor (NOTE [ Optimizer states per tensor, by name ])."""
    lr: float = 1e-3
    """The learning rate when none is given (memory does not depend on it)."""


_BNB = "bitsandbytes.optim"
_SPECS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("torch.optim:AdamW", (("weight_decay", 0.01),), "torch AdamW", _moments(2)),
    "adam": OptimizerSpec("torch.optim:Adam", (), "torch Adam", _moments(2)),
    "sgd": OptimizerSpec("torch.optim:SGD", (("momentum", 0.9),), "torch SGD, momentum 0.9", _moments(1), 1e-2),
    "adamw_torch": OptimizerSpec("torch.optim:AdamW", (), "torch AdamW (HF)", _moments(2)),
    "adamw_torch_fused": OptimizerSpec("torch.optim:AdamW", (("fused", True),), "torch AdamW, fused", _moments(2)),
    "adagrad": OptimizerSpec("torch.optim:Adagrad", (), "torch Adagrad", _moments(1), 1e-2),
    "rmsprop": OptimizerSpec("torch.optim:RMSprop", (), "torch RMSprop", _moments(1), 1e-2),
    "adafactor": OptimizerSpec(
        "transformers.optimization:Adafactor", (("scale_parameter", False), ("relative_step", False)),
        "transformers Adafactor (factored second moment)", _adafactor,
    ),
    "adamw_8bit": OptimizerSpec(f"{_BNB}:AdamW", (("optim_bits", 8), ("is_paged", False)),
                                "bitsandbytes AdamW, 8-bit states", _bnb_8bit(2)),
    "paged_adamw_8bit": OptimizerSpec(f"{_BNB}:AdamW", (("optim_bits", 8), ("is_paged", True)),
                                      "bitsandbytes AdamW, 8-bit states in paged memory", _bnb_8bit(2)),
    "paged_adamw_32bit": OptimizerSpec(f"{_BNB}:AdamW", (("optim_bits", 32), ("is_paged", True)),
                                       "bitsandbytes AdamW, fp32 states in paged memory", _fp32(2)),
    "lion_32bit": OptimizerSpec(f"{_BNB}:Lion", (("optim_bits", 32), ("is_paged", False)),
                                "bitsandbytes Lion, fp32 state", _fp32(1), 1e-4),
    "lion_8bit": OptimizerSpec(f"{_BNB}:Lion", (("optim_bits", 8), ("is_paged", False)),
                               "bitsandbytes Lion, 8-bit state", _bnb_8bit(1), 1e-4),
    "paged_lion_32bit": OptimizerSpec(f"{_BNB}:Lion", (("optim_bits", 32), ("is_paged", True)),
                                      "bitsandbytes Lion, fp32 state in paged memory", _fp32(1), 1e-4),
    "paged_lion_8bit": OptimizerSpec(f"{_BNB}:Lion", (("optim_bits", 8), ("is_paged", True)),
                                     "bitsandbytes Lion, 8-bit state in paged memory", _bnb_8bit(1), 1e-4),
    "adamw_torch_8bit": OptimizerSpec("torchao.optim:AdamW8bit", (("block_size", 256),),
                                      "torchao AdamW8bit (8-bit states)", _torchao(8)),
    "adamw_torch_4bit": OptimizerSpec("torchao.optim:AdamW4bit", (("block_size", 256),),
                                      "torchao AdamW4bit (4-bit states)", _torchao(4)),
}  # fmt: skip
_ALIASES = {"lion": "lion_32bit", "adamw_bnb_8bit": "adamw_8bit"}  # the Trainer's two names for one class
_EXTRAS = {"bitsandbytes": "qlora", "torchao": "lowbit", "transformers": "hf"}


def names() -> list[str]:
    """Every optimizer name accepted, aliases included."""
    return [*_SPECS, *_ALIASES]


def spec(name: str) -> OptimizerSpec:
    """The spec of ``name`` (an alias resolved).

    Raises:
        UnknownNameError: a name batchfit does not know (the message lists the valid ones).
    """
    key = _ALIASES.get(name, name) if isinstance(name, str) else None
    if key not in _SPECS:
        raise UnknownNameError("optimizer", str(name), names(), hint=f"(valid: {', '.join(names())})")
    return _SPECS[key]


def known_states(name: Any) -> StateBytes | None:
    """The closed form of ``name``'s states per tensor, or None for a name batchfit does not know."""
    key = _ALIASES.get(name, name) if isinstance(name, str) else None
    return _SPECS[key].states if key in _SPECS else None


def default_lr(name: str) -> float:
    """The learning rate a name gets when none is given."""
    return spec(name).lr


@dataclass(frozen=True)
class NamedOptimizer:
    """``params -> Optimizer`` for an optimizer name (picklable; what ``optimizer_factory`` returns)."""

    name: str
    """The name it was made from (an alias as given)."""
    lr: float
    """The learning rate every parameter group starts with."""

    @property
    def states(self) -> StateBytes:
        """The closed form of its states per tensor (read by the analytic estimate, ``memory/analytic.py``)."""
        return spec(self.name).states

    def __call__(self, params: Iterable[Any]) -> Any:
        target = spec(self.name)
        cls = optimizer_class(self.name)
        return construct(cls, params, lr=self.lr, **dict(target.kwargs))


def optimizer_factory(name: str, lr: float | None = None) -> NamedOptimizer:
    """The ``params -> Optimizer`` that ``name`` stands for, at ``lr`` (None: the name's default).

    Checks the name and that its package is installed now, so a bad name fails before anything runs.

    Raises:
        UnknownNameError: an unknown name (the message lists the valid ones).
        MissingExtraError: its package is not installed (the message names the batchfit extra).
        ConfigError: a learning rate that is not a positive number.
    """
    chosen = spec(name)
    if lr is None:
        lr = chosen.lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or not math.isfinite(lr):
        raise ConfigError(f"the learning rate must be a positive number, got {lr!r}")
    optimizer_class(name)
    return NamedOptimizer(name, float(lr))


def optimizer_class(name: str) -> type:
    """The class ``name`` builds, imported without its import-time chatter.

    Raises:
        UnknownNameError, MissingExtraError: see ``optimizer_factory``.
    """
    module_name, _, attr = spec(name).target.partition(":")
    package = module_name.split(".")[0]
    try:
        with quiet_third_party():
            module = importlib.import_module(module_name)
    except ImportError as e:
        extra = _EXTRAS.get(package)
        fix = f"pip install 'batchfit[{extra}]'" if extra else f"pip install {package}"
        raise MissingExtraError(
            f"optimizer {name!r} needs {package}, which is not installed ({type(e).__name__}: "
            f"{(str(e).splitlines() or [package])[0]}); install it with: {fix}"
        ) from None
    if package == "torchao":  # its compiled update warns at every training's first steps: see the NOTE below
        warnings.filterwarnings("ignore", message=NO_CACHE_HASH)
    return getattr(module, attr)


def construct(cls: type, params: Iterable[Any], **kwargs: Any) -> Any:
    """``cls(params, **kwargs)``, quietly; a bitsandbytes paged optimizer on CPU tensors is told not to
    warn that it pages there no more than it would without paging (its own fallback)."""
    with quiet_third_party():
        optimizer = cls(params, **kwargs)
    if getattr(optimizer, "is_paged", False):
        optimizer._cpu_paged_warned = True  # read by Optimizer8bit.get_state_buffer before it warns
    return optimizer
