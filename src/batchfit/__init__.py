"""batchfit: make any batch size trainable on the GPU memory you have.

Estimate the memory of a training step on a named GPU without that GPU, fit the largest and the
fastest micro-batch, plan any global batch as micro-batch x accumulation x GPUs, and train with
gradient accumulation that is exactly the large batch.

The public names are imported on first use (PEP 562), so ``import batchfit`` and the command line's
``--help``, ``gpus`` and ``presets`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

_EXPORTS: dict[str, str] = {
    "Accumulator": ".train.accumulate",
    "BatchfitError": ".errors",
    "CheckpointError": ".errors",
    "ConfigError": ".errors",
    "Device": ".gpu.catalog",
    "DoesNotFitError": ".errors",
    "Estimate": ".memory.estimate",
    "FitResult": ".planning.fit",
    "GradientNoiseScale": ".advice.noise_scale",
    "ParallelLayout": ".workload",
    "Plan": ".planning.plan",
    "Setup": ".workload",
    "SimulatedDevice": ".runtime.simulated",
    "StepResult": ".train.accumulate",
    "SweepResult": ".planning.sweep",
    "TraceError": ".errors",
    "Trainer": ".train.trainer",
    "TrainingRun": ".train.synthetic",
    "UnknownNameError": ".errors",
    "Workload": ".workload",
    "estimate": ".planning.estimate",
    "fit": ".planning.fit",
    "get_device": ".gpu.catalog",
    "plan": ".planning.plan",
    "scale_lr": ".advice.lr",
    "sweep": ".planning.sweep",
    "train_synthetic": ".train.synthetic",
    "warmup_schedule": ".advice.lr",
}
_MODULES = {"devices": ".gpu.catalog", "presets": ".sources.presets", "sources": ".sources"}

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
    "ParallelLayout",
    "Plan",
    "Setup",
    "SimulatedDevice",
    "StepResult",
    "SweepResult",
    "TraceError",
    "Trainer",
    "TrainingRun",
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
    "train_synthetic",
    "warmup_schedule",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name], __name__)
    else:
        raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from . import sources
    from .advice.lr import scale_lr, warmup_schedule
    from .advice.noise_scale import GradientNoiseScale
    from .errors import BatchfitError, CheckpointError, ConfigError, DoesNotFitError, TraceError, UnknownNameError
    from .gpu import catalog as devices
    from .gpu.catalog import Device, get_device
    from .memory.estimate import Estimate
    from .planning.estimate import estimate
    from .planning.fit import FitResult, fit
    from .planning.plan import Plan, plan
    from .planning.sweep import SweepResult, sweep
    from .runtime.simulated import SimulatedDevice
    from .sources import presets
    from .train.accumulate import Accumulator, StepResult
    from .train.synthetic import TrainingRun, train_synthetic
    from .train.trainer import Trainer
    from .workload import ParallelLayout, Setup, Workload
