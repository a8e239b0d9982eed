"""Sizes and blocks of the CUDA caching allocator model: what a request occupies, and the pieces a segment is cut into.

A request is rounded to 512 bytes, served from the small or the large pool, and, when no cached block
fits, given a segment of 2 MiB, 20 MiB or its own 2 MiB-rounded size. A segment is a chain of
``Block``s linked to their neighbours, kept per pool ordered by (size, address) as ``BlockPool`` does
(``c10/cuda/CUDACachingAllocator.cpp``). This module holds those rules and data structures only; who
cuts and merges blocks, and counts the bytes, is ``allocator.py`` (and ``expandable.py`` for mapped
pages).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import NamedTuple

from ...errors import ConfigError

# kMinBlockSize (CUDACachingAllocator.cpp): requests are rounded up to a multiple of it (round_size).
# PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions rounds larger requests further (not modelled).
MIN_BLOCK_SIZE = 512
# kSmallSize: requests up to this size use the small pool. No setting changes it.
SMALL_SIZE = 1024 * 1024
# kSmallBuffer: small pool segment size, and small pool page size with expandable_segments:True.
SMALL_BUFFER = 2 * 1024 * 1024
# kLargeBuffer (c10/core/AllocatorConfig.h): segment for requests in (1 MiB, 10 MiB), and large pool page
# size with expandable_segments:True. No setting changes these uses.
LARGE_BUFFER = 20 * 1024 * 1024
# kMinLargeAlloc: from this size up, a request gets a segment of its own size. No setting changes it.
MIN_LARGE_ALLOC = 10 * 1024 * 1024
# kRoundLarge: such a segment is rounded up to a multiple of it (get_allocation_size). No setting.
ROUND_LARGE = 2 * 1024 * 1024


def round_size(nbytes: int) -> int:
    """Size of the block a request of ``nbytes`` occupies (``round_size``); 0 for an empty request.

    PyTorch never asks the allocator for 0 bytes (``allocate`` returns a null pointer), so an empty
    tensor occupies nothing rather than the 512 bytes ``round_size(0)`` would give in C++.
    """
    if nbytes < 0:
        raise ConfigError(f"allocation size must be >= 0, got {nbytes}")
    return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def allocation_size(nbytes: int) -> int:
    """Segment size cudaMalloc is asked for when no cached block fits ``nbytes`` (``get_allocation_size``)."""
    size = round_size(nbytes)
    if size == 0:
        return 0
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class SegmentInfo(NamedTuple):
    """One cudaMalloc'ed segment, or one contiguous mapped range of an expandable segment."""

    size: int
    allocated_bytes: int
    small: bool
    expandable: bool


class _Pool:
    """Cached free blocks of one pool, ordered like ``BlockComparatorSize``: by (size, address).

    ``free`` holds ``(size, address, block)``: free blocks never share an address, so entries compare on
    the first two and a best-fit search hands back the block itself, with no lookup by address.
    """

    __slots__ = ("small", "free", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: list[tuple[int, int, _Block]] = []
        self.unmapped: dict[int, _Block] = {}  # expandable address space without pages, by address

    def add(self, block: _Block) -> None:
        insort(self.free, (block.size, block.ptr, block))

    def remove(self, block: _Block) -> None:
        # (size, address) sorts just before its own entry, whatever the block
        del self.free[bisect_left(self.free, (block.size, block.ptr))]


class _Block:
    """A ``Block``: a range of a segment, linked to its neighbours so frees can merge them."""

    __slots__ = ("ptr", "size", "pool", "seg", "mapped", "allocated", "prev", "next")

    def __init__(
        self, ptr: int, size: int, pool: _Pool, seg: tuple[int, int] | None, mapped: bool = True
    ) -> None:
        self.ptr, self.size, self.pool, self.mapped = ptr, size, pool, mapped
        self.seg = seg  # (base address, page size) of its expandable segment, None for a cudaMalloc one
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        self.prev, self.next = before, after
        if before is not None:
            before.next = self
        if after is not None:
            after.prev = self


def _try_merge(dst: _Block, src: _Block | None) -> None:
    """``try_merge_blocks``: absorb a free neighbour in the same mapping state into ``dst``."""
    if src is None or src.allocated or src.mapped != dst.mapped:
        return
    if src.mapped:
        src.pool.remove(src)
    else:
        del src.pool.unmapped[src.ptr]
    if dst.prev is src:
        dst.ptr = src.ptr
        dst.prev = src.prev
        if dst.prev is not None:
            dst.prev.next = dst
    else:
        dst.next = src.next
        if dst.next is not None:
            dst.next.prev = dst
    dst.size += src.size
