"""The simulated device: a GPU's capacity enforced on real CPU tensors, through the allocator model."""

from __future__ import annotations

import pytest
import torch

from batchfit import SimulatedDevice, get_device

MiB = 2**20


def test_oom_exactly_where_the_allocator_runs_out() -> None:
    with SimulatedDevice("64MiB") as gpu:
        a = torch.empty(10 * MiB // 4 * 4)  # 40 MiB of fp32: one 40 MiB segment
        assert gpu.stats().reserved_bytes == 40 * MiB
        b = torch.empty(5 * MiB // 4)  # 5 MiB: a new 20 MiB segment, 60 MiB reserved
        assert gpu.stats().reserved_bytes == 60 * MiB
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            torch.empty(5 * MiB // 4 * 4)  # 20 MiB more does not fit in the 4 MiB left
        del a, b


def test_freed_tensors_return_their_blocks_and_retry_frees_the_cache() -> None:
    with SimulatedDevice("64MiB") as gpu:
        a = torch.empty(10 * MiB)  # 40 MiB
        del a
        assert gpu.stats().allocated_bytes == 0 and gpu.stats().reserved_bytes == 40 * MiB
        b = torch.empty(12 * MiB)  # 48 MiB: fits only once the cached 40 MiB segment is released
        assert gpu.stats().num_alloc_retries == 1
        assert gpu.stats().reserved_bytes == 48 * MiB
        del b


def test_track_puts_existing_tensors_on_the_device() -> None:
    model = torch.nn.Linear(1024, 1024)  # 4 MiB + 4 KiB
    with SimulatedDevice("1GiB") as gpu:
        gpu.track(model)
        assert gpu.stats().allocated_bytes == 4 * MiB + 4096


def test_a_catalog_gpu_gives_its_capacity_less_the_context() -> None:
    dev = get_device("T4")
    sim = SimulatedDevice("T4")
    assert sim.capacity_bytes == dev.total_bytes - dev.context_bytes


def test_nothing_is_tracked_after_exit() -> None:
    sim = SimulatedDevice("64MiB")
    with sim:
        a = torch.empty(10)
    before = sim.stats().allocated_bytes
    b = torch.empty(10 * MiB)
    assert sim.stats().allocated_bytes == before
    del a, b
