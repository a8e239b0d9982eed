"""Measuring a GPU for a device profile (``batchfit calibrate``): what the estimator can only assume.

``calibrate_device`` measures, on this GPU with this driver, CUDA and torch, in this order (each step
needs the state the one before left):

1. who it is: GPU name and memory, driver (NVML), CUDA, torch and cuDNN versions, the module-loading
   mode (``CUDA_MODULE_LOADING`` as the runtime saw it: torch sets ``LAZY`` when it is unset) and the
   allocator's settings (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, the backend);
2. the bare context: NVML's used memory for this process after the first CUDA op, less
   ``memory_reserved``;
3. the cuBLAS and cuBLASLt workspaces of one handle: what ``memory_allocated`` gains at the first
   GEMM and the first GEMM with a bias epilogue, less their outputs (``CublasHandlePool.cpp`` takes
   them from the caching allocator);
4. real training steps of small workloads (an MLP, a ResNet-style CNN, a small GPT; fp32 and a
   16-bit autocast), after which NVML's used memory less ``memory_reserved`` is the context with every
   library a step loads: the profile's context. Clearing the cuBLAS workspaces then shows how many
   handles a step keeps;
5. cuDNN convolution workspaces for a few shapes, each direction, with cuDNN's heuristics and with
   ``torch.backends.cudnn.benchmark``: the peak of ``memory_allocated`` during a call above what was
   allocated before it and its output; each mode runs in a fresh thread (PyTorch's cuDNN v8 plan cache
   is thread-local) on its own batch size (the legacy cache is global). The ratios to the operands'
   bytes (``memory/kernels/cudnn.py``) are the largest measured, per direction. The context after the benchmark
   runs (which load every engine's kernels) is kept too.

Every GPU access goes through a ``Gpu`` (``TorchGpu`` on a real one), so the assembly is tested with a
fake, and ``TorchGpu``'s measurements with fakes of ``torch.cuda`` and NVML.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import torch

from .._version import __version__
from ..errors import NoGpuError
from ..gpu.catalog import ConvWorkspace
from ..gpu.context import detect_module_loading
from ..gpu.profiles import ConvMeasurement, DeviceProfile, GpuIdentity
from ..gpu.real_gpu import driver_version
from ..memory.allocator.caching import round_size
from ..memory.kernels.cudnn import BACKWARD_DATA, BACKWARD_FILTER, BENCHMARK_WORKSPACE, FORWARD, HEURISTIC_WORKSPACE
from ..memory.steps import build_for_steps, run_workload_steps
from ..precision import policy_for
from ..sources import presets

DIRECTIONS = (FORWARD, BACKWARD_DATA, BACKWARD_FILTER)


@dataclass(frozen=True)
class ConvShape:
    """One 2-d convolution to measure: input ``(batch, in_channels, size, size)``, square kernel."""

    in_channels: int
    out_channels: int
    size: int
    kernel: int
    stride: int = 1
    padding: int = 0

    def describe(self, batch: int) -> str:
        c, k, n = self.in_channels, self.kernel, self.size
        x, w = f"x={batch}x{c}x{n}x{n}", f"w={self.out_channels}x{c}x{k}x{k}"
        return f"{x} {w} stride={self.stride} padding={self.padding} groups=1"


# ResNet-style layers: a 3x3 at stage 1, a strided 3x3 and a 1x1 bottleneck, a 7x7 stem and a deep 3x3.
QUICK_SHAPES = (ConvShape(64, 64, 56, 3, 1, 1), ConvShape(128, 256, 28, 3, 2, 1), ConvShape(256, 64, 56, 1))
SHAPES = (*QUICK_SHAPES, ConvShape(3, 64, 224, 7, 2, 3), ConvShape(512, 512, 14, 3, 1, 1))
HEURISTIC_BATCH, BENCHMARK_BATCH = 16, 24
"""Batch sizes of the two modes: different shapes never share a cached plan."""


class Gpu(Protocol):
    """What calibration asks of a GPU (``TorchGpu`` is the real one)."""

    def identity(self) -> GpuIdentity: ...
    def properties(self) -> dict[str, Any]: ...
    def init(self) -> None: ...
    def process_used(self) -> int | None: ...
    def reserved(self) -> int: ...
    def cublas_workspace(self) -> int: ...
    def clear_cublas_workspaces(self) -> int | None: ...
    def run_steps(self, quick: bool) -> list[str]: ...
    def conv_workspace(self, shape: ConvShape, batch: int, dtype: torch.dtype, direction: str) -> ConvMeasurement: ...
    def in_mode(self, benchmark: bool, fn: Callable[[], Any]) -> Any: ...


def calibrate_device(gpu: Gpu, *, quick: bool = False, progress: Callable[[str], None] | None = None) -> DeviceProfile:
    """Measure ``gpu`` (see the module docstring) and return its device profile.

    Args:
        gpu: the GPU seam (``TorchGpu()`` for the real one).
        quick: three convolution shapes instead of five.
        progress: called with a line before each stage (the command line prints them).
    """
    say = progress or (lambda line: None)
    say("identifying the GPU")
    identity, props = gpu.identity(), gpu.properties()
    gpu.init()
    bare = _outside(gpu)
    say("measuring the cuBLAS workspace of one handle")
    per_handle = gpu.cublas_workspace()
    say("running real training steps")
    steps = gpu.run_steps(quick)
    context = _outside(gpu)
    alive = gpu.clear_cublas_workspaces()
    handles = 2 if alive is None or per_handle <= 0 else max(1, round(alive / per_handle))
    measured: list[ConvMeasurement] = []
    for benchmark, batch in ((False, HEURISTIC_BATCH), (True, BENCHMARK_BATCH)):
        say(f"measuring cuDNN convolution workspaces ({'benchmark' if benchmark else 'heuristics'})")
        measured += gpu.in_mode(benchmark, lambda b=batch: _convs(gpu, b, props["conv_dtypes"], quick))
    context_benchmark = max(context, _outside(gpu))
    return DeviceProfile(
        gpu=identity,
        total_bytes=int(props["total_bytes"]),
        compute_capability=tuple(props["compute_capability"]),  # type: ignore[arg-type]
        module_loading=str(props["module_loading"]),
        context_bytes=context,
        cublas_workspace_bytes=per_handle,
        cublas_handles=handles,
        conv_workspace=ratios(measured, benchmark=False),
        conv_workspace_benchmark=ratios(measured, benchmark=True),
        context_benchmark_bytes=context_benchmark,
        bare_context_bytes=bare,
        cudnn_version=props.get("cudnn_version"),
        alloc_conf=str(props.get("alloc_conf", "")),
        allocator_backend=str(props.get("allocator_backend", "native")),
        conv_measurements=tuple(measured),
        steps=tuple(steps),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        batchfit_version=_batchfit_version(),
        extra={"cublas_workspaces_alive_bytes": alive},
    )


def ratios(measured: list[ConvMeasurement], *, benchmark: bool) -> ConvWorkspace:
    """The largest workspace per operand byte measured in each direction (the model's default where
    a direction has no measurement)."""
    default = BENCHMARK_WORKSPACE if benchmark else HEURISTIC_WORKSPACE
    out = {}
    for direction, attr in zip(DIRECTIONS, ("forward", "backward_data", "backward_filter")):
        rows = [m for m in measured if m.benchmark == benchmark and m.direction == direction and m.operand_bytes]
        out[attr] = max((m.workspace_bytes / m.operand_bytes for m in rows), default=getattr(default, attr))
    return ConvWorkspace(**out)


def _outside(gpu: Gpu) -> int:
    """Memory this process uses outside the caching allocator: NVML's figure less ``memory_reserved``."""
    used = gpu.process_used()
    if used is None:
        raise NoGpuError("NVML cannot report this GPU's used memory (install nvidia-ml-py); calibrate needs it")
    return max(0, used - gpu.reserved())


def _convs(gpu: Gpu, batch: int, dtypes: list[torch.dtype], quick: bool) -> list[ConvMeasurement]:
    out = []
    for dtype in dtypes:
        for shape in QUICK_SHAPES if quick else SHAPES:
            for direction in DIRECTIONS:
                out.append(gpu.conv_workspace(shape, batch, dtype, direction))
    return out


def _batchfit_version() -> str:
    return __version__


# -- the real GPU ----------------------------------------------------------------------------------
def measure_transient(cuda: Any, run: Callable[[], Any], output_bytes: int) -> int:
    """Bytes a call allocates and frees inside itself: its peak above what was allocated before it and
    its output (rounded as the caching allocator rounds). ``cuda`` is ``torch.cuda`` or a fake."""
    cuda.synchronize()
    before = int(cuda.memory_allocated())
    cuda.reset_peak_memory_stats()
    result = run()
    cuda.synchronize()
    peak = int(cuda.max_memory_allocated())
    del result
    return max(0, peak - before - round_size(output_bytes))


class TorchGpu:
    """The ``Gpu`` of this process's CUDA device, through ``torch.cuda`` and NVML (both replaceable).

    Args:
        cuda: ``torch.cuda`` or a fake with its memory functions.
        nvml: the ``pynvml`` module or a fake; default: imported on first use.
        device: where tensors are made (``"cuda"``; tests run the ops on ``"cpu"`` with a fake ``cuda``).

    Raises:
        NoGpuError: no CUDA GPU is visible.
    """

    def __init__(self, cuda: Any = None, nvml: Any = None, device: str = "cuda", environ: Any = None) -> None:
        self.cuda = cuda if cuda is not None else torch.cuda
        if not self.cuda.is_available():
            raise NoGpuError("no CUDA GPU is visible here: run `batchfit calibrate` on the machine whose GPU you "
                             "want a profile of, then copy the profile or pass it with --profile")  # fmt: skip
        self.device, self.environ = device, os.environ if environ is None else environ
        self._nvml, self._handle = nvml, None
        self._baseline = self._device_used()  # before this process creates its context

    # -- identity and settings ---------------------------------------------------------------------
    def identity(self) -> GpuIdentity:
        props = self.cuda.get_device_properties(self.cuda.current_device())
        return GpuIdentity(str(props.name), driver_version(self._nvml), str(torch.version.cuda), str(torch.__version__))

    def properties(self) -> dict[str, Any]:
        props = self.cuda.get_device_properties(self.cuda.current_device())

        cc = (int(props.major), int(props.minor))
        env = self.environ
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return {
            "total_bytes": int(props.total_memory),
            "compute_capability": cc,
            "module_loading": detect_module_loading(env, torch.version.cuda)[0].upper(),
            "alloc_conf": env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or "",
            "allocator_backend": str(getattr(self.cuda, "get_allocator_backend", lambda: "native")()),
            "cudnn_version": cudnn,
            "conv_dtypes": [torch.float32, torch.bfloat16 if cc >= (8, 0) else torch.float16],
        }

    # -- memory outside the allocator ---------------------------------------------------------------
    def init(self) -> None:
        x = torch.ones(1, device=self.device)
        (x + 1).sum()
        self.cuda.synchronize()

    def reserved(self) -> int:
        self.cuda.synchronize()
        return int(self.cuda.memory_reserved())

    def process_used(self) -> int | None:
        """NVML's used memory of this process; where NVML cannot tell processes apart (containers), the
        device's used memory less what was used before this process created its context."""
        handle = self._nvml_handle()
        if handle is None:
            return None
        try:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if int(proc.pid) == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except Exception:  # noqa: BLE001 - fall back to the device's figure
            pass
        used = self._device_used()
        return None if used is None or self._baseline is None else used - self._baseline

    def _device_used(self) -> int | None:
        handle = self._nvml_handle()
        if handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:  # noqa: BLE001
            return None

    def _nvml_handle(self) -> Any:
        """NVML's handle of the GPU CUDA calls device 0, found without a CUDA call (so the baseline read in
        ``__init__`` precedes this process's context): ``CUDA_VISIBLE_DEVICES``'s first entry (an index or
        a UUID), else NVML's device 0."""
        if self._handle is not None:
            return self._handle
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py

                self._nvml = pynvml
            self._nvml.nvmlInit()
            first = self.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            if first.startswith(("GPU-", "MIG-")):
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(first)
            else:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)
        except Exception:  # noqa: BLE001 - no NVML: process_used says None
            self._handle = None
        return self._handle

    # -- cuBLAS -----------------------------------------------------------------------------------------
    def cublas_workspace(self) -> int:
        a = torch.ones(64, 64, device=self.device)  # 16 KiB, an exact allocator block
        bias = torch.ones(64, device=self.device)
        gemm = measure_transient(self.cuda, lambda: a @ a, 0)  # the workspace stays: it is the "transient"
        lt = measure_transient(self.cuda, lambda: torch.addmm(bias, a, a), 0)  # bias epilogue: cuBLASLt
        return max(0, gemm - round_size(a.nbytes)) + max(0, lt - round_size(a.nbytes))

    def clear_cublas_workspaces(self) -> int | None:
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is None:
            return None
        self.cuda.synchronize()
        before = int(self.cuda.memory_allocated())
        clear()
        return max(0, before - int(self.cuda.memory_allocated()))

    # -- training steps ------------------------------------------------------------------------------
    def run_steps(self, quick: bool) -> list[str]:
        cc = self.properties()["compute_capability"]
        low = "bf16" if cc >= (8, 0) else "fp16"
        workloads = [("mlp", {}), ("cnn", {}), ("gpt", dict(n_layer=2, n_embd=128, n_head=4, seq_len=128,
                                                              vocab_size=1024))]  # fmt: skip
        done = []
        for name, overrides in workloads[: 2 if quick else 3]:
            for precision in ("fp32", low):
                wl = presets.get(name, **overrides)
                policy = policy_for(precision, bf16_supported=cc >= (8, 0), device_name="calibration")
                model, optimizer = build_for_steps(wl, policy.param_dtype, (), device=self.device)
                run_workload_steps(wl, model, optimizer, 8, param_dtype=policy.param_dtype,
                                   autocast=policy.autocast(self.device), move=lambda t: t.to(self.device))  # fmt: skip
                del model, optimizer
                gc.collect()
                done.append(f"{name} {precision}")
        self.cuda.synchronize()
        return done

    # -- cuDNN convolutions -----------------------------------------------------------------------------
    def in_mode(self, benchmark: bool, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` with ``torch.backends.cudnn.benchmark`` set, in a fresh thread (fresh plan caches)."""
        result: list[Any] = []
        errors: list[BaseException] = []

        def target() -> None:
            try:
                with torch.backends.cudnn.flags(enabled=True, benchmark=benchmark, deterministic=False):
                    result.append(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

        thread = threading.Thread(target=target, name=f"calibrate-cudnn-{'benchmark' if benchmark else 'heur'}")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return result[0]

    def conv_workspace(self, shape: ConvShape, batch: int, dtype: torch.dtype, direction: str) -> ConvMeasurement:
        aten = torch.ops.aten
        k, s, p = shape.kernel, [shape.stride] * 2, [shape.padding] * 2
        x = torch.randn(batch, shape.in_channels, shape.size, shape.size, device=self.device, dtype=dtype)
        w = torch.randn(shape.out_channels, shape.in_channels, k, k, device=self.device, dtype=dtype)
        y = aten.convolution.default(x, w, None, s, p, [1, 1], False, [0, 0], 1)
        mask, out = {FORWARD: (None, y), BACKWARD_DATA: ([True, False, False], x),
                     BACKWARD_FILTER: ([False, True, False], w)}[direction]  # fmt: skip

        def call() -> Any:
            if mask is None:
                return aten.convolution.default(x, w, None, s, p, [1, 1], False, [0, 0], 1)
            return aten.convolution_backward.default(y, x, w, None, s, p, [1, 1], False, [0, 0], 1, mask)

        call()  # the first call picks the engine (and, with benchmark, times them all) and loads its kernels
        workspace = measure_transient(self.cuda, call, out.nbytes)
        operands = x.nbytes + w.nbytes + y.nbytes
        return ConvMeasurement(shape.describe(batch), str(dtype).removeprefix("torch."), direction,
                               bool(torch.backends.cudnn.benchmark), operands, workspace)  # fmt: skip
