"""Real allocator streams recorded on a GPU (``benchmarks/results/snapshots-*``), replayed through the model.

Each snapshot is ``torch.cuda.memory._snapshot()`` of two real training steps (``benchmarks/record_truth.sh``;
``benchmarks/results/README.md`` says how each was made). The allocator model, fed the GPU's own requests,
must take every decision the GPU took: the same segments at the same places, the same cache releases and
retries, the same reserved peak and the same out-of-memory error, to the byte. Several were recorded with
the allocator capped (``set_per_process_memory_fraction``) so that they run into the capacity: those are the
decisions ``fit`` rests on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchfit.memory.allocator.stream_replay import replay_snapshot

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
SNAPSHOTS = sorted(RESULTS.glob("snapshots-*/*.pickle.gz"))


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.name.removeprefix("snapshot-").split(".pickle")[0])
def test_a_real_stream_replays_decision_for_decision(path: Path) -> None:
    r = replay_snapshot(path)
    assert r.unsupported is None, r.unsupported
    assert r.exact, r.first_divergence
    assert r.model_peak_reserved_bytes == r.real_peak_reserved_bytes
    assert (r.model_ooms, r.model_retries) == (r.real_ooms, r.real_retries)
    if "-cap" in path.name:  # recorded under a memory-fraction cap: the replay used the cap it recorded
        assert r.capacity_source == "memory fraction"
        assert r.capacity_bytes == int(path.name.split("-cap")[1].split(".")[0])


def test_the_streams_reach_the_capacity() -> None:
    """The recorded set holds what a fit decides on: out-of-memory errors, by a cap and by the device
    itself, and cache releases with a retry that succeeded."""
    replays = [replay_snapshot(p) for p in SNAPSHOTS if "bert-large-fp32-17" in p.name or "-cap" in p.name]
    sources = {r.capacity_source for r in replays if r.real_ooms}
    assert sources == {"memory fraction", "oom"}
    assert sum(bool(r.real_ooms) for r in replays) >= 5
    assert sum(r.real_retries > 0 and not r.real_ooms for r in replays) >= 5

