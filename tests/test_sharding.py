"""FSDP's memory on one rank, derived from the single-GPU trace, against ``fully_shard`` on two processes.

``tests/fsdp_memory_worker.py`` shards each workload with FSDP2 (gloo on the CPU, two ranks started as
torchrun would start them, forked from a warm fork server: ``tests/launch.py``) and measures rank 0's local
parameter, gradient and optimizer-state storages; here the same workloads are traced once and ``shard_trace``
derives rank 0's trace arithmetically. The bytes must be equal.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from fsdp_memory_worker import BATCH_SIZE, WORKLOADS
from launch import run_script

from batchfit.gpu.catalog import get_device
from batchfit.memory.categories import Category
from batchfit.memory.estimate import trace_for_device
from batchfit.memory.synthesis.sharding import shard_bytes, shard_trace
from batchfit.memory.trace.fake_step import MemoryTrace, trace_workload
from batchfit.precision import policy_for
from batchfit.workload import ParallelLayout

WORKER = Path(__file__).with_name("fsdp_memory_worker.py")
_MEASURED = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATES)


def most_alive(trace: MemoryTrace, category: Category) -> int:
    """The most bytes of ``category`` alive at once in ``trace`` (one step's gradients, all the weights)."""
    alive = most = 0
    for is_alloc, sid, nbytes in trace.allocations():
        if trace.role.get(sid) is category:
            alive += nbytes if is_alloc else -nbytes
            most = max(most, alive)
    return most


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, int]]:
    out = tmp_path_factory.mktemp("fsdp-memory") / "rank0.json"
    run = run_script(2, WORKER, str(out), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_sharded_trace_holds_what_fully_shard_keeps_on_rank_0(measured: dict, name: str) -> None:
    trace = trace_workload(WORKLOADS[name](), BATCH_SIZE, param_dtype=None, autocast=None)
    rank0 = shard_trace(trace, 2)
    for category in _MEASURED:
        assert most_alive(rank0, category) == measured[name][category.value], category


def test_uneven_rows_are_what_tells_the_shard_apart_from_half(measured: dict) -> None:
    # 33 rows on two ranks: rank 0 keeps 17 of them, more than half the bytes. Every workload of the
    # worker has such parameters, so a model that halves bytes would fail the test above.
    assert shard_bytes(33 * 18 * 4, 33, 2) == 17 * 18 * 4 > 33 * 18 * 4 // 2
    assert shard_bytes(7 * 4, 7, 8) == 4 and shard_bytes(4, 0, 2) == 4
    for name in WORKLOADS:
        whole = trace_workload(WORKLOADS[name](), BATCH_SIZE, param_dtype=None, autocast=None)
        assert measured[name]["parameters"] != -(-most_alive(whole, Category.PARAMETERS) // 2)


def _optimizer_temporaries(trace: MemoryTrace) -> int:
    """The most temporary bytes alive during the steady step's optimizer (FSDP's gather buffer aside)."""
    alive = most = 0
    for index, event in enumerate(trace.events):
        sid = event if event >= 0 else ~event
        if trace.role.get(sid) is not Category.TEMPORARIES or trace.op.get(sid) == "FSDP all-gather":
            continue
        alive += trace.nbytes[sid] if event >= 0 else -trace.nbytes[sid]
        if trace.phase_at(index) == ("optimizer", 1):
            most = max(most, alive)
    return most


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_foreach_optimizers_temporaries_are_shards_as_an_fsdp2_rank_makes_them(name: str) -> None:
    """NOTE [ The optimizer's temporaries under FSDP ]: AdamW(foreach=True), CUDA's default, makes its temporaries
    for every parameter at once; on a rank of ``fully_shard`` (traced on a fake process group) they are shards."""
    wl = dataclasses.replace(WORKLOADS[name](), optimizer=lambda ps: torch.optim.AdamW(ps, foreach=True))
    dev, policy = get_device("A100-40GB"), policy_for("fp32")
    whole = trace_for_device(wl, BATCH_SIZE, dev, policy, ())
    rank = trace_for_device(dataclasses.replace(wl, parallel=ParallelLayout(fsdp=2)), BATCH_SIZE, dev, policy, ())
    derived = _optimizer_temporaries(shard_trace(whole, 2))
    assert derived == _optimizer_temporaries(rank) < _optimizer_temporaries(whole)
