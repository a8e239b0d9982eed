"""A traced step in PyTorch's memory-snapshot format, for ``pytorch.org/memory_viz`` and ``_memory_viz``.

``torch.cuda.memory._snapshot()`` returns a dict of two parts, and the viewers read both:

* ``"device_traces"``: per device, the allocator's events in order: ``alloc`` / ``free_requested`` /
  ``free_completed`` of blocks and ``segment_alloc`` / ``segment_free`` of cudaMalloc'ed segments, each
  with ``addr``, ``size`` (the *requested* bytes for blocks, as ``record_trace`` logs ``orig_size``),
  ``stream`` and ``frames``; an ``oom`` event carries ``device_free``.
* ``"segments"``: the allocator's state at the end: each segment's ``address``, ``total_size`` and
  ``blocks``, which tile it (``size``, ``requested_size``, ``state``, ``frames``).

The viewer replays ``device_traces`` *backwards* from ``segments`` (``MemoryViz.js``,
``simulate_memory``), so the two must agree exactly: every block lies in a segment alive at that
moment, and the final segments hold exactly the blocks never freed. Both are therefore built from one
replay of the trace through ``CachingAllocator``, the model of the real allocator: addresses, block
sizes (rounding, unsplit remainders) and segments are the model's own.

Frames are not Python stacks (a trace on fake tensors has none worth showing): each allocation gets
two synthetic frames, ``module:0:op`` and ``batchfit:0:category | phase of step N``, and each
``alloc`` event a ``category`` (the viewer's "Active Memory Timeline" colours by it).

Example:
    >>> import pickle
    >>> from batchfit.memory.allocator.snapshot import build_snapshot
    >>> from batchfit.memory.trace.fake_step import MemoryTrace
    >>> trace = MemoryTrace(events=[1, 2, ~1], nbytes={1: 4096, 2: 3 << 20})
    >>> snap = build_snapshot(trace)
    >>> [e["action"] for e in snap["device_traces"][0]]
    ['segment_alloc', 'alloc', 'segment_alloc', 'alloc', 'free_requested', 'free_completed']
    >>> [(s["total_size"], s["allocated_size"]) for s in snap["segments"]]
    [(2097152, 0), (20971520, 3145728)]

Limitations:
    * One device, one stream, the default allocator (no ``expandable_segments``: its page mapping
      events are not produced).
    * Without a capacity nothing is ever released, so no ``segment_free`` appears; with one, the
      cache releases of an out-of-memory retry appear as ``segment_free`` and a final OOM as ``oom``
      (the replay stops there, as ``allocator.replay`` does).
    * Addresses are the model's: segments get increasing addresses from 2 MiB up, never reused,
      where cudaMalloc may return lower or recycled ones. Relative placement inside a segment is
      the allocator's best-fit rule.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from ..categories import Category
from ..trace.fake_step import MemoryTrace
from .caching import CachingAllocator, round_size

# The format's own constants (torch/csrc/cuda/memory_snapshot.cpp): stream 0 is the default stream.
_STREAM = 0
# MemoryViz.js's unpickler accepts pickle protocols 2 to 4 only ("Unhandled version"); Python's
# highest is 5, so the protocol is pinned rather than left to the interpreter's default.
PICKLE_PROTOCOL = 4
# Category of segment events. The viewer collects every event's ``category`` and then appends
# "unknown" to the list if absent, through a misspelt name (``snapshot.categores``) that throws; an
# "unknown" among the categories avoids that path. A segment holds blocks of every category, so
# "unknown" is also the honest label for it.
_SEGMENT_CATEGORY = "unknown"


def _frames(trace: MemoryTrace, sid: int, phase: str, step: int) -> list[dict[str, Any]]:
    category = trace.role.get(sid, Category.TEMPORARIES).value
    return [
        {"filename": trace.module.get(sid, "?"), "line": 0, "name": trace.op.get(sid, "?")},
        {"filename": "batchfit", "line": 0, "name": f"{category} | {phase} of step {step + 1}"},
    ]


class _Recorder(CachingAllocator):
    """The allocator model replaying a trace and logging what the real allocator's ``record_trace`` logs.

    Segment events come from the model itself (``CachingAllocator._segment_event``): a retry's releases
    in the order ``release_cached_blocks`` makes them, large pool first; blocks are logged around them.
    """

    def __init__(self, trace: MemoryTrace, capacity_bytes: int | None) -> None:
        super().__init__(capacity_bytes)
        self.trace = trace
        self.events: list[dict[str, Any]] = []
        self.handles: dict[int, int] = {}  # sid -> allocator handle (0: empty request)
        self.requests: dict[int, tuple[int, list[dict[str, Any]]]] = {}  # handle -> (requested bytes, frames)
        self.time = 0

    def _event(self, action: str, addr: int, size: int, frames: list, **extra: Any) -> None:
        self.events.append(
            {"action": action, "addr": addr, "size": size, "stream": _STREAM, "time_us": self.time, "frames": frames}
            | extra
        )

    def _segment_event(self, action: str, addr: int, nbytes: int) -> None:
        self._event(action, addr, nbytes, [], category=_SEGMENT_CATEGORY)

    def record_malloc(self, sid: int, frames: list[dict[str, Any]]) -> bool:
        """Allocate ``sid``; False when the allocator ran out of memory (an ``oom`` event is logged)."""
        nbytes = self.trace.nbytes[sid]
        try:
            handle = self.malloc(nbytes)
        except torch.OutOfMemoryError:
            # record_trace(OOM, device_free, params.size()): the rounded request, no address
            free = (self.capacity_bytes or 0) - self.reserved_bytes
            self.events.append({"action": "oom", "device_free": free, "size": round_size(nbytes), "stream": _STREAM,
                                "time_us": self.time, "frames": frames})  # fmt: skip
            return False
        self.handles[sid] = handle
        if handle == 0:
            return True  # an empty tensor: PyTorch asks the allocator for nothing
        self.requests[handle] = (nbytes, frames)
        category = self.trace.role.get(sid, Category.TEMPORARIES).value
        self._event("alloc", self.block_address(handle), nbytes, frames, category=category)
        return True

    def record_free(self, sid: int) -> None:
        handle = self.handles.pop(sid)
        if handle != 0:
            nbytes, frames = self.requests.pop(handle)
            addr = self.block_address(handle)
            self._event("free_requested", addr, nbytes, frames)
            self._event("free_completed", addr, nbytes, frames)
        self.free(handle)

    def final_segments(self, device_index: int) -> list[dict[str, Any]]:
        """The ``segments`` part: each segment's blocks in address order, live ones with their request."""
        handle_of = {id(block): handle for handle, block in self._live.items()}
        blocks = [*self._live.values(), *(entry[2] for pool in (self._small, self._large) for entry in pool.free)]
        out = []
        for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.ptr):
            listed: list[dict[str, Any]] = []
            block: Any = head
            while block is not None:
                if block.allocated:
                    nbytes, frames = self.requests[handle_of[id(block)]]
                    listed.append({"address": block.ptr, "size": block.size, "requested_size": nbytes,
                                   "state": "active_allocated", "frames": frames})  # fmt: skip
                else:
                    listed.append(_inactive(block.ptr, block.size))
                block = block.next
            allocated = sum(b["size"] for b in listed if b["state"] == "active_allocated")
            out.append(
                {
                    "device": device_index,
                    "address": head.ptr,
                    "total_size": sum(b["size"] for b in listed),
                    "allocated_size": allocated,
                    "active_size": allocated,
                    "requested_size": sum(b["requested_size"] for b in listed),
                    "stream": _STREAM,
                    "segment_type": "small" if head.pool.small else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": listed,
                }
            )
        return out


def _inactive(addr: int, size: int) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": 0, "state": "inactive", "frames": []}


def build_snapshot(trace: MemoryTrace, *, capacity_bytes: int | None = None, device_index: int = 0) -> dict[str, Any]:
    """The snapshot dict of ``trace`` replayed through the caching-allocator model.

    Args:
        trace: a traced step (``estimate``'s, the fitter's, or one from ``trace_for_device``).
        capacity_bytes: what the allocator may reserve (None: unlimited). With a capacity, cache
            releases and an out-of-memory error appear as they would on the GPU.
        device_index: the CUDA device the snapshot claims to be of.

    Returns:
        ``{"segments": [...], "device_traces": [[...]] * (device_index + 1)}`` (only the device's own
        list is non-empty), ready for ``pickle`` (``write_snapshot``) or ``_memory_viz``'s functions.
    """
    rec = _Recorder(trace, capacity_bytes)
    phases = trace.phases or [(0, "setup", 0)]
    k, phase, step = 0, phases[0][1], phases[0][2]
    paged = trace.paged  # CUDA unified memory: never the caching allocator's (``MemoryTrace.allocations``)
    for i, e in enumerate(trace.events):
        while k < len(phases) and phases[k][0] <= i:
            _, phase, step = phases[k]
            k += 1
        rec.time = i
        if (e if e >= 0 else ~e) in paged:
            continue
        if e >= 0:
            if not rec.record_malloc(e, _frames(trace, e, phase, step)):
                break
        elif ~e in rec.handles:
            rec.record_free(~e)
    traces: list[list[dict[str, Any]]] = [[] for _ in range(device_index + 1)]
    traces[device_index] = rec.events
    return {"segments": rec.final_segments(device_index), "device_traces": traces}


def write_snapshot(
    trace: MemoryTrace, path: str | Path, *, capacity_bytes: int | None = None, device_index: int = 0
) -> Path:
    """Pickle ``build_snapshot(trace)`` to ``path`` (protocol 4, which the web viewer can read).

    View it with ``python -m torch.cuda._memory_viz trace_plot PATH -o trace.html`` (or
    ``segment_plot``), or by dropping the file on https://pytorch.org/memory_viz.

    Returns:
        The path written.
    """
    out = Path(path)
    snapshot = build_snapshot(trace, capacity_bytes=capacity_bytes, device_index=device_index)
    with out.open("wb") as f:
        pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)
    return out
