"""The GPU catalog: how much memory a device really offers a PyTorch training step.

A card sold as "80GB" does not give PyTorch 80 GB. The driver keeps part of the memory for itself
(``total_memory`` is already net of that), the CUDA context and the kernels it loads live outside
PyTorch's caching allocator, and cuBLAS keeps one workspace per handle. A :class:`Device` carries all
of these so the estimator can compare a predicted peak with what the allocator can actually reserve.

``total_bytes`` is what ``torch.cuda.get_device_properties(0).total_memory`` (``cudaDeviceProp.
totalGlobalMem``, the number ``deviceQuery`` prints) reports, not the larger "Total" of ``nvidia-smi``.
It moves by a few hundred MiB between driver releases; each figure below cites the printout it comes
from, preferring the newest driver found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import ConfigError, UnknownNameError
from ..units import MiB, format_bytes, parse_bytes

NOTE = (
    "CUDA context sizes assume CUDA >= 11.7 with lazy module loading, which PyTorch turns on by "
    "default (CUDA_MODULE_LOADING=LAZY, pytorch/pytorch#86509: 287 MB instead of 667 MB). Older CUDA, "
    "or CUDA_MODULE_LOADING=EAGER, loads every kernel at start-up and the context passes 1 GB: Hugging "
    "Face measured 1343 MiB on a V100 with CUDA 11.2 ('Model training anatomy'); --cuda-loading eager "
    "assumes that. Better: measure it with `batchfit calibrate` on the GPU (a device profile), or measure "
    "the context (nvidia-smi after a training step, minus torch.cuda.memory_reserved()) and pass it with "
    "--context-mib."
)

# cuBLAS workspace per (handle, stream), from PyTorch's aten/src/ATen/cuda/CublasHandlePool.cpp,
# parseChosenWorkspaceSize(): ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB) by default, 32 MiB from Hopper on
# (sm_90 first; sm_100/sm_120 added later). CUBLAS_WORKSPACE_CONFIG overrides both.
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8_519_680
CUBLAS_WORKSPACE_BYTES_SM90 = 4096 * 8 * 1024  # 33_554_432

# CUDA context + lazily loaded kernels, per architecture. Hopper's is measured: nvidia-smi's memory of
# the process less torch.cuda.memory_reserved() after two training steps was 742-762 MiB on an H200 (torch
# 2.11, CUDA 13.0, driver 580, lazy loading) across 14 models (transformers, CNNs, an LSTM, MoE, LoRA;
# benchmarks/results/gpu_truth-NVIDIA_H200-*.csv), and `batchfit calibrate` measured 758 MiB there, of
# which 610 MiB is the bare context and ~150 MiB the kernels a step loads (GEMMs, cuDNN, optimizer,
# autograd). The others are estimates, not measurements: a bare lazy-loading context was measured at
# 256 MiB on an RTX 3090 (torch 2.7, CUDA 12.8; invoke-ai/InvokeAI#9413) and 426 MiB on an RTX 6000 Ada
# (torch 2.10, CUDA 13.0; unslothai/unsloth-zoo#1053); pytorch/pytorch#86509 saw 274 MiB in use after a
# first small tensor. A step's kernels come on top, and newer architectures ship larger kernel images, so
# the defaults sit above the bare figures and grow with the architecture (Blackwell no smaller than the
# Hopper measurement). A device profile (`batchfit calibrate`) or --context-mib replaces the constant.
CONTEXT_BYTES = {
    "Volta": 320 * MiB,
    "Turing": 320 * MiB,
    "Ampere": 384 * MiB,
    "Ada": 512 * MiB,
    "Hopper": 760 * MiB,
    "Blackwell": 768 * MiB,
}
CONTEXT_MEASURED_ON = {"Hopper": "measured on an H200 with torch 2.11 + CUDA 13.0"}
"""The architectures whose ``CONTEXT_BYTES`` is a measurement, and where it was taken."""
# Eager module loading (CUDA < 11.7, or CUDA_MODULE_LOADING=EAGER) loads every kernel of every library at
# start-up. Published: 1343 MiB on nvidia-smi after ``torch.ones((1, 1)).cuda()`` on a V100, CUDA 11.2
# (Hugging Face, "Model training anatomy"), less the 2 MiB small-pool segment that tensor left cached;
# pytorch/pytorch#86509 measured 667 MB eager against 287 MB lazy. The larger figure is the conservative
# one (an under-estimated context is a plan that runs out of memory), and it is never below the lazy
# constant of the same architecture.
EAGER_CONTEXT_BYTES = 1341 * MiB
LAZY_LOADING_MIN_CUDA = (11, 7)
"""The first CUDA release with lazy module loading (CUDA 11.7 release notes, ``CUDA_MODULE_LOADING``)."""
CONTEXT_SOURCES = ("default", "eager", "profile", "override")
"""Where a device's ``context_bytes`` comes from (see ``Device.context_source``)."""
GPUS_PER_NODE = 8
"""GPUs one node links with NVLink (DGX/HGX A100, H100, H200, B200 boards: 8 through NVSwitch); tensor
parallelism stays inside one, its collectives being in every layer (``--gpus-per-node`` to change)."""
DEFAULT_ARCH = "Ampere"
DEFAULT_COMPUTE_CAPABILITY = (8, 0)
DEFAULT_MULTIPROCESSORS = 108
"""The multiprocessors of a GPU not in the catalog: an A100's, the same generation as its other defaults."""
THREADS_PER_MULTIPROCESSOR = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536}
"""``maxThreadsPerMultiProcessor`` by compute capability where it is not 2048 (CUDA C++ Programming Guide,
"Technical Specifications per Compute Capability")."""


def threads_per_multiprocessor(compute_capability: tuple[int, int]) -> int:
    """The most resident threads on one multiprocessor of a GPU of this compute capability."""
    return THREADS_PER_MULTIPROCESSOR.get(compute_capability, 2048)


def cublas_workspace_for(compute_capability: tuple[int, int]) -> int:
    """cuBLAS workspace bytes per handle that PyTorch picks by default for this compute capability."""
    return CUBLAS_WORKSPACE_BYTES_SM90 if compute_capability >= (9, 0) else CUBLAS_WORKSPACE_BYTES


@dataclass(frozen=True)
class ConvWorkspace:
    """cuDNN convolution workspace of one call as a multiple of its operands' bytes (input + weight + output).

    Measured per direction by ``batchfit calibrate``; ``memory/kernels/cudnn.py`` explains the model and its
    default when nothing was measured.
    """

    forward: float
    backward_data: float
    backward_filter: float


@dataclass(frozen=True)
class Device:
    """A device to estimate against: a catalog GPU, a generic GPU of a given capacity, or the CPU.

    Attributes:
        name: catalog name (``"A100-40GB"``), ``"cpu"``, or the capacity text a user gave (``"24GiB"``).
        kind: ``"cuda"`` or ``"cpu"``.
        total_bytes: ``torch.cuda.get_device_properties(0).total_memory``; None for the CPU (no limit).
        arch: ``"Volta"`` ... ``"Blackwell"``; ``""`` for the CPU.
        compute_capability: ``(8, 0)`` for an A100; ``(0, 0)`` for the CPU.
        bf16: native bf16 tensor cores (sm >= 80), so bf16 autocast is worth recommending.
        context_bytes: CUDA context and loaded kernels, resident outside PyTorch's allocator.
        cublas_workspace_bytes: cuBLAS workspace per handle (see :func:`cublas_workspace_for`).
        cublas_handles: handles a training step holds: forward thread plus autograd's backward thread.
        memory_bandwidth_gbps: published peak memory bandwidth, for reports.
        bf16_tflops: published dense bf16 (fp16 before Ampere) tensor-core peak, for throughput models.
        aliases: other spellings accepted by :func:`get_device`, including the name torch reports.
        context_source: where ``context_bytes`` comes from: ``default`` (the catalog's lazy-loading
            constant), ``eager`` (the published eager-loading figure), ``profile`` (measured by
            ``batchfit calibrate``) or ``override`` (given by the user).
        context_detail: what the source was (the profile's path, the reason eager loading was assumed).
        conv_workspace: measured cuDNN convolution workspaces (``batchfit calibrate``) as multiples of
            each call's operand bytes, with cuDNN's heuristics; None: the model's assumption
            (``memory/kernels/cudnn.py``).
        conv_workspace_benchmark: the same with ``torch.backends.cudnn.benchmark = True``.
        cudnn_benchmark: the step runs with ``torch.backends.cudnn.benchmark = True`` (``--cudnn-benchmark``;
            the process's own flag counts too), which picks faster convolution engines with larger
            workspaces.
    """

    name: str
    kind: str
    total_bytes: int | None
    arch: str
    compute_capability: tuple[int, int]
    bf16: bool
    context_bytes: int
    cublas_workspace_bytes: int
    cublas_handles: int = 2
    memory_bandwidth_gbps: float = 0.0
    bf16_tflops: float = 0.0
    aliases: tuple[str, ...] = ()
    context_source: str = "default"
    context_detail: str = ""
    conv_workspace: ConvWorkspace | None = None
    conv_workspace_benchmark: ConvWorkspace | None = None
    cudnn_benchmark: bool = False
    multiprocessors: int = 0
    """Streaming multiprocessors (``multi_processor_count``): CUDA reductions size their staging by it
    (``memory/kernels/cuda_reduce.py``); 0 for the CPU."""

    @property
    def exact(self) -> bool:
        """True on the CPU: bytes are counted as allocated, with no rounding, context or workspaces."""
        return self.kind == "cpu"

    @property
    def usable_bytes(self) -> int | None:
        """What PyTorch's allocator can reserve: the total minus the context; None when unlimited."""
        if self.total_bytes is None:
            return None
        return self.total_bytes - self.context_bytes

    def with_overrides(self, *, context_bytes: int | None = None, total_bytes: int | None = None) -> Device:
        """A copy with a measured context size or total memory, since both vary with driver and setup.

        Raises:
            ConfigError: a negative context, a non-positive total, a context that leaves nothing
                usable, or a context given for the CPU.
        """
        changes: dict[str, object] = {}
        if context_bytes is not None:
            if self.kind == "cpu":
                raise ConfigError("the cpu has no CUDA context; --context-mib applies to GPUs only")
            if context_bytes < 0:
                raise ConfigError(f"context size must be >= 0 bytes, got {context_bytes}; e.g. 512 MiB")
            changes["context_bytes"] = context_bytes
            changes["context_source"], changes["context_detail"] = "override", "--context-mib"
        if total_bytes is not None:
            if total_bytes <= 0:
                raise ConfigError(f"total memory must be positive, got {total_bytes}; e.g. '24GiB'")
            changes["total_bytes"] = total_bytes
        new = replace(self, **changes)  # type: ignore[arg-type]
        if new.total_bytes is not None and new.context_bytes >= new.total_bytes:
            raise ConfigError(
                f"a context of {format_bytes(new.context_bytes)} leaves nothing of "
                f"{format_bytes(new.total_bytes)} on {new.name}; lower --context-mib"
            )
        return new

    def with_eager_loading(self, reason: str) -> Device:
        """A copy whose context is the published eager-loading figure (see ``EAGER_CONTEXT_BYTES``).

        Args:
            reason: why eager loading is assumed (``--cuda-loading eager``, ``CUDA_MODULE_LOADING=EAGER``,
                CUDA older than 11.7); kept in ``context_detail`` for the report.

        Raises:
            ConfigError: on the CPU, which has no CUDA context.
        """
        if self.kind == "cpu":
            raise ConfigError("the cpu has no CUDA context; --cuda-loading applies to GPUs only")
        context = max(EAGER_CONTEXT_BYTES, CONTEXT_BYTES.get(self.arch, 0))
        if self.total_bytes is not None and context >= self.total_bytes:
            raise ConfigError(
                f"an eager-loading context of {format_bytes(context)} leaves nothing of "
                f"{format_bytes(self.total_bytes)} on {self.name}; measure the context (batchfit calibrate)"
            )
        return replace(self, context_bytes=context, context_source="eager", context_detail=reason)

    def describe_context(self) -> str:
        """One line: the context size assumed, and where it comes from."""
        if self.kind == "cpu":
            return "no CUDA context (cpu)"
        size = format_bytes(self.context_bytes)
        if self.context_source == "eager":
            return f"{size}: eager module loading ({self.context_detail}), Hugging Face's V100 / CUDA 11.2 figure"
        if self.context_source == "profile":
            return f"{size}: measured by batchfit calibrate ({self.context_detail})"
        if self.context_source == "override":
            return f"{size}: given ({self.context_detail})"
        where = CONTEXT_MEASURED_ON.get(self.arch or "", f"{self.arch or 'generic'} estimate")
        return f"{size}: default, lazy module loading (CUDA >= 11.7), {where}"


def _gpu(
    name: str,
    total_bytes: int,
    arch: str,
    cc: tuple[int, int],
    bandwidth_gbps: float,
    bf16_tflops: float,
    multiprocessors: int,
    aliases: tuple[str, ...] = (),
) -> Device:
    """Build a catalog entry; bf16, context and workspace follow from arch and cc so they stay consistent."""
    return Device(
        name=name,
        kind="cuda",
        total_bytes=total_bytes,
        arch=arch,
        compute_capability=cc,
        bf16=cc >= (8, 0),
        context_bytes=CONTEXT_BYTES[arch],
        cublas_workspace_bytes=cublas_workspace_for(cc),
        memory_bandwidth_gbps=bandwidth_gbps,
        bf16_tflops=bf16_tflops,
        aliases=aliases,
        multiprocessors=multiprocessors,
    )


# total_bytes: deviceQuery "Total amount of global memory" bytes, or torch's printed total_memory (MiB,
# rounded down) where no deviceQuery was found. Bandwidth and tensor peaks: NVIDIA datasheets/whitepapers
# (dense, no sparsity; GeForce figures with fp32 accumulate). Multiprocessors: the same documents (SXM parts).
_CATALOG: tuple[Device, ...] = (
    # deviceQuery, CUDA 9.0 and 10.2: 16160 MBytes (16945512448 bytes); cudaMemGetInfo total agrees.
    _gpu("V100-16GB", 16945512448, "Volta", (7, 0), 900, 125, 80, ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB")),
    # deviceQuery, driver CUDA 12.9: 32494 MBytes (34072559616 bytes); 32510 MiB with 11.x drivers.
    _gpu("V100-32GB", 34072559616, "Volta", (7, 0), 900, 125, 80, ("Tesla V100-SXM2-32GB", "V100-SXM2-32GB")),
    # deviceQuery, driver CUDA 12.5: 14918 MBytes (15642329088 bytes); 15110 MiB with 11.x drivers.
    _gpu("T4", 15642329088, "Turing", (7, 5), 320, 65, 40, ("Tesla T4",)),
    # torch 2.15 (cu130) get_device_properties: total_memory=22587MB; nvidia-smi Total 23028 MiB.
    # AWS publishes no tensor peak; ~70 fp16 TFLOPS per baseten.co "NVIDIA A10 vs A10G".
    _gpu("A10G", 22587 * MiB, "Ampere", (8, 6), 600, 70, 80, ("NVIDIA A10G",)),
    # deviceQuery, driver CUDA 12.2: 22491 MBytes (23583784960 bytes) (bottlerocket-kernel-kit PR #139).
    _gpu("L4", 23583784960, "Ada", (8, 9), 300, 121, 58, ("NVIDIA L4",)),
    # deviceQuery (cuda-device-query crate README), driver CUDA 12.4: 45373 MBytes (47576711168 bytes).
    _gpu("L40S", 47576711168, "Ada", (8, 9), 864, 362, 142, ("NVIDIA L40S",)),
    # deviceQuery, driver CUDA 12.2: 24238 MBytes (25414860800 bytes); 24268 MiB with an 11.8 driver.
    _gpu("RTX-3090", 25414860800, "Ampere", (8, 6), 936, 71, 82, ("3090", "NVIDIA GeForce RTX 3090")),
    # deviceQuery, driver CUDA 13.0: 24081 MBytes (25250627584 bytes); 24210 MiB with 12.4
    # (thamada/nvidia-smi gls/RTX4090_deviceQuery.py), 24564 MiB with 12.1.
    _gpu("RTX-4090", 25250627584, "Ada", (8, 9), 1008, 165, 128, ("4090", "NVIDIA GeForce RTX 4090")),
    # deviceQuery, driver CUDA 12.7: 48790 MBytes (51160023040 bytes).
    _gpu("A6000", 51160023040, "Ampere", (8, 6), 768, 155, 84, ("RTX A6000", "NVIDIA RTX A6000")),
    # deviceQuery, driver CUDA 12.2: 40339 MBytes (42298834944 bytes) (bottlerocket PR #3873);
    # nvidia-smi Total 40960 MiB; older drivers: total_memory=40536MB.
    _gpu("A100-40GB", 42298834944, "Ampere", (8, 0), 1555, 312, 108, ("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB")),
    # deviceQuery, driver CUDA 12.5: 81158 MBytes (85100068864 bytes) (thamada/nvidia-smi
    # nvsim/A100SXMx4_deviceQuery.py); 81051 MiB with 12.2; nvidia-smi Total 81920 MiB.
    _gpu("A100-80GB", 85100068864, "Ampere", (8, 0), 2039, 312, 108, ("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB")),
    # deviceQuery (NGC cuda-sample container), driver CUDA 13.0: 81079 MBytes (85017755648 bytes); 81106
    # with 12.7 (thamada/nvidia-smi nvsim/H100SXMx8_deviceQuery.py); nvidia-smi Total 81559 MiB.
    _gpu("H100-80GB", 85017755648, "Hopper", (9, 0), 3350, 989, 132, ("H100", "NVIDIA H100 80GB HBM3")),
    # torch get_device_properties(0).total_memory on an H200 (driver 580, CUDA 13.0, measured by batchfit
    # calibrate, benchmarks/results/profile-NVIDIA_H200-*.json): 150109880320 bytes; nvidia-smi 143771 MiB.
    _gpu("H200", 150109880320, "Hopper", (9, 0), 4800, 989, 132, ("H200-141GB", "NVIDIA H200")),
    # torch get_device_properties: total_memory=182631MB (182642MB on another host).
    _gpu("B200", 182631 * MiB, "Blackwell", (10, 0), 8000, 2250, 148, ("NVIDIA B200",)),
)

CPU = Device(
    name="cpu",
    kind="cpu",
    total_bytes=None,
    arch="",
    compute_capability=(0, 0),
    bf16=True,  # PyTorch runs bf16 on CPU (autocast's CPU default), if slowly without AVX512-BF16/AMX
    context_bytes=0,
    cublas_workspace_bytes=0,
    cublas_handles=0,
)

_HINT = "run `batchfit gpus` for the list, or give a capacity such as '24GiB'"
# Text meant as a capacity: a (signed) number first, or a separate byte-unit word last ("abc GiB").
_CAPACITY_LIKE = re.compile(r"^\s*[-+]?[0-9.]|\s[kmgt]i?b\s*$", re.IGNORECASE)
# A bare number is a model number ("5090"), not a byte count: a device capacity needs a unit.
_BARE_NUMBER = re.compile(r"^\s*[0-9.]+\s*$")


def _key(text: str) -> str:
    """Lookup key: case-insensitive, ignoring '-', '_' and spaces ("A100_40GB" == "a100-40gb")."""
    return re.sub(r"[-_\s]", "", text).lower()


def _build_index(devices: tuple[Device, ...]) -> dict[str, Device]:
    """Map every name and alias key to its device, refusing a key claimed by two devices."""
    index: dict[str, Device] = {}
    for device in (*devices, CPU):
        for spelling in (device.name, *device.aliases):
            key = _key(spelling)
            other = index.get(key)
            if other is not None and other.name != device.name:
                raise ValueError(f"alias {spelling!r} is claimed by both {other.name} and {device.name}")
            index[key] = device
    return index


_INDEX = _build_index(_CATALOG)


def catalog() -> list[Device]:
    """The catalog GPUs, smallest total memory first (ties by name), as a fresh list."""
    return sorted(_CATALOG, key=lambda d: (d.total_bytes or 0, d.name))


def generic_device(capacity: str) -> Device:
    """A CUDA device with ``capacity`` total memory and modern (Ampere, sm 8.0) defaults.

    Used when the GPU is not in the catalog: the capacity is what matters most, and the Ampere context
    and workspace constants are the middle of the range.

    Raises:
        ConfigError: the capacity cannot be read, is not positive, or is smaller than the context.
    """
    total = parse_bytes(capacity)
    context = CONTEXT_BYTES[DEFAULT_ARCH]
    if total <= context:
        raise ConfigError(
            f"capacity {capacity.strip()!r} is not more than the CUDA context ({format_bytes(context)}); "
            "give the GPU's total memory, e.g. '24GiB'"
        )
    return Device(
        name=capacity.strip(),
        kind="cuda",
        total_bytes=total,
        arch=DEFAULT_ARCH,
        compute_capability=DEFAULT_COMPUTE_CAPABILITY,
        bf16=True,
        context_bytes=context,
        cublas_workspace_bytes=cublas_workspace_for(DEFAULT_COMPUTE_CAPABILITY),
        multiprocessors=DEFAULT_MULTIPROCESSORS,
    )


def get_device(spec: str | Device) -> Device:
    """Resolve a device given as a Device, a catalog name or alias, ``"cpu"``, or a capacity.

    Names match case-insensitively and ignore '-', '_' and spaces, so "a100_40gb" and the name torch
    reports ("NVIDIA A100-SXM4-40GB") both work. A capacity ("24GiB", "16GB", "80 GiB") gives a generic
    CUDA device of that total (see :func:`generic_device`).

    Raises:
        UnknownNameError: not a known name and not written as a capacity; names close matches.
        ConfigError: written as a capacity but unreadable or not positive ("24XB", "0GiB").
    """
    if isinstance(spec, Device):
        return spec
    found = _INDEX.get(_key(spec))
    if found is not None:
        return found
    if _CAPACITY_LIKE.search(spec) and not _BARE_NUMBER.match(spec):
        return generic_device(spec)
    names = [d.name for d in catalog()] + [CPU.name]
    raise UnknownNameError("device", spec, names, hint=_HINT)
