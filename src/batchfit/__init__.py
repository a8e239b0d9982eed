"""batchfit: make any batch size trainable on the GPU memory you have.

Estimate the memory of a training step on a named GPU without that GPU, fit the largest and the
fastest micro-batch, plan any global batch as micro-batch x accumulation x GPUs, and train with
gradient accumulation that is exactly the large batch.
"""

from __future__ import annotations

from . import devices, presets
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

__version__ = "0.1.0"

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
    "sweep",
    "warmup_schedule",
]
