"""What the CUDA GPU at hand is: its catalog entry and capacity, its identity (driver, CUDA, torch).

Kept small, with ``torch.cuda`` and NVML as seams that tests replace with fakes. Running a step on the
GPU (fit's verification) is ``runtime/cuda_steps.py``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..errors import ConfigError
from .catalog import Device, catalog, generic_device
from .profiles import GpuIdentity


def cuda_device(cuda: Any = torch.cuda) -> Device:
    """The current GPU as a ``Device``: the catalog entry whose name torch reports, else a generic one."""
    if not cuda.is_available():
        raise ConfigError("no CUDA GPU is visible; use a catalog name (--device A100-40GB) or a capacity (24GiB)")
    props = cuda.get_device_properties(cuda.current_device())
    name = str(props.name).lower()
    sms = int(getattr(props, "multi_processor_count", 0) or 0)
    total = int(props.total_memory)
    named = next((d for d in catalog() if any(alias.lower() == name for alias in (d.name, *d.aliases))), None)
    dev = named.with_overrides(total_bytes=total) if named else generic_device(f"{total}B")
    return replace(dev, multiprocessors=sms) if sms else dev


def gpu_identity(cuda: Any = torch.cuda, nvml: Any = None) -> Any:
    """This machine's GPU, driver, CUDA and torch (a ``profiles.GpuIdentity``), or None without a GPU.

    ``cuda`` and ``nvml`` (the ``pynvml`` module) are seams that tests replace with fakes.
    """
    if not cuda.is_available():
        return None
    props = cuda.get_device_properties(cuda.current_device())
    return GpuIdentity(name=str(props.name), driver=driver_version(nvml), cuda=str(torch.version.cuda),
                       torch=str(torch.__version__))  # fmt: skip


def driver_version(nvml: Any = None) -> str:
    """The display driver's version from NVML (``"580.65.06"``), or ``"unknown"`` without NVML."""
    try:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, ImportError: NVML is optional
        return "unknown"
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return "unknown"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: S110 - shutting down a library that failed is not an error
            pass
