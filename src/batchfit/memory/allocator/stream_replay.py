"""A real GPU's allocator events replayed through the allocator model, decision by decision.

``torch.cuda.memory._record_memory_history()`` makes PyTorch's CUDA caching allocator log every request
it serves, every free, every segment it takes from the driver or gives back, and every out-of-memory
error; ``torch.cuda.memory._snapshot()`` hands the log over as ``device_traces``. That stream is the
ground truth of ``memory/allocator/caching.py``: fed the same requests and frees in the same order, with the
GPU's own capacity, the model must take the same segments, put every block at the same place, release
the same cached segments on the same failed ``cudaMalloc`` and run out of memory at the same request.
``replay_snapshot`` checks exactly that and says where the first difference is.

NOTE [ Replaying a real stream ]
What each trace entry carries (``record_trace`` in ``c10/cuda/CUDACachingAllocator.cpp``, the same in
torch 2.4 through 2.15): ``alloc`` the block's address and the *requested* bytes; ``free_completed`` the
moment the block is back in its pool (a free waits for other streams' events; on one stream it is the
``free_requested`` itself); ``segment_alloc`` / ``segment_free`` (cudaMalloc / cudaFree) and
``segment_map`` / ``segment_unmap`` (expandable segments' pages) the range; ``oom`` the rounded request
and, instead of an address, ``device_free``: the driver's free memory after the failed retry.

* Grouping. One ``malloc`` logs its segment events just before its ``alloc`` (or its ``oom``): the
  releases of an out-of-memory retry, then the new segment. A run of ``segment_free`` followed by
  anything else is ``torch.cuda.empty_cache()``.
* Capacity. ``cudaMalloc`` fails when the driver has less free memory than the segment. After a failed
  retry, what the allocator could have reserved is what it holds plus ``device_free``; a retry that
  succeeded (releases before a new segment) bounds it from above, every segment from below
  (``infer_capacity``). The replay uses the OOM's figure, else the tightest bound that reproduces the
  GPU's decisions. With neither, nothing ever failed and no capacity is needed.
* Ties. A best-fit search among free blocks of the same size takes the one first in the pool's order:
  the lowest address up to torch 2.11, the oldest segment (then the lowest address) from 2.13
  (``BlockComparatorSizeCounterAddress``, pytorch/pytorch#183591; 2.12's order was not established, and
  is taken as the older one). The model's own segments get increasing addresses, which is the newer order;
  to replay the older one it takes each new segment's address from the GPU's stream, so that the
  address order is the driver's. Either way, addresses are compared as (segment, offset): the model's
  segment is paired with the GPU's segment made by the same call.
* A recording that began with memory already in use (``_record_memory_history`` after the model was
  built, or a ring buffer that wrapped) starts from the state read backwards from the snapshot's final
  ``segments``. The sizes of blocks allocated before the recording are then their rounded requests,
  which misses an unsplit remainder; ``StreamReplay.seeded_blocks`` says how many there were. Record
  from an empty cache (``torch.cuda.empty_cache()`` first) for an exact replay.

Limitations:
    * One stream and the default pool: a trace with several streams, or events of a private pool (CUDA
      graphs, ``MemPool``), is reported as not replayable rather than replayed wrongly.
    * The replay follows the GPU's requests; it does not say whether a traced step makes the same ones
      (that is the trace's business, ``memory/trace/fake_step.py``).
"""

from __future__ import annotations

import gzip
import pickle
from bisect import bisect_right, insort
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ...errors import ConfigError
from ...third_party import torch_release
from ...units import format_bytes
from .blocks import SMALL_BUFFER, _Block, round_size
from .caching import CachingAllocator

__all__ = [
    "CapacityBounds",
    "RealEvent",
    "StreamReplay",
    "infer_capacity",
    "load_snapshot",
    "read_events",
    "replay_events",
    "replay_snapshot",
    "tie_order_for",
]

SEGMENT_ACTIONS = frozenset({"segment_alloc", "segment_free", "segment_map", "segment_unmap"})
_REPLAYED = SEGMENT_ACTIONS | {"alloc", "free_completed", "oom"}
# Trace entries that change nothing the allocator decides with: the request half of a free (the block
# returns to its pool at ``free_completed``), snapshots taken, and annotations (2.4's ``user_defined``,
# 2.14's ``annotate``).
_IGNORED = frozenset({"free_requested", "snapshot", "user_defined", "annotate"})
_FRESH_ADDRESS = 1 << 60
"""Where the model puts a segment the GPU has no counterpart for: above any 48-bit device address."""


class RealEvent(NamedTuple):
    """One allocator entry of a memory snapshot's trace."""

    action: str
    addr: int
    """The block's or range's address; for ``oom``, 0."""
    size: int
    """Requested bytes (``alloc``, ``free_completed``), the range (segment events), the rounded request (``oom``)."""
    device_free: int | None = None
    """``oom`` only: the driver's free memory after the failed retry."""
    index: int = -1
    """Position in the snapshot's trace (every entry counted), to find it there; -1 for the model's own."""


@dataclass(frozen=True)
class CapacityBounds:
    """What the GPU's stream says about the memory the allocator could reserve."""

    low: int
    """The most it reserved (every ``cudaMalloc`` that succeeded fitted)."""
    high: int | None
    """One less than the least reserved + segment of a ``cudaMalloc`` that failed (None: none failed)."""
    exact: int | None
    """Reserved + ``device_free`` at the first out-of-memory error (None: there was none)."""

    def capacity(self) -> int | None:
        """The capacity a replay uses: the OOM's figure, else the low bound when something failed, else None."""
        if self.exact is not None:
            return self.exact
        return None if self.high is None else self.low


@dataclass(frozen=True)
class StreamReplay:
    """A real stream against the allocator model: equal decision by decision, or the first difference."""

    events: int
    """Allocator entries replayed (alloc, free, segment and oom entries)."""
    divergences: int
    """Calls whose events differ (0: exact)."""
    first_divergence: str | None
    """The first difference, in words: entry index, the request, what the GPU did and what the model did."""
    first_divergence_at: int | None
    """Its position in the snapshot's trace (``device_traces[device]``)."""
    real_peak_reserved_bytes: int
    model_peak_reserved_bytes: int
    real_ooms: tuple[int, ...]
    """Trace positions of the GPU's out-of-memory errors."""
    model_ooms: tuple[int, ...]
    """Trace positions of the requests the model ran out of memory at (an ``alloc`` there is a difference)."""
    real_retries: int
    """``cudaMalloc`` failures the GPU recovered from by releasing its cache."""
    model_retries: int
    capacity_bytes: int | None
    capacity_source: str
    """``given``, ``oom`` (reserved + device_free), ``retries`` (bounded by a failed cudaMalloc) or ``none``."""
    tie_order: str
    """``address`` (torch <= 2.12) or ``segment`` (2.13 on): how equal free blocks were ordered."""
    seeded_blocks: int = 0
    """Blocks alive before the recording began, rebuilt from the final state (see the NOTE)."""
    unsupported: str | None = None
    """Why the stream was not replayed (several streams, a private pool); None when it was."""

    @property
    def exact(self) -> bool:
        """Every decision of the model is the GPU's."""
        return self.unsupported is None and self.divergences == 0


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """A memory snapshot written by ``torch.cuda.memory._dump_snapshot`` (a pickle, gzip-compressed or not).

    Raises:
        ConfigError: the file is missing or is not a snapshot.
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(2)
        opener: Any = gzip.open if head == b"\x1f\x8b" else open
        with opener(p, "rb") as f:
            snapshot = pickle.load(f)  # noqa: S301 - a snapshot is a pickle by PyTorch's design; open only your own
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        why = f"cannot read memory snapshot {p}: {e}"
        raise ConfigError(f"{why}; give a file that torch.cuda.memory._dump_snapshot wrote") from e
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        raise ConfigError(f"{p} is not a memory snapshot (no device_traces); record one with "
                          "torch.cuda.memory._record_memory_history() and _dump_snapshot()")  # fmt: skip
    return snapshot


def read_events(snapshot: dict[str, Any], device: int = 0) -> tuple[list[RealEvent], str | None]:
    """The allocator entries of ``device``'s trace, and why they cannot be replayed (None: they can).

    Raises:
        ConfigError: the snapshot has no trace for ``device``.
    """
    traces = snapshot.get("device_traces") or []
    if not 0 <= device < len(traces):
        raise ConfigError(f"the snapshot has traces for {len(traces)} device(s), not for device {device}")
    events: list[RealEvent] = []
    streams: set[int] = set()
    unsupported = None
    for index, entry in enumerate(traces[device]):
        action = entry.get("action")
        if action in _IGNORED:
            continue
        if action not in _REPLAYED:
            unsupported = unsupported or f"an entry of unknown kind {action!r}"
            continue
        streams.add(int(entry.get("stream", 0)))
        pool = entry.get("pool_id")
        if pool is not None and tuple(pool) != (0, 0):
            unsupported = unsupported or f"events of a private memory pool {tuple(pool)} (CUDA graphs or MemPool)"
        if action == "oom":
            events.append(RealEvent("oom", 0, int(entry["size"]), int(entry.get("device_free", 0)), index))
        else:
            events.append(RealEvent(action, int(entry["addr"]), int(entry["size"]), None, index))
    if len(streams) > 1:
        unsupported = unsupported or f"{len(streams)} streams (the allocator model has one)"
    return events, unsupported


def tie_order_for(torch_version: str | None) -> str:
    """How the allocator of ``torch_version`` orders free blocks of one size (None: the installed torch)."""
    return "segment" if torch_release(torch_version or None) >= (2, 13) else "address"


def infer_capacity(events: list[RealEvent]) -> CapacityBounds:
    """The capacity bounds the stream implies (NOTE [ Replaying a real stream ], "Capacity")."""
    reserved = low = 0
    high: int | None = None
    exact: int | None = None
    pending_release = 0  # bytes released since the last request: a retry's, if a new segment follows
    released_from = 0
    for e in events:
        action = e.action
        if action in ("segment_alloc", "segment_map"):
            if pending_release:  # the first cudaMalloc of this size failed, before the cache was released
                bound = released_from + e.size - 1
                high = bound if high is None else min(high, bound)
            reserved += e.size
            low = max(low, reserved)
        elif action in ("segment_free", "segment_unmap"):
            if not pending_release:
                released_from = reserved
            pending_release += e.size
            reserved -= e.size
            continue
        elif action == "oom" and exact is None:
            exact = reserved + (e.device_free or 0)
        pending_release = 0
    return CapacityBounds(low, high, exact)


def replay_snapshot(
    snapshot: dict[str, Any] | str | Path,
    *,
    device: int = 0,
    capacity_bytes: int | None = None,
    torch_version: str | None = None,
) -> StreamReplay:
    """Replay a real GPU's memory snapshot through the allocator model and compare every decision.

    Args:
        snapshot: the dict of ``torch.cuda.memory._snapshot()`` or a file of ``_dump_snapshot``
            (``.gz`` too), recorded with ``torch.cuda.memory._record_memory_history()``.
        device: the CUDA device whose trace to replay.
        capacity_bytes: what the allocator could reserve on that GPU (None: the cap the recording set with
            ``torch.cuda.set_per_process_memory_fraction``, where ``recorded_with["allowed_bytes"]`` names it,
            else read from the stream: an OOM's ``device_free`` is the GPU's free memory, not the cap's).
        torch_version: the torch that recorded it, which decides how equal free blocks are ordered
            (None: the snapshot's ``recorded_with["torch"]`` where ``benchmarks/gpu_truth.py`` wrote one,
            else the installed torch).

    Returns:
        A ``StreamReplay``; ``.exact`` when the model made every decision the GPU made.

    Raises:
        ConfigError: not a snapshot, or no trace for ``device``.
    """
    snap = load_snapshot(snapshot) if isinstance(snapshot, (str, Path)) else snapshot
    events, unsupported = read_events(snap, device)
    recorded = snap.get("recorded_with") or {}
    tie_order = tie_order_for(torch_version or recorded.get("torch"))
    source = "given"
    if capacity_bytes is None and recorded.get("allowed_bytes"):
        capacity_bytes, source = int(recorded["allowed_bytes"]), "memory fraction"
    if unsupported is not None:
        source = source if capacity_bytes is not None else "none"
        return StreamReplay(len(events), 0, None, None, _real_peak(events), 0, (), (), 0, 0, capacity_bytes, source,
                            tie_order, unsupported=unsupported)  # fmt: skip
    initial = _initial_state(snap, events, device)
    replayed = replay_events(events, capacity_bytes=capacity_bytes, tie_order=tie_order, initial=initial)
    return replayed if capacity_bytes is None else replace(replayed, capacity_source=source)


def replay_events(
    events: list[RealEvent],
    *,
    capacity_bytes: int | None = None,
    tie_order: str = "segment",
    initial: _InitialState | None = None,
) -> StreamReplay:
    """``replay_snapshot`` on entries already read (``read_events``).

    Raises:
        ConfigError: an unknown ``tie_order``, or a free of a block the stream never allocated.
    """
    if tie_order not in ("address", "segment"):
        raise ConfigError(f"tie_order must be 'address' or 'segment', got {tie_order!r}")
    bounds = infer_capacity(events)
    if capacity_bytes is not None:
        capacity, source = capacity_bytes, "given"
    else:
        capacity = bounds.capacity()
        source = "oom" if bounds.exact is not None else ("retries" if capacity is not None else "none")
    expandable = any(e.action in ("segment_map", "segment_unmap") for e in events)
    model = _ReplayAllocator(capacity, expandable, adopt=tie_order == "address")
    if initial is not None:
        model.seed(initial)
    check = _Comparison()
    real_ooms: list[int] = []
    real_retries = 0
    i, n = 0, len(events)
    while i < n:
        j = i
        while j < n and events[j].action in SEGMENT_ACTIONS:
            j += 1
        group = events[i:j]
        if j < n and events[j].action in ("alloc", "oom"):
            request = events[j]
            # a failed first cudaMalloc: the cache released before a new segment, or an OOM (whose
            # retry, counted by num_alloc_retries too, failed)
            if request.action == "oom" or any(e.action in ("segment_free", "segment_unmap") for e in group):
                real_retries += 1
            if request.action == "oom":
                real_ooms.append(request.index)
            model.expect(group)
            got = model.request(request)
            check.compare(request.index, request, [*group, request], got)
            i = j + 1
        elif group:  # a release with no request after it: empty_cache
            model.expect(group)
            got = model.empty()
            check.compare(group[0].index, None, group, got)
            i = j
        else:  # free_completed
            model.release(events[i])
            i += 1
    return StreamReplay(
        events=n,
        divergences=check.count,
        first_divergence=check.first,
        first_divergence_at=check.first_at,
        real_peak_reserved_bytes=_real_peak(events, initial),
        model_peak_reserved_bytes=model.peak_reserved_bytes,
        real_ooms=tuple(real_ooms),
        model_ooms=tuple(model.ooms),
        real_retries=real_retries,
        model_retries=model.num_alloc_retries,
        capacity_bytes=capacity,
        capacity_source=source,
        tie_order=tie_order,
        seeded_blocks=0 if initial is None else len(initial.blocks),
    )


def _real_peak(events: list[RealEvent], initial: _InitialState | None = None) -> int:
    reserved = 0 if initial is None else sum(size for size, _ in initial.segments.values())
    peak = reserved
    for e in events:
        if e.action in ("segment_alloc", "segment_map"):
            reserved += e.size
            peak = max(peak, reserved)
        elif e.action in ("segment_free", "segment_unmap"):
            reserved -= e.size
    return peak


class _Comparison:
    """Counts the calls whose events differ and words the first one."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None
        self.first_at: int | None = None

    def compare(self, at: int, request: RealEvent | None, real: list[RealEvent], model: list[RealEvent]) -> None:
        # device_free is the capacity's business (CapacityBounds), not a decision of the allocator
        if [e[:3] for e in real] == [e[:3] for e in model]:
            return
        self.count += 1
        if self.first is None:
            what = "empty_cache()" if request is None else f"{request.action} of {format_bytes(request.size)}"
            self.first = f"entry {at} ({what}): the GPU {_words(real)}; the model {_words(model)}"
            self.first_at = at


def _words(events: list[RealEvent]) -> str:
    parts = []
    for e in events:
        where = "" if e.action == "oom" else f" at {e.addr:#x}" if e.addr >= 0 else " at a new address"
        parts.append(f"{e.action} {format_bytes(e.size)}{where}")
    return ", ".join(parts) or "did nothing"


@dataclass
class _InitialState:
    """Segments and live blocks before the first entry, by address: (size, small pool) and (block size, requested)."""

    segments: dict[int, tuple[int, bool]]
    blocks: dict[int, tuple[int, int]]


def _initial_state(snapshot: dict[str, Any], events: list[RealEvent], device: int) -> _InitialState | None:
    """What was allocated when the recording began, read backwards from the final ``segments``; None when
    the recording began from an empty cache (every entry refers to what the stream itself made)."""
    segments: dict[int, tuple[int, bool]] = {}
    blocks: dict[int, tuple[int, int]] = {}
    for seg in snapshot.get("segments") or []:
        if int(seg.get("device", device)) != device or seg.get("is_expandable"):
            continue
        segments[int(seg["address"])] = (int(seg["total_size"]), seg.get("segment_type") == "small")
        for b in seg.get("blocks") or []:
            if str(b.get("state", "")).startswith("active"):
                blocks[int(b["address"])] = (int(b["size"]), int(b.get("requested_size", b["size"])))
    for e in reversed(events):
        if e.action == "alloc":
            blocks.pop(e.addr, None)
        elif e.action == "free_completed":
            blocks[e.addr] = (round_size(e.size), e.size)
        elif e.action == "segment_alloc":
            segments.pop(e.addr, None)
        elif e.action == "segment_free":
            segments[e.addr] = (e.size, e.size == SMALL_BUFFER)
    if not blocks and not segments:
        return None
    return _InitialState(segments, blocks)


class _ReplayAllocator(CachingAllocator):
    """The allocator model, driven by a real stream: it logs its own events in the stream's terms.

    Each of its segments is paired with the GPU's segment made by the same call; an address is logged as
    the GPU's segment plus the offset (-1 when the model's segment has no counterpart on the GPU). With
    ``adopt`` a new segment is also placed at the GPU's address, so that equal free blocks are ordered by
    the driver's addresses, as torch <= 2.12 orders them.
    """

    def __init__(self, capacity: int | None, expandable: bool, *, adopt: bool) -> None:
        super().__init__(capacity, expandable_segments=expandable)
        self.adopt = adopt
        self._next_addr = _FRESH_ADDRESS
        self._expected: list[RealEvent] = []
        self._log: list[RealEvent] = []
        self._bases: list[int] = []  # sorted starts of the model's segments (address ranges)
        self._real_base: dict[int, int | None] = {}  # model start -> the GPU's start (None: no counterpart)
        self._live: dict[int, _Block | None] = {}  # the GPU's address of a live block -> the model's block
        self.ooms: list[int] = []

    # -- driving -------------------------------------------------------------------------------------
    def expect(self, group: list[RealEvent]) -> None:
        """The GPU's segment events of the next call, for pairing segments."""
        self._expected = [e for e in group if e.action in ("segment_alloc", "segment_map")]
        self._log = []

    def request(self, event: RealEvent) -> list[RealEvent]:
        """Serve the GPU's ``alloc`` (or the request that raised its ``oom``); the model's events for it."""
        try:
            block = self._malloc_block(event.size)
        except torch.OutOfMemoryError:
            self.ooms.append(event.index)
            cap = self.capacity_bytes or 0
            return [*self._log, RealEvent("oom", 0, round_size(event.size), cap - self.reserved_bytes)]
        if event.action == "alloc":
            self._live[event.addr] = block
        addr = 0 if block is None else self._translate(block.ptr)
        if event.action == "oom":  # the GPU failed where the model did not: give the block back
            self._free_block(block)
        return [*self._log, RealEvent("alloc", addr, event.size)]

    def empty(self) -> list[RealEvent]:
        """``torch.cuda.empty_cache()``; the model's events for it."""
        self.empty_cache()
        return list(self._log)

    def release(self, event: RealEvent) -> None:
        """The GPU's ``free_completed``: the model frees its block of that address."""
        if event.addr not in self._live:
            raise ConfigError(f"the stream frees a block at {event.addr:#x} it never allocated; record the "
                              "snapshot from an empty cache or keep its final segments")  # fmt: skip
        self._free_block(self._live.pop(event.addr))

    def seed(self, state: _InitialState) -> None:
        """Start from the segments and blocks alive before the recording (by address, oldest first)."""
        for start in sorted(state.segments):
            size, small = state.segments[start]
            pool = self._small if small else self._large
            ptr = start if self.adopt else CachingAllocator._new_segment_address(self, size)
            self._pair(ptr, start)
            self._reserve(size)
            inside = sorted((a, s) for a, (s, _) in state.blocks.items() if start <= a < start + size)
            cursor, prev = start, None
            pieces: list[tuple[int, int, bool]] = []
            for addr, bsize in inside:
                if addr > cursor:
                    pieces.append((cursor, addr - cursor, False))
                pieces.append((addr, bsize, True))
                cursor = addr + bsize
            if cursor < start + size:
                pieces.append((cursor, start + size - cursor, False))
            for addr, bsize, used in pieces:
                block = _Block(ptr + addr - start, bsize, pool, None)
                block.splice(prev, None)
                prev = block
                if used:
                    block.allocated = True
                    self.allocated_bytes += bsize
                    self._live[addr] = block
                else:
                    pool.add(block)
        self.peak_allocated_bytes = self.allocated_bytes

    # -- the allocator's hooks -----------------------------------------------------------------------
    def _new_segment_address(self, nbytes: int) -> int:
        made = sum(1 for e in self._log if e.action in ("segment_alloc", "segment_map"))
        counterpart = self._expected[made] if made < len(self._expected) else None
        real = None
        if counterpart is not None and (self.expandable_segments or counterpart.size == nbytes):
            real = counterpart.addr  # an expandable segment's first mapping starts at its base
        ptr = real if self.adopt and real is not None else super()._new_segment_address(nbytes)
        self._pair(ptr, real)
        return ptr

    def _segment_event(self, action: str, addr: int, nbytes: int) -> None:
        self._log.append(RealEvent(action, self._translate(addr), nbytes))
        if action == "segment_free":
            i = bisect_right(self._bases, addr) - 1
            del self._real_base[self._bases.pop(i)]

    # -- addresses -----------------------------------------------------------------------------------
    def _pair(self, ptr: int, real: int | None) -> None:
        insort(self._bases, ptr)
        self._real_base[ptr] = real

    def _translate(self, ptr: int) -> int:
        start = self._bases[bisect_right(self._bases, ptr) - 1]
        real = self._real_base[start]
        return -1 if real is None else real + ptr - start
