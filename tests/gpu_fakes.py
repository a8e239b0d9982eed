"""Fakes of a GPU for calibration tests: a scripted ``calibrate.Gpu``, and fakes of ``torch.cuda`` and NVML."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch

from batchfit.gpu.profiles import ConvMeasurement, GpuIdentity
from batchfit.memory.kernels.cudnn import BACKWARD_DATA, FORWARD
from batchfit.runtime.calibrate import ConvShape
from batchfit.units import MiB

H100 = GpuIdentity(name="NVIDIA H100 80GB HBM3", driver="580.65.06", cuda="13.0", torch="2.11.0+cu130")
H100_TOTAL = 85017755648
PER_HANDLE = 32 * MiB + 4 * MiB  # cuBLAS + cuBLASLt workspaces of one handle


class FakeGpu:
    """A ``calibrate.Gpu`` whose readings are scripted.

    NVML's used memory and ``memory_reserved`` are read three times: after the first CUDA op, after the
    training steps and after the convolution runs. A convolution's workspace is ``k / 8`` of its operand
    bytes, ``k`` by mode and direction (1x1 kernels have half the ``k`` of the others in the forward).
    """

    USED = (600 * MiB, 1400 * MiB, 2000 * MiB)
    RESERVED = (2 * MiB, 300 * MiB, 500 * MiB)
    EIGHTHS = {(False, FORWARD): 2, (False, BACKWARD_DATA): 3, (True, FORWARD): 12, (True, BACKWARD_DATA): 8}
    EIGHTHS_FILTER = {False: 0, True: 4}

    def __init__(self, identity: GpuIdentity = H100, *, alive: int | None = 2 * PER_HANDLE, nvml: bool = True) -> None:
        self.id, self.alive, self.nvml = identity, alive, nvml
        self._used, self._reserved = iter(self.USED), iter(self.RESERVED)
        self.calls: list[str] = []
        self.benchmark = False
        self.modes: list[bool] = []
        self.batches: set[tuple[bool, int]] = set()

    def identity(self) -> GpuIdentity:
        return self.id

    def properties(self) -> dict[str, Any]:
        return {"total_bytes": H100_TOTAL, "compute_capability": (9, 0), "module_loading": "LAZY",
                "alloc_conf": "expandable_segments:True", "allocator_backend": "native", "cudnn_version": 91002,
                "conv_dtypes": [torch.float32, torch.bfloat16]}  # fmt: skip

    def init(self) -> None:
        self.calls.append("init")

    def process_used(self) -> int | None:
        return next(self._used) if self.nvml else None

    def reserved(self) -> int:
        return next(self._reserved)

    def cublas_workspace(self) -> int:
        self.calls.append("cublas")
        return PER_HANDLE

    def clear_cublas_workspaces(self) -> int | None:
        return self.alive

    def run_steps(self, quick: bool) -> list[str]:
        self.calls.append(f"steps quick={quick}")
        return ["mlp fp32", "mlp bf16"]

    def in_mode(self, benchmark: bool, fn: Callable[[], Any]) -> Any:
        self.modes.append(benchmark)
        self.benchmark = benchmark
        try:
            return fn()
        finally:
            self.benchmark = False

    def conv_workspace(self, shape: ConvShape, batch: int, dtype: torch.dtype, direction: str) -> ConvMeasurement:
        self.batches.add((self.benchmark, batch))
        size = dtype.itemsize
        out = (shape.size + 2 * shape.padding - shape.kernel) // shape.stride + 1
        operands = size * (batch * shape.in_channels * shape.size**2 + shape.out_channels * shape.in_channels
                           * shape.kernel**2 + batch * shape.out_channels * out**2)  # fmt: skip
        k = self.EIGHTHS.get((self.benchmark, direction), self.EIGHTHS_FILTER[self.benchmark])
        if direction == FORWARD and shape.kernel == 1:
            k //= 2
        return ConvMeasurement(shape.describe(batch), str(dtype).removeprefix("torch."), direction, self.benchmark,
                               operands, operands * k // 8)  # fmt: skip


class FakeCuda:
    """The parts of ``torch.cuda`` ``TorchGpu`` calls; ``peaks`` scripts ``max_memory_allocated``."""

    def __init__(self, *, available: bool = True, allocated: int = 0, peaks: Iterable[int] = (),
                 major: int = 9, minor: int = 0) -> None:  # fmt: skip
        self.available, self.allocated, self.reserved = available, allocated, 0
        self.peaks = iter(peaks)
        self.props = SimpleNamespace(name=H100.name, total_memory=H100_TOTAL, major=major, minor=minor,
                                     pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)  # fmt: skip
        self.resets = 0

    def is_available(self) -> bool:
        return self.available

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, index: int) -> SimpleNamespace:
        return self.props

    def synchronize(self) -> None:
        pass

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.reserved

    def max_memory_allocated(self) -> int:
        return next(self.peaks)

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1


class FakeNvml:
    """pynvml's calls: per-process memory for ``processes`` (pid -> bytes), device used memory ``used``."""

    class NVMLError(Exception):
        pass

    def __init__(self, *, used: int = 0, processes: dict[int, int | None] | None = None, missing: bool = False,
                 driver: bytes | str = b"580.65.06") -> None:  # fmt: skip
        self.used, self.processes, self.missing, self.driver = used, processes or {}, missing, driver
        self.shutdowns = 0
        self.handles: list[int | str] = []

    def nvmlInit(self) -> None:
        if self.missing:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> bytes | str:
        return self.driver

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.handles.append(uuid)
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.handles.append(index)
        return "handle"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(used=self.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=n) for pid, n in self.processes.items()]


def this_pid() -> int:
    return os.getpid()
