"""The live monitor, with fakes of torch.cuda and NVML (no GPU runs tests)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import batchfit
from batchfit.runtime.monitor import OTHER, MemoryMonitor, live_by_category, requested_bytes
from batchfit.units import GiB, MiB

OOM_TEXT = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB of which 1.00 GiB is free."
)


class FakeCuda:
    """The memory functions of torch.cuda the monitor calls, driven by plain attributes."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.free = 0
        self.total = 16 * GiB
        self.resets: list[int] = []

    def reset_peak_memory_stats(self, device: int) -> None:
        self.resets.append(device)
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def max_memory_allocated(self, device: int) -> int:
        return self.peak_allocated

    def max_memory_reserved(self, device: int) -> int:
        return self.peak_reserved

    def memory_allocated(self, device: int) -> int:
        return self.allocated

    def memory_reserved(self, device: int) -> int:
        return self.reserved

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return self.free, self.total

    def get_device_properties(self, device: int) -> SimpleNamespace:
        return SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0, total_memory=self.total)


class NVMLError(Exception):
    pass


class FakeNvml:
    """pynvml's calls the monitor makes; ``missing`` mimics NVMLError_LibraryNotFound."""

    NVMLError = NVMLError

    def __init__(self, used: int = 0, missing: bool = False) -> None:
        self.used, self.missing = used, missing
        self.bus_ids: list[bytes] = []
        self.shutdown = False

    def nvmlInit(self) -> None:
        if self.missing:
            raise NVMLError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByPciBusId(self, bus: bytes) -> str:
        self.bus_ids.append(bus)
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return "handle"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(used=self.used, total=16 * GiB, free=16 * GiB - self.used)

    def nvmlShutdown(self) -> None:
        self.shutdown = True


def _estimate(**kw):
    base = batchfit.estimate("mlp", 32, device="V100-16GB")
    return dataclasses.replace(base, **kw) if kw else base


def test_each_step_reads_the_peaks_and_nvml_next_to_the_estimate() -> None:
    cuda, nvml = FakeCuda(), FakeNvml(used=12 * GiB)
    est = _estimate(peak_allocated_bytes=10 * GiB, peak_reserved_bytes=11 * GiB, device_total_bytes=int(11.3 * GiB))
    monitor = MemoryMonitor(est, cuda=cuda, nvml=nvml)
    with monitor.step():
        cuda.peak_allocated, cuda.peak_reserved = int(10.2 * GiB), 13 * GiB
    reading = monitor.history[-1]
    assert cuda.resets == [0]
    assert reading.step == 0
    assert reading.peak_allocated_bytes == int(10.2 * GiB) and reading.peak_reserved_bytes == 13 * GiB
    assert reading.device_used_bytes == 12 * GiB
    assert reading.estimated_peak_reserved_bytes == 11 * GiB
    assert reading.reserved_error == pytest.approx(2 / 11)
    text = reading.describe()
    assert "peak allocated 10.20 GiB (estimate 10.00 GiB, +2%)" in text
    assert "reserved 13.00 GiB (estimate 11.00 GiB, +18% !)" in text
    assert "device used 12.00 GiB" in text
    assert nvml.bus_ids == [b"00000000:3b:00.0"]
    monitor.close()
    assert nvml.shutdown


def test_without_nvml_the_device_figure_is_missing_and_says_why() -> None:
    monitor = MemoryMonitor(cuda=FakeCuda(), nvml=FakeNvml(missing=True))
    reading = monitor.end_step()
    assert reading.device_used_bytes is None
    assert "Not Found" in monitor.nvml_error
    assert "device used" not in reading.describe()
    assert "estimate" not in reading.describe()


def test_the_real_nvml_is_absent_here_and_handled() -> None:
    # No driver on CI machines: pynvml raises NVMLError_LibraryNotFound (or is not installed).
    monitor = MemoryMonitor(cuda=FakeCuda())
    assert monitor.device_used_bytes() is None
    assert monitor.nvml_error


def test_requested_bytes_reads_pytorchs_message() -> None:
    assert requested_bytes(RuntimeError(OOM_TEXT)) == 2 * GiB
    assert requested_bytes(RuntimeError("Tried to allocate 512.00 MiB.")) == 512 * MiB
    assert requested_bytes(RuntimeError("something else")) is None


def _model_and_optimizer():
    model = nn.Linear(256, 256)  # 65,792 params: 263,168 bytes of fp32
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def test_live_by_category_counts_each_storage_once_in_allocator_blocks() -> None:
    model, opt = _model_and_optimizer()
    live = live_by_category(10 * MiB, model, opt)
    weight_block, bias_block = 256 * 256 * 4, 1024  # both multiples of 512 already
    assert live["parameters"] == weight_block + bias_block
    assert live["gradients"] == weight_block + bias_block
    assert live["optimizer_states"] == 2 * (weight_block + bias_block) + 2 * 512  # two moments + two step counters
    assert live[OTHER] == 10 * MiB - sum(v for k, v in live.items() if k != OTHER)


def test_diagnosis_bounded_from_the_failed_step_without_an_estimate() -> None:
    cuda = FakeCuda()
    cuda.allocated, cuda.reserved, cuda.free = 14 * GiB, 15 * GiB, GiB // 2
    model, opt = _model_and_optimizer()
    d = MemoryMonitor(cuda=cuda, nvml=FakeNvml(missing=True)).diagnose(
        RuntimeError(OOM_TEXT), model=model, optimizer=opt, micro_batch_size=32
    )
    assert d.available_bytes == int(15.5 * GiB) and d.requested_bytes == 2 * GiB
    fixed = sum(v for k, v in d.live_by_category.items() if k != OTHER)
    per_item = (16 * GiB - fixed) / 32  # at least allocated + request - fixed, per item
    assert d.suggested_micro_batch_size == int((15.5 * GiB - fixed) // per_item) == 30
    text = d.advice()
    assert "out of memory at micro-batch 32 on cuda:0: asked for 2.00 GiB with 14.00 GiB allocated" in text
    assert "--micro-batch-size 30" in text and "at most" in text


def test_diagnosis_halves_when_the_failed_step_bounds_nothing() -> None:
    cuda = FakeCuda()
    cuda.allocated, cuda.reserved, cuda.free = 12 * GiB, 14 * GiB, 1 * GiB
    d = MemoryMonitor(cuda=cuda, nvml=FakeNvml(missing=True)).diagnose(RuntimeError(OOM_TEXT), micro_batch_size=32)
    assert d.suggested_micro_batch_size == 16
    assert "half the failed micro-batch" in d.advice()
    no_size = MemoryMonitor(cuda=cuda, nvml=FakeNvml(missing=True)).diagnose(RuntimeError(OOM_TEXT))
    assert no_size.suggested_micro_batch_size is None and "pass the micro-batch size" in no_size.advice()


def test_diagnosis_from_the_estimate_scales_its_per_item_memory() -> None:
    cuda = FakeCuda()
    cuda.allocated, cuda.reserved, cuda.free = 12 * GiB, 14 * GiB, 2 * GiB
    breakdown = {
        "parameters": 1 * GiB,
        "gradients": 1 * GiB,
        "optimizer_states": 2 * GiB,
        "activations": 8 * GiB,
        "batch_data": 0,
        "temporaries": 0,
    }
    est = _estimate(batch_size=16, breakdown=breakdown, peak_reserved_bytes=12 * GiB)
    d = MemoryMonitor(est, cuda=cuda, nvml=FakeNvml(missing=True)).diagnose(RuntimeError(OOM_TEXT), micro_batch_size=8)
    # 0.5 GiB per item from the estimate ((12 - 4) GiB / 16); (16 - 4) GiB free for it: 24 items, but 8 failed.
    assert d.suggested_micro_batch_size == 7
    assert "expected micro-batch 8 to fit" in d.advice()


def test_diagnosis_when_the_fixed_part_alone_does_not_fit() -> None:
    cuda = FakeCuda()
    model, opt = _model_and_optimizer()
    fixed = sum(live_by_category(0, model, opt).values())
    cuda.allocated, cuda.reserved, cuda.free = fixed, fixed, 0
    d = MemoryMonitor(cuda=cuda, nvml=FakeNvml(missing=True)).diagnose(
        RuntimeError(OOM_TEXT), model=model, optimizer=opt, micro_batch_size=1
    )
    assert d.suggested_micro_batch_size == 0
    assert "no micro-batch fits" in d.advice()
