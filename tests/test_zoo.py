"""Every architecture of the zoo (``tests/zoo.py``): exact on the CPU, and a GPU estimate that succeeds.

The CPU estimate must equal the CPU allocator's peak of the same two training steps run for real
(``measure_cpu_peak``), to the byte, unless the entry states a tolerance and its reason. The GPU
estimate (an A100-80GB, the default context) must run and account for the CPU trace's storages.
``benchmarks/zoo.py`` prints the same comparison as a table.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from zoo import ZOO, Entry

import batchfit
from batchfit.memory.measure import measure_cpu_peak
from batchfit.models import hf

pytestmark = pytest.mark.skipif(not hf.available(), reason="the zoo's transformers models need transformers")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _cases() -> list:
    return [pytest.param(e, id=e.name, marks=[pytest.mark.slow] if e.slow else []) for e in ZOO]


def test_the_zoo_is_broad() -> None:
    families = {e.family for e in ZOO}
    assert len(ZOO) >= 40
    assert {"decoder", "moe", "encoder", "encoder-decoder", "vision-cnn", "vit", "audio", "multimodal", "torch",
            "peft"} <= families  # fmt: skip
    assert all(e.reason for e in ZOO if e.tolerance > 0), "every tolerance says why"


@pytest.mark.parametrize("entry", _cases())
def test_cpu_estimate_is_the_allocator_peak(entry: Entry) -> None:
    workload = entry.make()
    est = batchfit.estimate(workload, entry.batch_size, device="cpu")
    real = measure_cpu_peak(workload, entry.batch_size)
    assert sum(est.breakdown.values()) == est.peak_allocated_bytes
    if entry.tolerance:
        assert abs(est.peak_allocated_bytes - real) <= entry.tolerance * real, entry.reason
    else:
        assert est.peak_allocated_bytes == real
    gpu = batchfit.estimate(workload, entry.batch_size, device="A100-80GB")
    assert gpu.peak_reserved_bytes >= gpu.peak_allocated_bytes > 0
    assert gpu.device_total_bytes == gpu.peak_reserved_bytes + gpu.context_bytes


def test_an_estimate_does_not_depend_on_a_cache_a_real_run_filled_before_it() -> None:
    """BEiT caches its relative position index per window size in a module-level ``lru_cache``: a real
    step run earlier in the process leaves it warm, and the estimate is still the first step's."""
    from zoo import BY_NAME

    workload = BY_NAME["beit-relpos"].make()
    measure_cpu_peak(workload, 2)  # the cache now holds a real index for this window
    est = batchfit.estimate(workload, 2, device="cpu")
    assert est.peak_allocated_bytes == measure_cpu_peak(workload, 2)
