"""Reading ``batchfit train``'s options: the values a flag takes, checked, with the fix in the message.

``--micro-batch-size`` is a whole number or ``auto`` and ``--set`` a ``KEY=VALUE`` preset override;
``--device`` is read where the run uses it (``batchfit.train.synthetic``: a Python caller names
devices the same way). Each helper raises ``ConfigError`` for a value it cannot take, naming the flag;
none imports torch.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from ..errors import ConfigError


class DType(str, Enum):
    """Default dtype the model and data are built in."""

    float32 = "float32"
    float64 = "float64"


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise ConfigError(f"{flag} must be a whole number >= 1, got {value}")
    return value


def _micro(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--micro-batch-size takes a whole number or 'auto', got {text!r}") from None
    return _positive(value, "--micro-batch-size")


def _overrides(sets: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set takes KEY=VALUE, got {item!r}; e.g. --set hidden=128")
        out[key.strip()] = value.strip()  # presets parse strings themselves
    return out
