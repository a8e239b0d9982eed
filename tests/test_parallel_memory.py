"""One rank of tensor, sequence and FSDP2 layouts, traced, against real gloo ranks: equal to the byte.

``tests/parallel_memory_worker.py`` splits a tiny Llama (its config written below, its plan the one
transformers publishes) with ``apply_layout`` on a real mesh of gloo ranks and measures each rank's
allocator peak and its local parameters, gradients and optimizer states. Here the same workload is
estimated on ``device="cpu"`` as rank 0 of a fake process group. Every number must be equal. The ranks are
started as torchrun would start them, forked from a warm fork server (``tests/launch.py``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hf_tiny import llama_config_dir
from launch import LIBRARIES, run_script
from test_sharding import most_alive

import batchfit
from batchfit.memory.categories import Category
from batchfit.sources import load
from batchfit.workload import ParallelLayout

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("parallel_memory_worker.py")
SEQ_LEN, BATCH_SIZE = 16, 4
LAYOUTS = {
    "tp2": ParallelLayout(tensor_parallel=2),
    "tp2-sp": ParallelLayout(tensor_parallel=2, sequence_parallel=True),
    "tp2-fsdp2": ParallelLayout(tensor_parallel=2, fsdp=2),
    "tp2-sp-fsdp2": ParallelLayout(tensor_parallel=2, sequence_parallel=True, fsdp=2),
}


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_config_dir(tmp_path_factory.mktemp("tiny-llama"))


def _measure(config_dir: Path, out: Path, names: list[str]) -> dict:
    nproc = LAYOUTS[names[0]].world_size
    run = run_script(nproc, WORKER, str(out), str(config_dir), str(SEQ_LEN), str(BATCH_SIZE), *names, timeout=300,
                     preload=LIBRARIES)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _measured_once(config_dir: Path, run_dir: Path, names: list[str]) -> dict:
    """The ranks of ``names``, started once per run: the first of xdist's workers to take the lock in the run's
    shared directory starts them, while the other waits and reads what they wrote."""
    from filelock import FileLock  # torch's own dependency

    out = run_dir / f"gloo-ranks-{'-'.join(names)}.json"
    with FileLock(f"{out}.lock"):
        if not out.exists():
            return _measure(config_dir, out, names)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def measured_two(config_dir: Path, run_dir: Path) -> dict:
    return _measured_once(config_dir, run_dir, ["tp2", "tp2-sp"])


@pytest.fixture(scope="module")
def measured_four(config_dir: Path, run_dir: Path) -> dict:
    return _measured_once(config_dir, run_dir, ["tp2-fsdp2", "tp2-sp-fsdp2"])


def _check(config_dir: Path, name: str, ranks: list[dict]) -> None:
    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import trace_for_device
    from batchfit.precision import policy_for

    wl = dataclasses.replace(load(str(config_dir), seq_len=SEQ_LEN), parallel=LAYOUTS[name])
    est = batchfit.estimate(wl, BATCH_SIZE, device="cpu")
    assert [r["peak"] for r in ranks] == [est.peak_allocated_bytes] * len(ranks)
    trace = trace_for_device(wl, BATCH_SIZE, get_device("cpu"), policy_for("fp32"), ())
    for category in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATES):
        assert most_alive(trace, category) == ranks[0][category.value], category
    assert any("traced on a fake process group" in note for note in est.notes)


@pytest.mark.parametrize("name", ["tp2", "tp2-sp"])
def test_a_tensor_parallel_rank_is_what_a_gloo_rank_holds(config_dir: Path, measured_two: dict, name: str) -> None:
    _check(config_dir, name, measured_two[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2-fsdp2", "tp2-sp-fsdp2"])
def test_a_rank_of_tensor_parallel_and_fsdp_is_what_a_gloo_rank_holds(
    config_dir: Path, measured_four: dict, name: str
) -> None:
    _check(config_dir, name, measured_four[name])


def test_each_split_holds_less_than_the_whole(config_dir: Path, measured_two: dict, measured_four: dict) -> None:
    # The layouts differ from one another and from one GPU's step: a model that ignored the layout (or
    # split everything by two) could not match all of them above.
    whole = batchfit.estimate(load(str(config_dir), seq_len=SEQ_LEN), BATCH_SIZE, device="cpu")
    peaks = [measured_two["tp2"][0]["peak"], measured_two["tp2-sp"][0]["peak"],
             measured_four["tp2-fsdp2"][0]["peak"], measured_four["tp2-sp-fsdp2"][0]["peak"]]  # fmt: skip
    assert len(set(peaks)) == 4 and max(peaks) < whole.peak_allocated_bytes
    assert all(p != whole.peak_allocated_bytes // 2 for p in peaks)


@pytest.mark.parametrize(("name", "checkpointing"), [("tp2-sp", False), ("tp2-fsdp2", False), ("tp2-sp-fsdp2", False),
                                                      ("tp2-sp-fsdp2", True)])  # fmt: skip
def test_a_deep_ranks_trace_is_written_at_full_depth_as_traced(tmp_path: Path, name: str, checkpointing: bool) -> None:
    """A six-layer model's rank, its stack cut and written at full depth, is the rank traced with every
    block, event for event (beside sequence parallelism FSDP2 unshards the last block in the final norm's
    backward, before the backward sweep: NOTE [ A storage carried into a sweep ] in ``fulldepth.py``); under FSDP2,
    its step of two micro-batches written from it is that step traced."""
    from trace_compare import everything

    from batchfit.activation_checkpointing import checkpoint_classes
    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import _trace_for_device
    from batchfit.memory.synthesis.depth import STATS
    from batchfit.precision import policy_for

    wl = dataclasses.replace(load(str(llama_config_dir(tmp_path, num_hidden_layers=6)), seq_len=SEQ_LEN),
                             parallel=LAYOUTS[name])  # fmt: skip
    device = get_device("H100-80GB")
    policy = policy_for("bf16", bf16_supported=True, device_name=device.name)

    classes = checkpoint_classes("blocks" if checkpointing else None, wl.checkpoint_blocks)

    def trace(on: str) -> tuple[Any, int]:
        before = STATS.blocks_written
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", on)
            return _trace_for_device(wl, BATCH_SIZE, device, policy, classes), STATS.blocks_written - before

    (written, blocks), (traced, _) = trace("1"), trace("0")
    assert blocks == 6
    assert everything(written) == everything(traced)
    layout = LAYOUTS[name]
    if layout.fsdp > 1 and (checkpointing or not layout.sequence_parallel):  # one case with sequence parallelism
        # NOTE [ Gradients that are views of a reduce-scatter's output ] in tracer.py
        from trace_compare import canonical

        from batchfit.memory.estimate import with_accumulation
        from batchfit.memory.synthesis.accumulation import accumulating_trace

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", "0")
            accumulating = _trace_for_device(with_accumulation(wl, 2), BATCH_SIZE, device, policy, classes)
        assert canonical(accumulating_trace(written)) == canonical(accumulating)
