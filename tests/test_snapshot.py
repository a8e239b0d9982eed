"""The memory-snapshot export: consistent with the allocator model, readable by torch's _memory_viz and its viewer."""

from __future__ import annotations

import pickle
import pickletools
from bisect import bisect_right

import pytest
from benchmark_modules import load_benchmark
from torch.cuda import _memory_viz

from batchfit import presets
from batchfit.gpu.catalog import get_device
from batchfit.memory.allocator.caching import replay
from batchfit.memory.allocator.snapshot import PICKLE_PROTOCOL, build_snapshot, write_snapshot
from batchfit.memory.categories import Category
from batchfit.memory.estimate import finish_estimate, trace_for_device
from batchfit.memory.trace.fake_step import MemoryTrace
from batchfit.precision import policy_for
from batchfit.units import MiB

# Opcodes MemoryViz.js's unpickler handles (torch/utils/viz/MemoryViz.js, ``unpickle``); any other throws.
VIEWER_OPCODES = {
    "APPEND",
    "APPENDS",
    "BINFLOAT",
    "BINGET",
    "BININT",
    "BININT1",
    "BININT2",
    "BINPUT",
    "BINUNICODE",
    "DICT",
    "EMPTY_DICT",
    "EMPTY_LIST",
    "EMPTY_TUPLE",
    "FRAME",
    "LIST",
    "LONG1",
    "LONG_BINGET",
    "LONG_BINPUT",
    "MARK",
    "MEMOIZE",
    "NEWFALSE",
    "NEWTRUE",
    "NONE",
    "PROTO",
    "SETITEM",
    "SETITEMS",
    "SHORT_BINUNICODE",
    "STOP",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
}


@pytest.fixture(scope="module")
def gpt_trace() -> MemoryTrace:
    wl = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
    dev = get_device("A100-40GB")
    return trace_for_device(wl, 8, dev, policy_for("fp32", device_name=dev.name), ())


def check_consistent(snap: dict) -> tuple[int, int]:
    """Replay the events forward as the viewer does backwards; every block inside a live segment, no overlap.

    Returns the reserved and allocated bytes at the end, which must match the final ``segments``.
    """
    segments: dict[int, int] = {}
    blocks: dict[int, int] = {}  # addr -> requested size
    for e in snap["device_traces"][0]:
        action, addr, size = e["action"], e.get("addr"), e["size"]
        if action == "segment_alloc":
            assert all(addr >= s + n or addr + size <= s for s, n in segments.items()), "segments overlap"
            segments[addr] = size
        elif action == "segment_free":
            assert not [b for b in blocks if addr <= b < addr + segments[addr]], "freed a segment with live blocks"
            del segments[addr]
        elif action == "alloc":
            starts = sorted(segments)
            seg = starts[bisect_right(starts, addr) - 1]
            assert seg <= addr and addr + size <= seg + segments[seg], "block outside its segment"
            assert addr not in blocks
            blocks[addr] = size
        elif action == "free_requested":
            assert blocks[addr] == size
        elif action == "free_completed":
            del blocks[addr]
    final = {s["address"]: s for s in snap["segments"]}
    assert set(final) == set(segments)
    for addr, seg in final.items():
        assert seg["total_size"] == segments[addr]
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]  # blocks tile the segment
        cursor = addr
        for b in seg["blocks"]:
            assert b["address"] == cursor
            cursor += b["size"]
    active = {
        b["address"]: b["requested_size"]
        for s in snap["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    assert active == blocks
    return (sum(s["total_size"] for s in snap["segments"]), sum(s["allocated_size"] for s in snap["segments"]))


def test_snapshot_agrees_with_the_allocator_model(gpt_trace) -> None:
    snap = build_snapshot(gpt_trace)
    reserved, allocated = check_consistent(snap)
    stats = replay(gpt_trace.allocations())
    assert reserved == stats.reserved_bytes and allocated == stats.allocated_bytes
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert len(allocs) == sum(1 for e in gpt_trace.events if e >= 0 and gpt_trace.nbytes[e] > 0)
    categories = {e["category"] for e in allocs}
    assert {"parameters", "gradients", "optimizer_states", "activations"} <= categories
    assert allocs[0]["frames"][1]["name"].startswith("parameters | setup")


def test_snapshot_is_read_by_torchs_memory_viz(gpt_trace, tmp_path) -> None:
    path = write_snapshot(gpt_trace, tmp_path / "snap.pickle")
    with path.open("rb") as f:
        data = pickle.load(f)
    html = _memory_viz.trace_plot(data)
    assert "snapshot.pickle" in html and "Active Memory Timeline" in html
    assert "Allocator State History" in _memory_viz.segment_plot(data)
    summary = _memory_viz.segsum(data)  # asserts allocated + free == reserved, segment by segment
    assert f"segments: {len(data['segments'])}" in summary
    text = _memory_viz.trace(data)
    assert "cudaMalloc" in text and "free completed" in text
    flame = _memory_viz.segments(data, format_flamegraph=lambda lines: lines)
    assert "active_allocated" in flame and "GPT.transformer" in flame


def test_the_pickle_uses_only_what_the_web_viewer_can_unpickle(gpt_trace, tmp_path) -> None:
    raw = write_snapshot(gpt_trace, tmp_path / "snap.pickle").read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    assert ops <= VIEWER_OPCODES, ops - VIEWER_OPCODES
    assert raw[:2] == bytes([0x80, PICKLE_PROTOCOL]) and 2 <= PICKLE_PROTOCOL <= 4
    # The viewer appends "unknown" to the categories through a misspelt name when it is absent.
    assert any(e.get("category") == "unknown" for e in pickle.loads(raw)["device_traces"][0])


def test_cache_release_and_oom_appear_with_a_capacity() -> None:
    # 12 MiB is cached after its free; 14 MiB does not fit beside it in 20 MiB, so the retry releases it.
    trace = MemoryTrace(events=[1, ~1, 2, 3], nbytes={1: 12 * MiB, 2: 14 * MiB, 3: 8 * MiB})
    snap = build_snapshot(trace, capacity_bytes=20 * MiB)
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions == [
        "segment_alloc",
        "alloc",
        "free_requested",
        "free_completed",
        "segment_free",
        "segment_alloc",
        "alloc",
        "oom",
    ]
    oom = snap["device_traces"][0][-1]
    assert oom["size"] == 8 * MiB and oom["device_free"] == 6 * MiB
    assert check_consistent(snap) == (14 * MiB, 14 * MiB)
    assert "OutOfMemoryError" in _memory_viz.trace(snap)


def test_capacity_snapshot_of_a_step_that_fits_matches_the_estimate(gpt_trace) -> None:
    wl = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
    dev = get_device("A100-40GB")
    est = finish_estimate(gpt_trace, wl, 8, dev, policy_for("fp32", device_name=dev.name), ())
    snap = build_snapshot(gpt_trace, capacity_bytes=est.peak_reserved_bytes)
    assert not [e for e in snap["device_traces"][0] if e["action"] in ("oom", "segment_free")]
    check_consistent(snap)


def test_the_segment_listing_adds_up_to_the_reserved_peak(gpt_trace) -> None:
    """``benchmarks/snapshot_segments.py`` (set beside a real step's snapshot): every cudaMalloc in order, each
    with the request that caused it, the last running total the replay's reserved peak."""
    module = load_benchmark("snapshot_segments")
    rows = module.segments(build_snapshot(gpt_trace))
    stats = replay(gpt_trace.allocations())
    assert rows[-1]["reserved"] == sum(r["segment"] for r in rows) == stats.peak_reserved_bytes
    assert all(r["request"] <= r["segment"] and r["allocated"] <= r["reserved"] for r in rows)
    assert [r["index"] for r in rows] == sorted(r["index"] for r in rows)


def test_a_snapshot_leaves_paged_optimizer_states_out_as_the_allocator_does(gpt_trace) -> None:
    """Paged states live in CUDA unified memory: the exported stream, like the replay, never allocates them."""
    import dataclasses

    paged = {e for e in gpt_trace.events if e >= 0 and gpt_trace.role.get(e) == Category.OPTIMIZER_STATES}
    assert paged
    trace = dataclasses.replace(gpt_trace, paged=paged)
    snap = build_snapshot(trace)
    reserved, allocated = check_consistent(snap)
    stats = replay(trace.allocations())
    assert reserved == stats.reserved_bytes and allocated == stats.allocated_bytes
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert len(allocs) == sum(1 for e in trace.events if e >= 0 and trace.nbytes[e] > 0 and e not in paged)
