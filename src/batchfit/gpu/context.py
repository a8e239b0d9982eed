"""Which CUDA context an estimate assumes, and why: a device profile, an override, eager or lazy loading.

The context (the CUDA runtime, the kernels it loaded, every library's residency outside PyTorch's
allocator) is a property of the driver, CUDA version, module-loading mode and libraries, not of the
model. ``resolve_device`` picks, in this order:

1. ``context_mib`` given by the user (``override``), on top of whatever else applies;
2. a device profile (``profile``): the one given (``--profile PATH``), else the stored profile of this
   machine's GPU, driver, CUDA and torch when the device asked for is that GPU and the module-loading
   mode is the one the profile was measured with;
3. eager module loading (``eager``): asked for (``--cuda-loading eager``), or detected:
   ``CUDA_MODULE_LOADING=EAGER`` in the environment, or a torch built with CUDA older than 11.7;
4. the catalog's constant for lazy loading (``default``).

The device carries its choice (``Device.context_source`` / ``describe_context``) into the estimate, and
``notes`` says what was detected, for the command line to print.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError, ProfileError, UnknownNameError
from ..units import format_bytes
from . import profiles
from .catalog import LAZY_LOADING_MIN_CUDA, Device, get_device

LOADING_MODES = ("lazy", "eager")


def detect_module_loading(environ: Mapping[str, str] | None = None, cuda_version: str | None = None) -> tuple[str, str]:
    """``(mode, reason)``: the module-loading mode a CUDA process started here would use.

    ``CUDA_MODULE_LOADING`` decides when set (torch sets it to ``LAZY`` only when it is unset,
    ``torch/cuda/__init__.py``, ``_lazy_init``); otherwise a CUDA older than 11.7 has no lazy loading.
    ``reason`` is empty for the default (lazy, nothing detected).

    Args:
        environ: the environment (default ``os.environ``).
        cuda_version: ``torch.version.cuda`` of the torch that will run the step (None: a CPU build or
            unknown, which says nothing).
    """
    env = os.environ if environ is None else environ
    setting = env.get("CUDA_MODULE_LOADING", "").strip().upper()
    if setting == "EAGER":
        return "eager", "CUDA_MODULE_LOADING=EAGER"
    if setting == "LAZY":
        return "lazy", "CUDA_MODULE_LOADING=LAZY"
    version = _version(cuda_version)
    if version is not None and version < LAZY_LOADING_MIN_CUDA:
        return "eager", f"CUDA {cuda_version} predates lazy module loading (11.7)"
    return "lazy", ""


@dataclass(frozen=True)
class ResolvedDevice:
    """A device with its context chosen, and what was detected on the way (lines for stderr)."""

    device: Device
    notes: tuple[str, ...] = field(default=())


def resolve_device(
    spec: str | Device,
    *,
    context_mib: float | None = None,
    profile: str | None = None,
    cuda_loading: str | None = None,
    cudnn_benchmark: bool | None = None,
    auto_profile: bool = True,
    environ: Mapping[str, str] | None = None,
    cuda_version: Any = "detect",
    local: Callable[[], Any] | None = None,
) -> ResolvedDevice:
    """The device ``spec`` names, with its CUDA context chosen as the module docstring says.

    Args:
        spec: a catalog name, a capacity, ``"cpu"``, the GPU name a profile records, or a ``Device``.
        context_mib: a measured context (MiB) that overrides every other choice.
        profile: path of a device profile to use; it must describe the device.
        cuda_loading: ``"lazy"`` or ``"eager"``; None detects it (``detect_module_loading``).
        cudnn_benchmark: the step runs with ``torch.backends.cudnn.benchmark`` (marks the device, and
            picks a profile's context measured after the benchmark runs); None: this process's flag.
        auto_profile: look for the stored profile of this machine's GPU.
        environ, cuda_version: the environment and ``torch.version.cuda`` (seams for tests;
            ``"detect"`` reads torch's).
        local: returns this machine's ``GpuIdentity`` or None (default ``_cuda.gpu_identity``).

    Raises:
        ConfigError: an unknown device or loading mode, a context that leaves nothing.
        ProfileError: the profile cannot be read, is for another GPU, or contradicts ``cuda_loading``.
    """
    if cuda_loading is not None and cuda_loading not in LOADING_MODES:
        raise ConfigError(f"--cuda-loading takes lazy or eager, got {cuda_loading!r}")
    notes: list[str] = []
    if cudnn_benchmark is None:
        import torch

        cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
    loaded = None
    if profile is not None:
        loaded = profiles.load(profile)
    device = _base(spec, loaded)
    if cuda_version == "detect":
        cuda_version = _torch_cuda_version()
    detected, reason = detect_module_loading(environ, cuda_version)
    mode = cuda_loading or detected
    if loaded is not None:
        if cuda_loading is not None and cuda_loading != loaded.module_loading.lower():
            raise ProfileError(
                f"{profile} was measured with {loaded.module_loading} module loading; --cuda-loading "
                f"{cuda_loading} contradicts it: drop one of them"
            )
        device = loaded.apply(device, str(profile), benchmark=cudnn_benchmark)
    elif auto_profile and device.kind == "cuda":
        found = _stored_profile(device, mode, environ, local or _local_identity, notes)
        if found is not None:
            stored, path = found
            device = stored.apply(device, str(path), benchmark=cudnn_benchmark)
            notes.append(f"using the device profile {path} ({stored.gpu.describe()})")
    if device.context_source != "profile" and mode == "eager" and (device.kind == "cuda" or cuda_loading):
        device = device.with_eager_loading("--cuda-loading eager" if cuda_loading else reason)
        if not cuda_loading:
            size = format_bytes(device.context_bytes)
            notes.append(f"{reason}: assuming eager module loading, a CUDA context of {size}")
    if context_mib is not None:
        device = device.with_overrides(context_bytes=int(context_mib * 2**20))
    if cudnn_benchmark and device.kind == "cuda":
        device = replace(device, cudnn_benchmark=True)
    return ResolvedDevice(device, tuple(notes))


def _base(spec: str | Device, loaded: Any) -> Device:
    """The device ``spec`` names; a profile's own GPU name works too when that profile is given."""
    try:
        return get_device(spec)
    except UnknownNameError:
        if loaded is not None and isinstance(spec, str) and _squash(spec) == _squash(loaded.gpu.name):
            return loaded.base_device()  # a GPU outside the catalog, named as its profile names it
        raise


def _stored_profile(
    device: Device, mode: str, environ: Mapping[str, str] | None, local: Callable[[], Any], notes: list[str]
) -> tuple[Any, Any] | None:
    """The stored profile of this machine's GPU, when ``device`` is that GPU and the loading mode agrees."""
    identity = local()
    if identity is None:
        return None
    try:
        stored, path = profiles.find(identity, environ)
    except ProfileError as e:
        notes.append(f"ignored a stored device profile: {e}")
        return None
    if stored is None or not stored.describes(device):
        return None
    if stored.module_loading.lower() != mode:
        notes.append(
            f"ignored the device profile {path}: measured with {stored.module_loading} module loading, "
            f"this run uses {mode.upper()}"
        )
        return None
    return stored, path


def _local_identity() -> Any:
    from .real_gpu import gpu_identity

    return gpu_identity()


def _torch_cuda_version() -> str | None:
    import torch

    return torch.version.cuda


def _version(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    parts = str(text).split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def _squash(text: str) -> str:
    return "".join(text.split()).replace("-", "").replace("_", "").lower()
