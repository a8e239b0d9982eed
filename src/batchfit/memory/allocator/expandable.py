"""Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) in the allocator model.

Instead of one cudaMalloc per segment, each pool reserves one large range of address space and maps
physical pages into it as blocks need them (``ExpandableSegment`` in
``c10/cuda/CUDACachingAllocator.cpp``): 2 MiB pages in the small pool, 20 MiB in the large one, and
reserved memory is the mapped pages. ``CachingAllocator`` takes these methods from the mixin below, so
the page arithmetic sits apart from the cudaMalloc path it replaces; the byte accounting
(``_reserve``, ``reserved_bytes``) stays the allocator's.
"""

from __future__ import annotations

from collections.abc import Callable

from .blocks import LARGE_BUFFER, SMALL_BUFFER, _Block, _Pool, _try_merge

# ExpandableSegment reserves address space for totalGlobalMem + totalGlobalMem / 8, room to re-map pages
# unmapped mid-segment at its end. Only used with expandable_segments:True; no setting changes the 8.
EXPANDABLE_SPACE_EXTRA_DIV = 8
# Address space of an expandable segment when capacity is unlimited (1 PiB, never exhausted); not in C++.
UNLIMITED_ADDRESS_SPACE = 1 << 50


def _best_growable(free: list[tuple[int, int, _Block]], i: int) -> int:
    """``get_free_block`` with expandable segments: which entry of ``free`` to take, from the best fit ``i`` on.

    A free block followed by unmapped space can grow, so C++ ranks it by the size it can grow to and moves
    on while the next block is smaller in that sense.
    """
    grown = _growable_size(free[i][2])
    while i + 1 < len(free):
        grown_next = _growable_size(free[i + 1][2])
        if grown_next >= grown:
            break
        i, grown = i + 1, grown_next
    return i


def _growable_size(block: _Block) -> int:
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


class ExpandableSegments:
    """The expandable-segment methods of ``CachingAllocator`` (a mixin: it keeps no state of its own)."""

    capacity_bytes: int | None
    reserved_bytes: int
    _reserve: Callable[[int], None]
    """``CachingAllocator._reserve``: counts reserved bytes and their peak (the host class defines it)."""
    _new_segment_address: Callable[[int], int]
    """``CachingAllocator._new_segment_address``: where new address space starts."""
    _segment_event: Callable[[str, int, int], None]
    """``CachingAllocator._segment_event``: told of each page mapping and unmapping."""

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address with room for ``size``."""
        block = self._find_expandable_block(pool, size)
        if not block.mapped and not self._map_block(block, min(block.size, size)):
            return None
        while block.size < size:
            unmapped = block.next
            assert unmapped is not None and not unmapped.mapped
            if not self._map_block(unmapped, min(size - block.size, unmapped.size)):
                return None  # like C++, pages mapped by this call so far stay mapped
            block = unmapped
        pool.remove(block)
        return block

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: lowest unmapped range (with the free block before it) with room."""
        for ptr in sorted(pool.unmapped):
            start = pool.unmapped[ptr]
            if start.prev is not None and not start.prev.allocated:
                start = start.prev
            room, block = 0, start
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return start
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        cap = self.capacity_bytes
        space = UNLIMITED_ADDRESS_SPACE if cap is None else cap + cap // EXPANDABLE_SPACE_EXTRA_DIV
        space = -(-space // page) * page
        base = self._new_segment_address(space)
        block = _Block(base, space, pool, (base, page), mapped=False)
        pool.unmapped[base] = block
        return block

    def _map_block(self, block: _Block, size: int) -> bool:
        """``map_block``: back the first ``size`` bytes of an unmapped block with whole pages, all or none."""
        base, page = block.seg  # type: ignore[misc]
        first = (block.ptr - base) // page
        nbytes = (-(-(block.ptr + size - base) // page) - first) * page
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            return False
        pool, start = block.pool, block.ptr  # an unmapped block starts on a page boundary
        del pool.unmapped[block.ptr]
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.ptr + nbytes, block.size - nbytes, pool, block.seg, mapped=False)
            rest.splice(block, block.next)
            pool.unmapped[rest.ptr] = rest
            block.size = nbytes
        _try_merge(block, block.prev)
        _try_merge(block, block.next)
        pool.add(block)
        self._reserve(nbytes)
        self._segment_event("segment_map", start, nbytes)
        return True

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: unmap the pages lying wholly inside a free block; partial pages stay free."""
        base, page = block.seg  # type: ignore[misc]
        first = -(-(block.ptr - base) // page)
        last = (block.ptr + block.size - base) // page
        if first >= last:
            return
        pool = block.pool
        pool.remove(block)
        ptr, nbytes = base + first * page, (last - first) * page
        before, after = ptr - block.ptr, block.size - (ptr - block.ptr) - nbytes
        if before > 0:
            head = _Block(block.ptr, before, pool, block.seg)
            head.splice(block.prev, block)
            pool.add(head)
        if after > 0:
            tail = _Block(ptr + nbytes, after, pool, block.seg)
            tail.splice(block, block.next)
            pool.add(tail)
        block.ptr, block.size, block.mapped = ptr, nbytes, False
        _try_merge(block, block.prev)
        _try_merge(block, block.next)
        pool.unmapped[block.ptr] = block
        self.reserved_bytes -= nbytes
        self._segment_event("segment_unmap", ptr, nbytes)
