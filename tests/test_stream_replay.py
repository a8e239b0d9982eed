"""Real allocator streams (memory snapshots' ``device_traces``) replayed through the allocator model.

The streams are written entry by entry as ``CUDACachingAllocator.cpp`` logs them (``record_trace``: the
requested bytes of a block, the range of a segment, the rounded request and ``device_free`` of an OOM),
with addresses a driver could return, including a later segment below an earlier one.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark

from batchfit.errors import ConfigError
from batchfit.memory.allocator.stream_replay import (
    CapacityBounds,
    RealEvent,
    infer_capacity,
    load_snapshot,
    read_events,
    replay_events,
    replay_snapshot,
    tie_order_for,
)

MiB = 2**20
A, B, C = 0x7F0000000000, 0x7F0040000000, 0x7E0000000000  # C: a segment the driver put below the others


def entry(action: str, addr: int, size: int, **extra) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [], **extra}


def snapshot(*entries: dict, segments: list | None = None) -> dict:
    return {"segments": segments or [], "device_traces": [list(entries)]}


def alloc(addr: int, size: int) -> list[dict]:
    return [entry("alloc", addr, size)]


def free(addr: int, size: int) -> list[dict]:
    return [entry("free_requested", addr, size), entry("free_completed", addr, size)]


def test_splits_best_fit_and_pools_replay_exactly() -> None:
    stream = snapshot(
        entry("segment_alloc", A, 20 * MiB), *alloc(A, 3 * MiB),  # 1-10 MiB: a 20 MiB segment, split
        *alloc(A + 3 * MiB, 3 * MiB),  # the 17 MiB remainder
        *free(A, 3 * MiB),
        *alloc(A, MiB + 1),  # best fit: the 3 MiB block (not the 14 MiB one), split again (2 MiB - 512 left)
        entry("segment_alloc", B, 2 * MiB), *alloc(B, 512),  # the small pool's own 2 MiB segment
        *free(B, 512), *free(A, MiB + 1), *free(A + 3 * MiB, 3 * MiB),
    )  # fmt: skip
    r = replay_snapshot(stream, torch_version="2.11.0")
    assert r.exact and r.first_divergence is None
    assert (r.events, r.real_peak_reserved_bytes, r.model_peak_reserved_bytes) == (10, 22 * MiB, 22 * MiB)
    assert (r.capacity_bytes, r.capacity_source, r.real_retries, r.model_retries) == (None, "none", 0, 0)


def test_a_decision_the_model_would_not_make_is_named() -> None:
    stream = snapshot(
        entry("segment_alloc", A, 20 * MiB), *alloc(A, 3 * MiB), *alloc(A + 3 * MiB, 3 * MiB), *free(A, 3 * MiB),
        *alloc(A + 6 * MiB, MiB + 1),  # the GPU took the larger block: not best fit
    )  # fmt: skip
    r = replay_snapshot(stream)
    assert not r.exact and r.divergences == 1 and r.first_divergence_at == 5
    assert r.first_divergence == (
        f"entry 5 (alloc of 1.00 MiB): the GPU alloc 1.00 MiB at {A + 6 * MiB:#x}; "
        f"the model alloc 1.00 MiB at {A:#x}"
    )


def test_a_retry_bounds_the_capacity_and_replays() -> None:
    stream = snapshot(
        entry("segment_alloc", A, 30 * MiB), *alloc(A, 30 * MiB), *free(A, 30 * MiB),
        # cudaMalloc(40 MiB) failed with 30 MiB reserved: the cache is released and the retry succeeds
        entry("segment_free", A, 30 * MiB), entry("segment_alloc", B, 40 * MiB), *alloc(B, 40 * MiB),
    )  # fmt: skip
    events, unsupported = read_events(stream)
    assert unsupported is None
    assert infer_capacity(events) == CapacityBounds(low=40 * MiB, high=70 * MiB - 1, exact=None)
    r = replay_snapshot(stream)
    assert r.exact and (r.capacity_bytes, r.capacity_source) == (40 * MiB, "retries")
    assert (r.real_retries, r.model_retries, r.real_peak_reserved_bytes) == (1, 1, 40 * MiB)


def test_an_out_of_memory_error_gives_the_capacity_and_is_reproduced() -> None:
    stream = snapshot(
        entry("segment_alloc", A, 30 * MiB), *alloc(A, 30 * MiB),
        entry("segment_alloc", B, 20 * MiB), *alloc(B, 20 * MiB), *free(A, 30 * MiB),
        # 50 MiB: no cached block, cudaMalloc fails, A is released, the retry fails with 35 MiB free
        entry("segment_free", A, 30 * MiB), {"action": "oom", "size": 50 * MiB, "device_free": 35 * MiB, "stream": 0},
        entry("segment_alloc", A, 10 * MiB), *alloc(A, 10 * MiB),  # the program goes on with less
    )  # fmt: skip
    r = replay_snapshot(stream)
    assert r.exact, r.first_divergence
    assert (r.capacity_bytes, r.capacity_source) == (55 * MiB, "oom")  # 20 MiB reserved + 35 MiB free
    assert r.real_ooms == r.model_ooms == (7,)
    assert r.real_peak_reserved_bytes == r.model_peak_reserved_bytes == 50 * MiB


def test_a_memory_fraction_cap_recorded_with_the_snapshot_is_the_capacity() -> None:
    # Under set_per_process_memory_fraction the OOM's device_free is the GPU's free memory, far above the cap
    stream = snapshot(
        entry("segment_alloc", A, 30 * MiB), *alloc(A, 30 * MiB),
        entry("segment_alloc", B, 20 * MiB), *alloc(B, 20 * MiB), *free(A, 30 * MiB),
        entry("segment_free", A, 30 * MiB), {"action": "oom", "size": 50 * MiB, "device_free": 900 * MiB, "stream": 0},
    )  # fmt: skip
    capped = {**stream, "recorded_with": {"torch": "2.11.0", "allowed_bytes": 60 * MiB}}
    r = replay_snapshot(capped)
    assert r.exact, r.first_divergence
    assert (r.capacity_bytes, r.capacity_source, r.model_ooms) == (60 * MiB, "memory fraction", (7,))
    assert not replay_snapshot(stream).exact  # device_free's 920 MiB would have let the model allocate
    assert replay_snapshot(capped, capacity_bytes=69 * MiB).capacity_source == "given"
    assert not replay_snapshot(capped, capacity_bytes=70 * MiB).exact


def test_the_model_running_out_where_the_gpu_did_not_is_a_difference() -> None:
    stream = snapshot(entry("segment_alloc", A, 30 * MiB), *alloc(A, 30 * MiB),
                      entry("segment_alloc", B, 20 * MiB), *alloc(B, 20 * MiB))  # fmt: skip
    r = replay_snapshot(stream, capacity_bytes=40 * MiB)
    assert not r.exact and r.model_ooms == (3,) and r.real_ooms == ()
    assert r.first_divergence == (
        f"entry 3 (alloc of 20.00 MiB): the GPU segment_alloc 20.00 MiB at {B:#x}, alloc 20.00 MiB at {B:#x}; "
        "the model oom 20.00 MiB"
    )


def _equal_blocks_in_two_segments(taken: int) -> dict:
    """Two 12 MiB segments, the second below the first, both freed; a third 12 MiB request takes ``taken``."""
    return snapshot(
        entry("segment_alloc", A, 12 * MiB), *alloc(A, 12 * MiB),
        entry("segment_alloc", C, 12 * MiB), *alloc(C, 12 * MiB),
        *free(A, 12 * MiB), *free(C, 12 * MiB), *alloc(taken, 12 * MiB),
    )  # fmt: skip


def test_equal_free_blocks_go_to_the_lowest_address_up_to_torch_2_12_and_the_oldest_segment_after() -> None:
    assert tie_order_for("2.11.0+cu130") == "address" and tie_order_for("2.13.0") == "segment"
    lowest, oldest = _equal_blocks_in_two_segments(C), _equal_blocks_in_two_segments(A)
    assert replay_snapshot(lowest, torch_version="2.11.0").exact
    assert replay_snapshot(oldest, torch_version="2.13.0").exact
    assert not replay_snapshot(lowest, torch_version="2.13.0").exact
    assert not replay_snapshot(oldest, torch_version="2.11.0").exact
    with pytest.raises(ConfigError, match="torch version"):
        tie_order_for("nightly")


def test_empty_cache_releases_large_segments_then_small_ones() -> None:
    stream = snapshot(
        entry("segment_alloc", B, 2 * MiB), *alloc(B, 4096), entry("segment_alloc", A, 20 * MiB), *alloc(A, 3 * MiB),
        *free(A, 3 * MiB), *free(B, 4096),
        entry("segment_free", A, 20 * MiB), entry("segment_free", B, 2 * MiB),  # empty_cache(): large pool first
    )  # fmt: skip
    r = replay_snapshot(stream)
    assert r.exact and r.model_peak_reserved_bytes == 22 * MiB and r.real_retries == 0
    swapped = snapshot(*stream["device_traces"][0][:-2], entry("segment_free", B, 2 * MiB),
                       entry("segment_free", A, 20 * MiB))  # fmt: skip
    assert replay_snapshot(swapped).first_divergence_at == 8


def test_expandable_segments_map_and_unmap_pages() -> None:
    stream = snapshot(
        entry("segment_map", A, 20 * MiB), *alloc(A, 3 * MiB),  # one 20 MiB page of the large pool's segment
        entry("segment_map", A + 20 * MiB, 20 * MiB), *alloc(A + 3 * MiB, 30 * MiB),  # grows into a new page
        *free(A, 3 * MiB), *free(A + 3 * MiB, 30 * MiB),
        entry("segment_unmap", A, 40 * MiB),  # empty_cache: every free page
    )  # fmt: skip
    for version in ("2.11.0", "2.13.0"):
        r = replay_snapshot(stream, torch_version=version)
        assert r.exact, r.first_divergence
        assert r.model_peak_reserved_bytes == r.real_peak_reserved_bytes == 40 * MiB


def test_a_recording_begun_with_memory_in_use_starts_from_the_final_segments() -> None:
    final = [{"device": 0, "address": A, "total_size": 20 * MiB, "segment_type": "large", "blocks": [
        {"address": A, "size": 3 * MiB, "requested_size": 3 * MiB, "state": "active_allocated"},
        {"address": A + 3 * MiB, "size": 17 * MiB, "requested_size": 0, "state": "inactive"}]}]  # fmt: skip
    stream = snapshot(
        *alloc(A + 3 * MiB, 2 * MiB),  # into the remainder of a segment made before the recording
        *free(A + 3 * MiB, 2 * MiB),
        segments=final,
    )
    r = replay_snapshot(stream)
    assert r.exact and r.seeded_blocks == 1
    assert r.real_peak_reserved_bytes == r.model_peak_reserved_bytes == 20 * MiB


def test_several_streams_are_not_replayed() -> None:
    stream = snapshot(entry("segment_alloc", A, 2 * MiB), *alloc(A, 512), entry("alloc", A + 512, 512, stream=7))
    r = replay_snapshot(stream)
    assert not r.exact and r.unsupported == "2 streams (the allocator model has one)"


def test_snapshot_files_plain_or_compressed(tmp_path: Path) -> None:
    stream = snapshot(entry("segment_alloc", A, 2 * MiB), *alloc(A, 512), *free(A, 512))
    plain, packed = tmp_path / "s.pickle", tmp_path / "s.pickle.gz"
    plain.write_bytes(pickle.dumps(stream))
    packed.write_bytes(gzip.compress(pickle.dumps(stream)))
    assert load_snapshot(plain) == load_snapshot(packed) == stream
    assert replay_snapshot(packed).exact
    (tmp_path / "bad").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="cannot read memory snapshot"):
        load_snapshot(tmp_path / "bad")
    (tmp_path / "list").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ConfigError, match="not a memory snapshot"):
        load_snapshot(tmp_path / "list")
    with pytest.raises(ConfigError, match="not for device 1"):
        read_events(stream, device=1)


def test_replay_events_checks_its_arguments() -> None:
    with pytest.raises(ConfigError, match="tie_order"):
        replay_events([], tie_order="newest")
    with pytest.raises(ConfigError, match="never allocated"):
        replay_events([RealEvent("free_completed", A, 512)])


@pytest.fixture(scope="module")
def gpt_trace():
    from batchfit import presets
    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import trace_for_device
    from batchfit.precision import policy_for

    dev = get_device("A100-40GB")
    wl = presets.get("gpt", n_layer=2, n_embd=128, n_head=2, vocab_size=4096, seq_len=64)
    return trace_for_device(wl, 8, dev, policy_for("bf16", device_name=dev.name), ())


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0"])
@pytest.mark.parametrize("short_of_the_peak", [2 * MiB, None])
def test_a_traced_step_exported_as_a_snapshot_replays_exactly(gpt_trace, version: str, short_of_the_peak) -> None:
    """The estimate's own snapshot (``batchfit report --snapshot``) read back as if a GPU had recorded it, at
    a capacity that makes the cache release and retry (2 MiB short of the unlimited peak) or run out (the
    allocated peak): the same decisions, the same reserved peak, the same retries and OOM."""
    from batchfit.memory.allocator.caching import replay
    from batchfit.memory.allocator.snapshot import build_snapshot

    free = replay(gpt_trace.allocations())
    capacity = free.peak_allocated_bytes if short_of_the_peak is None else free.peak_reserved_bytes - short_of_the_peak
    bounded = replay(gpt_trace.allocations(), capacity_bytes=capacity)
    assert bounded.num_alloc_retries > 0 and (bounded.oom_at_event is None) == (short_of_the_peak is not None)
    r = replay_snapshot(build_snapshot(gpt_trace, capacity_bytes=capacity), torch_version=version)
    assert r.exact, r.first_divergence
    assert r.model_peak_reserved_bytes == r.real_peak_reserved_bytes == bounded.peak_reserved_bytes
    assert r.model_retries == r.real_retries == bounded.num_alloc_retries
    assert len(r.real_ooms) == len(r.model_ooms) == bounded.num_ooms


@pytest.mark.parametrize("descending", [False, True])
def test_a_trace_replays_alike_from_its_own_event_list_and_from_tuples(gpt_trace, descending: bool) -> None:
    """``StorageEvents`` (the trace's event list, no tuple per event) replays as ``allocations()`` does: unlimited,
    at a capacity that releases the cache and retries, at one that runs out; a paged storage left out; a free of
    nothing refused."""
    from batchfit.memory.allocator.caching import StorageEvents, replay

    timeline = StorageEvents(gpt_trace.events, gpt_trace.nbytes, gpt_trace.paged)
    free = replay(gpt_trace.allocations())
    for capacity in (None, free.peak_reserved_bytes - 2 * MiB, free.peak_allocated_bytes):
        tuples = replay(gpt_trace.allocations(), capacity_bytes=capacity, descending_addresses=descending)
        assert replay(timeline, capacity_bytes=capacity, descending_addresses=descending) == tuples
    assert tuples.oom_at_event is not None  # the last capacity ran out
    biggest = max(gpt_trace.nbytes, key=gpt_trace.nbytes.get)
    without = replay(StorageEvents(gpt_trace.events, gpt_trace.nbytes, {biggest}))
    assert without.peak_allocated_bytes < free.peak_allocated_bytes
    with pytest.raises(ConfigError, match="free of key 7, which has no live allocation"):
        replay(StorageEvents([~7], {7: 512}))


def test_the_recording_torch_is_read_from_the_snapshot_when_written_there() -> None:
    lowest = _equal_blocks_in_two_segments(C)
    assert replay_snapshot({**lowest, "recorded_with": {"torch": "2.11.0+cu130"}}).exact
    assert not replay_snapshot({**lowest, "recorded_with": {"torch": "2.14.1"}}).exact
    assert replay_snapshot({**lowest, "recorded_with": {"torch": "2.14.1"}}, torch_version="2.11.0").exact


def test_the_replay_benchmark_reads_folders_and_says_which_snapshots_replay(tmp_path: Path, capsys) -> None:
    module = load_benchmark("snapshot_replay")
    (tmp_path / "a.pickle.gz").write_bytes(gzip.compress(pickle.dumps(_equal_blocks_in_two_segments(C))))
    (tmp_path / "b.pickle").write_bytes(pickle.dumps(_equal_blocks_in_two_segments(A)))
    assert module.main([str(tmp_path), "--torch", "2.11.0"]) == 1
    out = capsys.readouterr().out
    assert "a.pickle.gz: exact; 7 entries" in out and "b.pickle: 1 differ" in out
    assert "first difference: entry 8 (alloc of 12.00 MiB)" in out
    assert out.endswith("1 of 2 snapshots replayed exactly\n")
    assert module.main([str(tmp_path / "nothing")]) == 1


def test_the_stream_diff_finds_a_request_only_the_gpu_made(gpt_trace) -> None:
    """``benchmarks/stream_diff.py``: a kernel's workspace the trace lacks shows as an inserted alloc and free."""
    from batchfit.memory.allocator.snapshot import build_snapshot

    diff = load_benchmark("stream_diff")
    traced = build_snapshot(gpt_trace)
    entries = traced["device_traces"][0]
    at = next(i for i, e in enumerate(entries) if e["action"] == "alloc" and i > len(entries) // 2)
    frames = [{"filename": "/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": "/home/me/model.py", "line": 12, "name": "forward"}]  # fmt: skip
    workspace = [entry("alloc", 1, 64 * MiB - 100, frames=frames), entry("free_completed", 1, 64 * MiB - 100)]
    real = {**traced, "device_traces": [entries[:at] + workspace + entries[at:]]}
    (only,) = diff.differences(diff.stream(real), diff.stream(traced))
    assert (only["kind"], only["model"]) == ("GPU only", [])
    assert only["real"] == [(("alloc", 64 * MiB), "model.py:12 forward"), (("free", 64 * MiB), "?")]
    assert diff.summary([only]) == ({("alloc", 64 * MiB): 1, ("free", 64 * MiB): 1}, {})


def test_the_stream_diff_of_a_step_against_its_own_trace_is_empty(tmp_path: Path, capsys) -> None:
    from batchfit import presets
    from batchfit.gpu.catalog import get_device
    from batchfit.memory.allocator.snapshot import build_snapshot
    from batchfit.memory.estimate import trace_for_device
    from batchfit.precision import policy_for

    dev = get_device("H200")
    wl = presets.get("mlp", in_features=1024, hidden=4096, depth=4)  # gpu_truth's "mlp" case
    snap = build_snapshot(trace_for_device(wl, 512, dev, policy_for("fp32", device_name=dev.name), ()))
    path = tmp_path / "snapshot-mlp-fp32-512.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps({**snap, "recorded_with": {"gpu": "NVIDIA H200"}})))
    assert load_benchmark("stream_diff").main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "mlp fp32 batch 512 on NVIDIA H200" in out and "0 stretches differ" in out
    assert "only on the GPU: nothing" in out and "only in the trace: nothing" in out


def test_the_gpus_own_workspace_sizes_are_found_for_each_traced_workspace() -> None:
    """``stream_diff.real_workspaces``: each of the trace's cuDNN workspaces gets the size the GPU gave the
    same call, found by aligning the two streams' other requests; a call the GPU ran without one gets 0."""
    import torch
    from torch import nn

    from batchfit import Workload
    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import trace_for_device
    from batchfit.precision import policy_for

    diff = load_benchmark("stream_diff")
    wl = Workload(model=lambda: nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)),
                  batch=lambda b: torch.randn(b, 4, 16, 16), loss=lambda m, x: m(x).sum())  # fmt: skip
    trace = trace_for_device(wl, 2, get_device("H200"), policy_for("fp32", device_name="H200"), ())
    gpu_size = {}  # what the "GPU" gives each workspace: twice forward, none for an input's gradient, +4 KiB
    for sid, op in trace.op.items():
        if op.startswith("cuDNN workspace"):
            n = trace.nbytes[sid]
            gpu_size[sid] = {"forward": 2 * n, "backward data": 0}.get(op[17:-1], n + 4096)
    assert sorted({trace.op[s][17:-1] for s in gpu_size}) == ["backward data", "backward filter", "forward"]
    entries = [{"action": "alloc" if is_alloc else "free_completed", "addr": sid, "size": gpu_size.get(sid, n)}
               for is_alloc, sid, n in diff._gpu_order(trace)]  # fmt: skip
    sizes, unmatched = diff.real_workspaces({"device_traces": [entries]}, trace)
    assert (sizes, unmatched) == (gpu_size, 0)
    # The GPU takes an input gradient's workspace before it allocates the weight's gradient; the trace lists
    # both outputs first, so the order compared is not the trace's own.
    assert [s for a, s, _ in diff._gpu_order(trace)] != [s for a, s, _ in trace.allocations()]


def test_with_the_gpus_own_cudnn_workspaces_a_traced_cnn_step_reserves_what_the_gpu_did(monkeypatch) -> None:
    """The ResNet-18 shape reserves 32% more on the GPU than its traced step. Given the size the GPU gave each
    cuDNN workspace (``benchmarks/stream_diff.py --workspaces``), the rest of the trace and the allocator model
    reproduce the GPU's reserved peak within 1.2%: what is left of the error is cuDNN's choice of engines."""
    from batchfit.memory.allocator.stream_replay import load_snapshot

    diff = load_benchmark("stream_diff")
    monkeypatch.setenv("BATCHFIT_DEPTH_SYNTHESIS", "0")  # the written trace frees some workspaces later
    recorded = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "snapshots-H200-2026-11-26"
    snapshot = load_snapshot(recorded / "snapshot-cnn-resnet18-fp32-16.pickle.gz")
    peaks = diff.with_real_workspaces(snapshot, diff._model_trace("cnn-resnet18", "fp32", 16, "NVIDIA H200"))
    assert (peaks["workspaces"], peaks["unmatched"]) == (118, 0)
    assert peaks["traced"] / peaks["real"] - 1 == pytest.approx(-0.3219, abs=5e-4)
    assert abs(peaks["with_real_workspaces"] / peaks["real"] - 1) <= 0.012
