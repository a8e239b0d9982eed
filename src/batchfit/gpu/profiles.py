"""Device profiles: what ``batchfit calibrate`` measured on one GPU, kept so estimates can use it.

The CUDA context, the library workspaces and cuDNN's convolution workspaces depend on the GPU, the
driver, the CUDA and the torch versions, not on the model; the catalog can only assume them. A profile
holds the measured figures for one combination, as JSON in the user's cache directory
(``$BATCHFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/batchfit``, else ``~/.cache/batchfit``), under
``profiles/<key>.json`` where the key is the GPU's name, driver, CUDA and torch versions.

Using one:
    * automatically, when the local GPU, driver, CUDA, torch and module-loading mode are those of a
      stored profile and the device asked for is that GPU (``context.resolve_device`` says so);
    * explicitly, from any path (``--profile PATH``): a profile applies to the GPU it names, on any
      machine, so profiles can be shared between machines of the same kind. It is refused for
      another GPU, and a corrupt or unreadable file is one clear error (``ProfileError``).

This module imports no torch: reading and matching profiles is cheap.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ProfileError, UnknownNameError
from ..units import format_bytes
from .catalog import ConvWorkspace, Device, get_device

SCHEMA = "batchfit-device-profile/1"
"""The format written here; a file with another schema is refused rather than half-read."""


@dataclass(frozen=True)
class GpuIdentity:
    """The four things a profile is keyed by: a profile measured under one of them differing may not hold."""

    name: str
    """The name torch reports (``torch.cuda.get_device_properties(0).name``)."""
    driver: str
    """The display driver (NVML's ``nvmlSystemGetDriverVersion``), e.g. ``"580.65.06"``."""
    cuda: str
    """The CUDA version torch was built with (``torch.version.cuda``)."""
    torch: str
    """``torch.__version__``."""

    def key(self) -> str:
        """The profile's file name stem: the four fields, in a form safe for any file system."""
        parts = (self.name, f"driver{self.driver}", f"cuda{self.cuda}", f"torch{self.torch}")
        return "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", p).strip("_") for p in parts)

    def describe(self) -> str:
        """One line for messages."""
        return f"{self.name}, driver {self.driver}, CUDA {self.cuda}, torch {self.torch}"


@dataclass(frozen=True)
class ConvMeasurement:
    """One cuDNN convolution call measured on the GPU."""

    shape: str
    """``x=NxCxHxW w=KxCxRxS stride=s padding=p groups=g``."""
    dtype: str
    direction: str
    """``forward``, ``backward data`` or ``backward filter`` (``memory/kernels/cudnn.py``)."""
    benchmark: bool
    """``torch.backends.cudnn.benchmark`` during the call."""
    operand_bytes: int
    """Input + weight + output bytes: what the model's ratio multiplies."""
    workspace_bytes: int
    """Peak allocated during the call, above what was allocated before it and its output."""


@dataclass(frozen=True)
class DeviceProfile:
    """What ``batchfit calibrate`` measured on one GPU (see the module docstring)."""

    gpu: GpuIdentity
    total_bytes: int
    """``torch.cuda.get_device_properties(0).total_memory``."""
    compute_capability: tuple[int, int]
    module_loading: str
    """``LAZY`` or ``EAGER``: ``CUDA_MODULE_LOADING`` as the CUDA runtime saw it."""
    context_bytes: int
    """NVML's used memory of this process minus ``memory_reserved`` after real training steps: the
    context and every library's residency outside the caching allocator."""
    cublas_workspace_bytes: int
    """cuBLAS + cuBLASLt workspace per handle, taken from the caching allocator."""
    cublas_handles: int
    """Workspaces alive after a training step (handles x streams)."""
    conv_workspace: ConvWorkspace
    """Largest measured cuDNN workspace per operand byte, per direction, with cuDNN's heuristics."""
    conv_workspace_benchmark: ConvWorkspace
    """The same with ``torch.backends.cudnn.benchmark = True``."""
    context_benchmark_bytes: int = 0
    """The context after the benchmark runs too (every engine's kernels loaded); 0: not measured."""
    bare_context_bytes: int = 0
    """The context after the first CUDA op, before any library was loaded."""
    cudnn_version: int | None = None
    alloc_conf: str = ""
    """``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) during the measurement."""
    allocator_backend: str = "native"
    conv_measurements: tuple[ConvMeasurement, ...] = ()
    steps: tuple[str, ...] = ()
    """The training steps the context was measured after."""
    created: str = ""
    batchfit_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further readings (not used by the estimator), kept for whoever reads the file."""

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The JSON object written to disk."""
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability)
        return {"schema": SCHEMA, **d}

    @classmethod
    def from_json(cls, data: Any, source: str = "profile") -> DeviceProfile:
        """Read a profile written by ``to_json``.

        Raises:
            ProfileError: not a JSON object of this schema, or a field missing or of the wrong type.
        """
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
            raise ProfileError(
                f"{source} is not a batchfit device profile (schema {found!r}, expected {SCHEMA!r}); "
                "write one with `batchfit calibrate` on the GPU"
            )
        try:
            return cls(
                gpu=GpuIdentity(**{k: str(data["gpu"][k]) for k in ("name", "driver", "cuda", "torch")}),
                total_bytes=_count(data["total_bytes"], positive=True),
                compute_capability=(int(data["compute_capability"][0]), int(data["compute_capability"][1])),
                module_loading=str(data["module_loading"]).upper(),
                context_bytes=_count(data["context_bytes"]),
                cublas_workspace_bytes=_count(data["cublas_workspace_bytes"]),
                cublas_handles=_count(data["cublas_handles"]),
                conv_workspace=_ratios(data["conv_workspace"]),
                conv_workspace_benchmark=_ratios(data["conv_workspace_benchmark"]),
                context_benchmark_bytes=_count(data.get("context_benchmark_bytes", 0)),
                bare_context_bytes=_count(data.get("bare_context_bytes", 0)),
                cudnn_version=None if data.get("cudnn_version") is None else int(data["cudnn_version"]),
                alloc_conf=str(data.get("alloc_conf", "")),
                allocator_backend=str(data.get("allocator_backend", "native")),
                conv_measurements=tuple(ConvMeasurement(**m) for m in data.get("conv_measurements", ())),
                steps=tuple(str(s) for s in data.get("steps", ())),
                created=str(data.get("created", "")),
                batchfit_version=str(data.get("batchfit_version", "")),
                extra=dict(data.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            what = f"field {e.args[0]!r} is missing" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ProfileError(
                f"{source} is a damaged device profile ({what}); run `batchfit calibrate` again"
            ) from None

    # -- matching -----------------------------------------------------------------------------------
    def base_device(self) -> Device:
        """The device this profile describes, before its measurements: the catalog entry for the GPU's
        name, else a generic GPU of its total memory (named as torch names it)."""
        try:
            dev = get_device(self.gpu.name)
        except (UnknownNameError, ValueError):
            dev = get_device(f"{self.total_bytes}B")
            return replace(dev, name=self.gpu.name, compute_capability=self.compute_capability)
        return dev

    def describes(self, device: Device) -> bool:
        """Whether ``device`` is the GPU this profile was measured on (by catalog name, else by name)."""
        return device.kind == "cuda" and _same_name(device.name, self.base_device().name)

    def apply(self, device: Device, source: str, *, benchmark: bool = False) -> Device:
        """``device`` with this profile's measurements (context, cuBLAS and cuDNN workspaces, total).

        Args:
            device: the device asked for; it must be the GPU the profile names.
            source: where the profile came from (its path), for the report.
            benchmark: the step runs with ``torch.backends.cudnn.benchmark``: use the context measured
                after the benchmark runs when there is one.

        Raises:
            ProfileError: ``device`` is the CPU or another GPU.
        """
        base = self.base_device()
        if device.kind != "cuda":
            raise ProfileError(
                f"{source} is a profile of {self.gpu.name} ({base.name}); a device profile describes a GPU, "
                f"not {device.name}: pass --device {_quoted(base.name)}"
            )
        if not self.describes(device):
            raise ProfileError(
                f"{source} was measured on {self.gpu.name} ({base.name}), not on {device.name}: use it with "
                f"--device {_quoted(base.name)}, or run `batchfit calibrate` on {device.name}"
            )
        context = self.context_benchmark_bytes if benchmark and self.context_benchmark_bytes else self.context_bytes
        if context >= self.total_bytes:
            raise ProfileError(
                f"{source} says the context takes {format_bytes(context)} of {format_bytes(self.total_bytes)}; "
                "the profile is damaged: run `batchfit calibrate` again"
            )
        return replace(
            device,
            total_bytes=self.total_bytes,
            context_bytes=context,
            context_source="profile",
            context_detail=source,
            cublas_workspace_bytes=self.cublas_workspace_bytes,
            cublas_handles=self.cublas_handles,
            conv_workspace=self.conv_workspace,
            conv_workspace_benchmark=self.conv_workspace_benchmark,
        )


# -- files ------------------------------------------------------------------------------------------
def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where profiles live: ``$BATCHFIT_CACHE_DIR/profiles``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    env = os.environ if environ is None else environ
    if env.get("BATCHFIT_CACHE_DIR"):
        root = Path(env["BATCHFIT_CACHE_DIR"])
    elif env.get("XDG_CACHE_HOME"):
        root = Path(env["XDG_CACHE_HOME"]) / "batchfit"
    else:
        root = Path(env.get("HOME") or Path.home()) / ".cache" / "batchfit"
    return root / "profiles"


def default_path(identity: GpuIdentity, environ: Mapping[str, str] | None = None) -> Path:
    """The file a profile of ``identity`` is stored in and looked up from."""
    return cache_dir(environ) / f"{identity.key()}.json"


def save(profile: DeviceProfile, path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """Write ``profile`` as JSON (to its default path when ``path`` is None); returns the path."""
    target = Path(path) if path is not None else default_path(profile.gpu, environ)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    tmp.replace(target)  # atomic: a reader never sees half a profile
    return target


def load(path: str | Path) -> DeviceProfile:
    """Read the profile at ``path``.

    Raises:
        ProfileError: the file is missing, unreadable, not JSON, or not a profile of this schema.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ProfileError(f"no device profile at {p}; write one with `batchfit calibrate` on the GPU") from None
    except OSError as e:
        raise ProfileError(f"cannot read the device profile {p}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(
            f"{p} is not valid JSON (line {e.lineno}: {e.msg}); run `batchfit calibrate` again"
        ) from None
    return DeviceProfile.from_json(data, source=str(p))


def find(identity: GpuIdentity, environ: Mapping[str, str] | None = None) -> tuple[DeviceProfile | None, Path]:
    """The stored profile of exactly ``identity`` (None if there is none) and where it was looked for.

    Raises:
        ProfileError: a file is there but cannot be read.
    """
    path = default_path(identity, environ)
    if not path.exists():
        return None, path
    profile = load(path)
    if profile.gpu != identity:
        raise ProfileError(f"{path} holds a profile of {profile.gpu.describe()}, not of {identity.describe()}")
    return profile, path


# -- helpers ----------------------------------------------------------------------------------------
def _count(value: Any, *, positive: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise ValueError(f"expected a whole number of bytes {'> 0' if positive else '>= 0'}, got {value!r}")
    return value


def _ratios(value: Any) -> ConvWorkspace:
    ratios = ConvWorkspace(**{k: float(value[k]) for k in ("forward", "backward_data", "backward_filter")})
    if min(ratios.forward, ratios.backward_data, ratios.backward_filter) < 0:
        raise ValueError(f"negative workspace ratio in {value!r}")
    return ratios


def _same_name(a: str, b: str) -> bool:
    return re.sub(r"[-_\s]", "", a).lower() == re.sub(r"[-_\s]", "", b).lower()


def _quoted(name: str) -> str:
    return f"'{name}'" if " " in name else name
