"""Reading ``batchfit train``'s options: the values a flag takes, checked, with the fix in the message.

``--micro-batch-size`` is a whole number or ``auto``, ``--set`` a ``KEY=VALUE`` preset override, and
``--device`` names the CPU, a real GPU, or a simulated one (``simulated:NAME``, or a bare catalog
name or capacity) that ``train`` enters as a context. Each helper raises ``ConfigError`` for a value
it cannot take; none imports torch before a command runs.
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


def _device(text: str, precision: str) -> tuple[Any, Any]:
    """``(device for the Trainer, SimulatedDevice or None)`` from ``--device``."""
    import torch

    from ..gpu.simulated import SimulatedDevice
    from ..precision import policy_for

    spec = text.strip()
    if spec.lower() == "cpu" or spec.lower().split(":")[0] == "cuda":
        policy_for(precision)  # validates the name
        if spec.lower() != "cpu" and not torch.cuda.is_available():
            raise ConfigError(f"--device {spec} needs a GPU but none is visible; use cpu or a simulated GPU, e.g. T4")
        return spec.lower(), None
    name = spec[len("simulated:") :] if spec.lower().startswith("simulated:") else spec
    if not name:
        raise ConfigError("--device simulated: needs a GPU name or a capacity, e.g. simulated:64MiB")
    probe = SimulatedDevice(name)  # resolves the name or capacity; raises ConfigError with the fix
    policy = policy_for(precision, bf16_supported=probe.device.bf16, device_name=probe.device.name)
    sim = SimulatedDevice(name, policy=policy)
    return sim, sim
