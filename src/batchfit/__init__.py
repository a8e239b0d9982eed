"""batchfit: make any batch size trainable on the GPU memory you have.

Estimate the memory of a training step on a named GPU without that GPU, fit the largest and the
fastest micro-batch, plan any global batch as micro-batch x accumulation x GPUs, and train with
gradient accumulation that is exactly the large batch.

The public names are imported on first use (PEP 562), so ``import batchfit`` and the command line's
``--help``, ``gpus`` and ``presets`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

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
    "SimulatedDevice": ".gpu.simulated",
    "StepResult": ".train.accumulate",
    "SweepResult": ".planning.sweep",
    "TraceError": ".errors",
    "Trainer": ".train.trainer",
    "UnknownNameError": ".errors",
    "Workload": ".workload",
    "estimate": ".memory.estimate",
    "fit": ".planning.fit",
    "get_device": ".gpu.catalog",
    "plan": ".planning.plan",
    "scale_lr": ".advice.lr",
    "sweep": ".planning.sweep",
    "warmup_schedule": ".advice.lr",
}
_MODULES = {"devices": ".gpu.catalog", "presets": ".presets", "sources": ".sources"}

# The modules that lived at the package root before ``planning/`` and ``gpu/`` held them: a user's
# ``from batchfit.devices import get_device`` (or ``import batchfit.plan``) still finds the module at
# its new home, as the same module object, so a monkeypatch of either name patches both.
_MOVED: dict[str, str] = {
    "plan": "planning.plan",
    "plan_options": "planning.options",
    "plan_ladder": "planning.ladder",
    "plan_messages": "planning.messages",
    "plan_parallel": "planning.parallel",
    "fit": "planning.fit",
    "fit_search": "planning.search",
    "sweep": "planning.sweep",
    "cost": "planning.cost",
    "devices": "gpu.catalog",
    "profiles": "gpu.profiles",
    "calibrate": "gpu.calibrate",
    "context": "gpu.context",
    "monitor": "gpu.monitor",
    "simulated": "gpu.simulated",
    "cache_key": "cache.keys",
}

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
        value = importlib.import_module(_MODULES[name], __name__)
    else:
        raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


class _Package(types.ModuleType):
    """Keeps ``batchfit.fit`` (and ``plan``, ``sweep``) the function when a module of that name is imported.

    Importing a submodule sets it as an attribute of its package; ``import batchfit.plan`` (the old
    path of ``batchfit.planning.plan``) would then hide the ``plan`` function. The module is refused as
    an attribute instead (it stays in ``sys.modules``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``batchfit.<old name>`` as the module it moved to (``_MOVED``), one module under two names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, leaf = fullname.rpartition(".")
        if prefix != __name__ or leaf not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(f".{_MOVED[spec.name.rpartition('.')[2]]}", __name__)

    def exec_module(self, module: types.ModuleType) -> None:
        """The module ran when it was imported under its own name; running it again would remake its state."""


sys.modules[__name__].__class__ = _Package
if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from . import presets, sources
    from .advice.lr import scale_lr, warmup_schedule
    from .advice.noise_scale import GradientNoiseScale
    from .errors import BatchfitError, CheckpointError, ConfigError, DoesNotFitError, TraceError, UnknownNameError
    from .gpu import catalog as devices
    from .gpu.catalog import Device, get_device
    from .gpu.simulated import SimulatedDevice
    from .memory.estimate import Estimate, estimate
    from .planning.fit import FitResult, fit
    from .planning.plan import Plan, plan
    from .planning.sweep import SweepResult, sweep
    from .train.accumulate import Accumulator, StepResult
    from .train.trainer import Trainer
    from .workload import ParallelLayout, Workload
