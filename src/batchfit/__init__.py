"""batchfit: make any batch size trainable on the GPU memory you have."""

from __future__ import annotations

from .errors import BatchfitError, CheckpointError, ConfigError, DoesNotFitError, UnknownNameError
from .workload import Workload

__version__ = "0.1.0"

__all__ = [
    "BatchfitError",
    "CheckpointError",
    "ConfigError",
    "DoesNotFitError",
    "UnknownNameError",
    "Workload",
    "__version__",
]
