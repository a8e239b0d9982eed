"""Training precisions: what dtype parameters are built in, and which autocast wraps the forward pass.

| precision   | parameters, grads, optimizer states | forward/backward compute          |
|-------------|-------------------------------------|-----------------------------------|
| ``fp32``    | fp32                                | fp32                              |
| ``bf16``    | fp32                                | autocast bf16 (fp32 master weights)|
| ``fp16``    | fp32                                | autocast fp16 (+ a GradScaler)    |
| ``bf16-true`` | bf16                              | bf16                              |
| ``bf16-true-autocast`` | bf16 as built (peft's adapters fp32) | autocast bf16           |

``bf16-true-autocast`` is the Hugging Face recipe: a model loaded with ``torch_dtype=torch.bfloat16`` and
trained with ``TrainingArguments(bf16=True)`` (autocast on). Its weights are built in bf16, but what peft
adds stays as peft makes it (fp32 adapters), and autocast keeps CUDA's fp32 ops (softmax, norms, losses)
in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from .errors import ConfigError


class Precision(str, Enum):
    """The precisions batchfit estimates and trains with."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    BF16_TRUE = "bf16-true"
    BF16_TRUE_AUTOCAST = "bf16-true-autocast"


@dataclass(frozen=True)
class PrecisionPolicy:
    """How one precision is set up on one device kind."""

    precision: Precision
    param_dtype: torch.dtype | None
    """Default dtype while the model and batches are built (None: leave torch's default)."""
    autocast_dtype: torch.dtype | None
    """The low-precision dtype of autocast (None: no autocast)."""

    def autocast(self, device_type: str = "cpu") -> Callable[[], contextlib.AbstractContextManager] | None:
        """A factory of the autocast context for ``device_type``, or None without autocast."""
        if self.autocast_dtype is None:
            return None
        dtype = self.autocast_dtype
        return lambda: torch.autocast(device_type, dtype=dtype)


def parse_precision(value: str | Precision) -> Precision:
    """``"bf16"`` -> ``Precision.BF16``; an unknown value gets one line listing the valid ones."""
    if isinstance(value, Precision):
        return value
    try:
        return Precision(str(value).lower())
    except ValueError:
        valid = ", ".join(p.value for p in Precision)
        raise ConfigError(f"unknown precision {value!r}; use one of {valid}") from None


def policy_for(precision: str | Precision, *, bf16_supported: bool = True, device_name: str = "") -> PrecisionPolicy:
    """The policy of ``precision``; bf16 on a GPU without native bf16 is refused with the fix.

    Raises:
        ConfigError: unknown precision, or bf16 on a GPU without it (V100, T4).
    """
    p = parse_precision(precision)
    if p in (Precision.BF16, Precision.BF16_TRUE, Precision.BF16_TRUE_AUTOCAST) and not bf16_supported:
        raise ConfigError(
            f"{device_name or 'this GPU'} has no native bf16; use --precision fp16 (autocast with a GradScaler)"
        )
    if p is Precision.FP32:
        return PrecisionPolicy(p, None, None)
    if p is Precision.BF16:
        return PrecisionPolicy(p, None, torch.bfloat16)
    if p is Precision.FP16:
        return PrecisionPolicy(p, None, torch.float16)
    if p is Precision.BF16_TRUE_AUTOCAST:
        return PrecisionPolicy(p, torch.bfloat16, torch.bfloat16)
    return PrecisionPolicy(p, torch.bfloat16, None)
