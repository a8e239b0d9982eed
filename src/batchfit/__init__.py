"""batchfit: make any batch size trainable on the GPU memory you have.

Estimate the memory of a training step on a named GPU without that GPU, fit the largest and the
fastest micro-batch, plan any global batch as micro-batch x accumulation x GPUs, and train with
gradient accumulation that is exactly the large batch.

The public names are imported on first use (PEP 562), so ``import batchfit`` and the command line's
``--help``, ``gpus`` and ``presets`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Accumulator": ".train.accumulate",
    "BatchfitError": ".errors",
    "CheckpointError": ".errors",
    "ConfigError": ".errors",
    "Device": ".devices",
    "DoesNotFitError": ".errors",
    "Estimate": ".memory.estimate",
    "FitResult": ".fit",
    "GradientNoiseScale": ".advice.noise_scale",
    "Plan": ".plan",
    "SimulatedDevice": ".simulated",
    "StepResult": ".train.accumulate",
    "SweepResult": ".sweep",
    "TraceError": ".errors",
    "Trainer": ".train.trainer",
    "UnknownNameError": ".errors",
    "Workload": ".workload",
    "estimate": ".memory.estimate",
    "fit": ".fit",
    "get_device": ".devices",
    "plan": ".plan",
    "scale_lr": ".advice.lr",
    "sweep": ".sweep",
    "warmup_schedule": ".advice.lr",
}
_MODULES = ("devices", "presets", "sources")

__all__ = [
    "Accumulator",
    "BatchfitError",
    "CheckpointError",
    "ConfigError",
    "Device",
    "DoesNotFitError",
    "Estimate",
    "FitResult",
    "GradientNoiseScale",
    "Plan",
    "SimulatedDevice",
    "StepResult",
    "SweepResult",
    "TraceError",
    "Trainer",
    "UnknownNameError",
    "Workload",
    "__version__",
    "devices",
    "estimate",
    "fit",
    "get_device",
    "plan",
    "presets",
    "scale_lr",
    "sources",
    "sweep",
    "warmup_schedule",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


class _Package(types.ModuleType):
    """Keeps ``batchfit.fit`` (and ``plan``, ``sweep``) the function when its module is first imported.

    Importing a submodule sets it as an attribute of its package; ``batchfit/fit.py`` would then hide
    the ``fit`` function of the same name. Eager imports avoided that by rebinding the function after
    the module; lazy ones refuse the module instead (it stays in ``sys.modules``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from . import devices, presets, sources
    from .advice.lr import scale_lr, warmup_schedule
    from .advice.noise_scale import GradientNoiseScale
    from .devices import Device, get_device
    from .errors import BatchfitError, CheckpointError, ConfigError, DoesNotFitError, TraceError, UnknownNameError
    from .fit import FitResult, fit
    from .memory.estimate import Estimate, estimate
    from .plan import Plan, plan
    from .simulated import SimulatedDevice
    from .sweep import SweepResult, sweep
    from .train.accumulate import Accumulator, StepResult
    from .train.trainer import Trainer
    from .workload import Workload
