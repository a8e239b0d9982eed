"""A model of PyTorch's CUDA caching allocator: the GPU memory a training step reserves, without a GPU.

Whether a step fits is decided by ``torch.cuda.memory_reserved``, not by the sum of tensor sizes: requests
are rounded to 512 bytes, small and large ones live in separate pools of 2 MiB and 20 MiB (or 2 MiB-rounded)
segments, a block is split only when the leftover is worth keeping, and freed blocks stay cached. So a
traced step is replayed through this model of ``DeviceCachingAllocator``
(``c10/cuda/CUDACachingAllocator.cpp``); docstrings name the C++ function each method mirrors. This
module counts the bytes (malloc, free, release, replay); the sizes and the blocks a segment is cut into
are ``blocks.py``, and expandable segments' page mapping is ``expandable.py`` (both re-exported here).

Limitations:
    * One device, one stream: ``record_stream`` and the events that delay reuse across streams are not
      modelled, a freed block is reusable at once.
    * No CUDA graph private pools, no per-process memory fraction (so no garbage collection threshold), no
      free-memory callbacks. ``max_split_size_mb``, ``max_non_split_rounding_mb`` and
      ``roundup_power2_divisions`` keep their defaults (unlimited, 20 MiB, off); with an unlimited
      max_split_size ``release_available_cached_blocks`` frees nothing, so it is left out.
    * ``capacity_bytes`` is what the allocator can get from the driver (the CUDA context and other
      processes are the caller's to subtract); "free" in the out-of-memory message is capacity - reserved.
    * New segments get increasing, never reused addresses, or with ``descending_addresses`` decreasing
      ones, each below every earlier segment. The driver does either: of the recorded H200 streams, some
      placed nearly every new segment below all earlier ones (a ResNet, BERT, T5, GPT-2, the Llama-3.1-8B
      LoRA step), others above (the Llama-shaped decoder, ViT, the Qwen2.5-7B LoRA step), and none reused
      a freed address. Addresses only break ties between free blocks of equal size, which changes which of
      two equal blocks is reused and split, never the bytes of the allocation being made; but near the
      capacity that decides whether a large block is found: the 8B LoRA step at 15 items ran out of memory
      on the GPU (descending addresses) and in the model's descending replay, and runs in the ascending
      one. NOTE [ Fits whatever addresses the driver gives ] in ``memory/estimate.py`` says which order an
      estimate replays.
    * Expandable segments map and unmap pages as ``ExpandableSegment`` does (2 MiB pages in the small pool,
      20 MiB in the large one) and reserved memory is the mapped pages. A segment's address space is 1 1/8
      of the capacity (C++: of the GPU's total memory). Driver granularity, mapping cost and IPC are not
      modelled.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ...errors import ConfigError
from .blocks import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    SegmentInfo,
    _Block,
    _Pool,
    _try_merge,
    allocation_size,
    round_size,
)
from .expandable import (
    EXPANDABLE_SPACE_EXTRA_DIV,
    UNLIMITED_ADDRESS_SPACE,
    ExpandableSegments,
    _best_growable,
)

_DESCENDING_TOP = 1 << 56
"""Where descending addresses start: above any address space the replays can use (2**56 bytes)."""

__all__ = [
    "EXPANDABLE_SPACE_EXTRA_DIV",
    "LARGE_BUFFER",
    "MIN_BLOCK_SIZE",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "UNLIMITED_ADDRESS_SPACE",
    "AllocatorStats",
    "CachingAllocator",
    "SegmentInfo",
    "allocation_size",
    "replay",
    "round_size",
]

# The remedy PyTorch appends to every out-of-memory message (DeviceCachingAllocator::malloc).
_OOM_HINT = (
    " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True to avoid fragmentation.  See documentation for Memory Management "
    " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def _format_size(nbytes: int) -> str:
    """``format_size`` of the C++ allocator, so out-of-memory messages read exactly like PyTorch's."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes > scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


@dataclass(frozen=True)
class AllocatorStats:
    """The numbers of ``torch.cuda.memory_stats`` a fit decision needs, frozen at one moment.

    ``oom_at_event`` is the index of the first malloc/free call (replay event) that ran out of memory and
    ``peak_event_index`` of the call during which reserved memory reached its peak (-1 while nothing was
    ever reserved), so a report can point at the tensor responsible.
    """

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_alloc_retries: int
    num_ooms: int
    capacity_bytes: int | None
    oom_at_event: int | None = None
    peak_event_index: int = -1


class CachingAllocator(ExpandableSegments):
    """One device's caching allocator: ``malloc``/``free`` with the byte accounting of the real one.

    Every ``malloc`` and ``free`` call is one event, numbered from 0, so that a replay can say which
    event set the peak or ran out of memory.
    """

    def __init__(
        self, capacity_bytes: int | None = None, *, expandable_segments: bool = False,
        descending_addresses: bool = False,
    ) -> None:  # fmt: skip
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ConfigError(f"capacity must be positive or None (unlimited), got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.expandable_segments = expandable_segments
        self.allocated_bytes = self.reserved_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0
        self.num_alloc_retries = self.num_ooms = 0
        self._small, self._large = _Pool(True), _Pool(False)
        self._live: dict[int, _Block] = {}
        self._handles = itertools.count(1)  # 0 is the null handle of an empty request
        self._next_addr = SMALL_BUFFER  # any nonzero start: 0 is below every real address
        self._descending = descending_addresses
        self._lowest_addr = _DESCENDING_TOP
        self._events = 0
        self._peak_event = -1
        self._oom_at_event: int | None = None

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` and return a handle for ``free`` (``DeviceCachingAllocator::malloc``).

        A request of 0 bytes returns the null handle 0 and counts nothing, as PyTorch does.

        Raises:
            torch.OutOfMemoryError: no cached block fits and a new segment does not fit in the capacity,
                even after releasing every fully free cached segment. Those segments stay released.
        """
        block = self._malloc_block(nbytes)
        if block is None:
            return 0
        handle = next(self._handles)
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """Return a block to its pool, merged with free neighbours (``free`` / ``free_block``).

        Raises:
            ConfigError: the handle is not live (never returned by ``malloc``, or already freed).
        """
        block = self._live.pop(handle, None)
        if block is None and handle != 0:
            self._events += 1
            raise ConfigError(f"free of handle {handle}, which is not a live allocation")
        self._free_block(block)

    def _malloc_block(self, nbytes: int) -> _Block | None:
        """``malloc`` without the handle: the allocated block, or None for an empty request.

        ``replay`` keeps blocks under its own keys, so its hot loop needs no handle table.
        """
        self._events += 1
        if nbytes <= 0:
            round_size(nbytes)  # a ConfigError for a negative size
            return None
        size = -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE  # round_size, inlined on this hot path
        small = size <= SMALL_SIZE
        pool = self._small if small else self._large
        expandable = self.expandable_segments
        # get_free_block: best fit, the smallest free block of at least size, lowest address first ((size,)
        # sorts before every entry of that size). Inlined: it runs once per malloc.
        free = pool.free
        i = bisect_left(free, (size,))
        if i == len(free):
            block = self._alloc_block_or_oom(pool, size)
        else:
            if expandable:
                i = _best_growable(free, i)
            block = free.pop(i)[2]
        remaining = block.size - size
        # should_split: a large cudaMalloc block keeps a leftover of up to 1 MiB rather than splitting it.
        if remaining >= MIN_BLOCK_SIZE if small or expandable else remaining > SMALL_SIZE:
            head = _Block(block.ptr, size, pool, block.seg)
            head.splice(block.prev, block)
            block.ptr += size
            block.size = remaining
            insort(free, (remaining, block.ptr, block))  # pool.add
            block = head
        block.allocated = True
        # the whole block, leftover included, as memory_allocated counts
        allocated = self.allocated_bytes = self.allocated_bytes + block.size
        if allocated > self.peak_allocated_bytes:
            self.peak_allocated_bytes = allocated
        return block

    def _free_block(self, block: _Block | None) -> None:
        """``free`` of a block rather than a handle; None is an empty request's, which frees nothing."""
        self._events += 1
        if block is None:
            return
        block.allocated = False
        self.allocated_bytes -= block.size
        # Most neighbours are allocated: look before calling _try_merge, which checks again.
        prev, after = block.prev, block.next
        if prev is not None and not prev.allocated:
            _try_merge(block, prev)
        if after is not None and not after.allocated:
            _try_merge(block, after)
        insort(block.pool.free, (block.size, block.ptr, block))  # pool.add, inlined: once per free

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``: release every fully free segment and every free expandable page."""
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: peaks restart from the current values."""
        self.peak_allocated_bytes = self.allocated_bytes
        self.peak_reserved_bytes = self.reserved_bytes
        self._peak_event = self._events - 1

    def stats(self) -> AllocatorStats:
        """A frozen copy of the counters, safe to keep while the allocator goes on."""
        return AllocatorStats(
            self.allocated_bytes,
            self.reserved_bytes,
            self.peak_allocated_bytes,
            self.peak_reserved_bytes,
            self.num_alloc_retries,
            self.num_ooms,
            self.capacity_bytes,
            self._oom_at_event,
            self._peak_event,
        )

    def block_size(self, handle: int) -> int:
        """Bytes the live allocation ``handle`` counts in ``allocated_bytes`` (its whole block)."""
        return 0 if handle == 0 else self._live[handle].size

    def block_address(self, handle: int) -> int:
        """The simulated device address of the live allocation ``handle`` (for memory snapshots)."""
        return 0 if handle == 0 else self._live[handle].ptr

    def segments(self) -> list[SegmentInfo]:
        """Segments by address, as ``torch.cuda.memory_snapshot`` lists them; sizes add up to reserved."""
        blocks = [*self._live.values()]
        for pool in (self._small, self._large):
            blocks += [entry[2] for entry in pool.free]
            blocks += pool.unmapped.values()
        result = []
        for head in sorted(blocks, key=lambda b: (b.pool.small, b.ptr)):
            if not head.mapped or (head.prev is not None and head.prev.mapped):
                continue
            size = used = 0
            block: _Block | None = head
            while block is not None and block.mapped:
                size += block.size
                used += block.size if block.allocated else 0
                block = block.next
            result.append(SegmentInfo(size, used, head.pool.small, head.seg is not None))
        return result

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
            self._peak_event = self._events - 1

    def _alloc_block_or_oom(self, pool: _Pool, size: int) -> _Block:
        """A new segment for ``size``, releasing cached segments and retrying once if it does not fit.

        Raises:
            torch.OutOfMemoryError: the retry did not fit either.
        """
        alloc_size = allocation_size(size)
        block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self._release_cached_blocks()
            self.num_alloc_retries += 1
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self.num_ooms += 1
            if self._oom_at_event is None:
                self._oom_at_event = self._events - 1
            raise torch.OutOfMemoryError(self._oom_message(alloc_size))
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        """``alloc_block``: a new cudaMalloc segment, or new pages of an expandable segment; None if full."""
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        if self.capacity_bytes is not None and self.reserved_bytes + alloc_size > self.capacity_bytes:
            return None
        self._reserve(alloc_size)
        ptr = self._new_segment_address(alloc_size)
        self._segment_event("segment_alloc", ptr, alloc_size)
        return _Block(ptr, alloc_size, pool, None)

    def _new_segment_address(self, nbytes: int) -> int:
        """Where a new segment (or an expandable segment's address space) of ``nbytes`` starts: the next
        unused address. A replay of a real GPU's events takes the GPU's own addresses instead
        (``memory/allocator/stream_replay.py``)."""
        if self._descending:
            self._lowest_addr -= nbytes
            return self._lowest_addr
        ptr = self._next_addr
        self._next_addr += nbytes
        return ptr

    def _segment_event(self, action: str, addr: int, nbytes: int) -> None:
        """Called at each ``segment_alloc`` / ``segment_free`` / ``segment_map`` / ``segment_unmap``, the
        actions a memory snapshot's trace names; nothing here (a replay of a real stream logs them)."""

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: cudaFree unsplit free segments, unmap whole free expandable pages."""
        for pool in (self._large, self._small):
            to_unmap = []
            for _, _, block in list(pool.free):
                if block.seg is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    pool.remove(block)
                    self.reserved_bytes -= block.size
                    self._segment_event("segment_free", block.ptr, block.size)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and block.prev is None and block.next is None:
                    del pool.unmapped[block.ptr]  # release_expandable_segment: nothing of it is mapped

    def _oom_message(self, alloc_size: int) -> str:
        cap, reserved, allocated = self.capacity_bytes or 0, self.reserved_bytes, self.allocated_bytes
        return (
            f"CUDA out of memory. Tried to allocate {_format_size(alloc_size)}. GPU 0 has a total "
            f"capacity of {_format_size(cap)} of which {_format_size(cap - reserved)} is free. "
            f"Of the allocated memory {_format_size(allocated)} is allocated by PyTorch, and "
            f"{_format_size(reserved - allocated)} is reserved by PyTorch but unallocated." + _OOM_HINT
        )


@dataclass(frozen=True)
class StorageEvents:
    """A trace's timeline as ``replay`` takes it without a tuple per event: ``events[i] = sid`` allocates storage
    ``sid`` of ``nbytes[sid]`` bytes, ``~sid`` frees it; storages in ``skip`` are not the allocator's (paged
    memory). A plan replays tens of traces of 10^5 events each: built tuples cost a tenth of each replay."""

    events: list[int]
    nbytes: dict[int, int]
    skip: set[int] | frozenset[int] = frozenset()
    optional: set[int] | frozenset[int] = frozenset()
    """Storages a kernel can do without: where one runs out of memory the step goes on without it (a cuDNN
    convolution's workspace, whose engine falls back to one that needs none; ``replay``'s Returns)."""


def _replay_storages(alloc: CachingAllocator, timeline: StorageEvents) -> AllocatorStats:
    """``replay``'s loop over a ``StorageEvents``, with its checks."""
    malloc, free = alloc._malloc_block, alloc._free_block
    nbytes, skip, optional = timeline.nbytes, timeline.skip, timeline.optional
    refused: set[int] = set()
    blocks: dict[int, _Block | None] = {}
    for e in timeline.events:
        if e >= 0:
            if e in skip:
                continue
            if e in blocks:
                raise ConfigError(f"allocation key {e} is already live; free it before reusing the key")
            try:
                blocks[e] = malloc(nbytes[e])
            except torch.OutOfMemoryError:
                if e not in optional:
                    break
                refused.add(e)  # the kernel's fall-back: the step goes on, its out-of-memory error caught
                alloc._oom_at_event = None
        elif ~e in refused:
            refused.discard(~e)
        elif ~e not in skip:
            try:
                block = blocks.pop(~e)
            except KeyError:
                raise ConfigError(f"free of key {~e}, which has no live allocation") from None
            free(block)
    return alloc.stats()


def replay(
    events: Iterable[tuple[bool, int, int]] | StorageEvents,
    *,
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
    descending_addresses: bool = False,
) -> AllocatorStats:
    """Run a memory trace through a fresh allocator and return its counters.

    Args:
        events: ``(is_alloc, key, nbytes)``; a free names the key of a live earlier allocation and its
            ``nbytes`` is ignored. Event ``i`` is the allocator's event ``i``. Or a ``StorageEvents``, the same
            without a tuple per event.
        capacity_bytes: memory the allocator may reserve; None for unlimited.
        expandable_segments: model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        descending_addresses: new segments below every earlier one (the driver's other order; see the module's
            notes).

    Returns:
        The counters after the last event, or at the first out-of-memory event, where the replay stops
        (``oom_at_event``) instead of raising: what happens after an OOM depends on how the program
        handles it, so a replay does not guess.

    Raises:
        ConfigError: a free of a key that is not live, or an allocation reusing a live key.
    """
    alloc = CachingAllocator(capacity_bytes, expandable_segments=expandable_segments,
                             descending_addresses=descending_addresses)  # fmt: skip
    if isinstance(events, StorageEvents):
        return _replay_storages(alloc, events)
    malloc, free = alloc._malloc_block, alloc._free_block
    blocks: dict[int, _Block | None] = {}
    for is_alloc, key, nbytes in events:
        if is_alloc:
            if key in blocks:
                raise ConfigError(f"allocation key {key} is already live; free it before reusing the key")
            try:
                blocks[key] = malloc(nbytes)
            except torch.OutOfMemoryError:
                break
        else:
            try:
                block = blocks.pop(key)
            except KeyError:
                raise ConfigError(f"free of key {key}, which has no live allocation") from None
            free(block)
    return alloc.stats()
