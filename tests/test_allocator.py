"""Tests of the caching allocator model against sequences worked out by hand from the C++ rules."""

from __future__ import annotations

import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.errors import ConfigError
from batchfit.memory.allocator.caching import (
    LARGE_BUFFER,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorStats,
    CachingAllocator,
    SegmentInfo,
    allocation_size,
    replay,
    round_size,
)

KiB = 1024
MiB = 1024**2
GiB = 1024**3


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (614400, 614400), (MiB + 1, MiB + 512)],
)
def test_round_size_rounds_up_to_512(nbytes: int, expected: int) -> None:
    assert round_size(nbytes) == expected


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, 0),
        (1, 2 * MiB),
        (MiB, 2 * MiB),  # largest small request
        (MiB + 1, 20 * MiB),  # smallest large request
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB - 1, 10 * MiB),  # rounded to 512 first, which reaches kMinLargeAlloc
        (10 * MiB, 10 * MiB),  # kMinLargeAlloc: own segment from here
        (10 * MiB + 1, 12 * MiB),
        (11 * MiB, 12 * MiB),
        (19 * MiB + 512 * KiB, 20 * MiB),
        (GiB + 1, GiB + 2 * MiB),
    ],
)
def test_allocation_size_by_pool(nbytes: int, expected: int) -> None:
    assert allocation_size(nbytes) == expected


def test_negative_size_is_rejected() -> None:
    with pytest.raises(ConfigError):
        round_size(-1)
    with pytest.raises(ConfigError):
        CachingAllocator().malloc(-1)


def test_zero_byte_malloc_allocates_nothing() -> None:
    a = CachingAllocator(capacity_bytes=1)
    h = a.malloc(0)
    assert (a.allocated_bytes, a.reserved_bytes, a.block_size(h)) == (0, 0, 0)
    a.free(h)
    assert a.stats() == AllocatorStats(0, 0, 0, 0, 0, 0, 1, None, -1)


def test_one_byte_takes_512_bytes_of_a_2mib_small_segment() -> None:
    a = CachingAllocator()
    a.malloc(1)
    assert (a.allocated_bytes, a.reserved_bytes) == (512, 2 * MiB)
    assert a.segments() == [SegmentInfo(2 * MiB, 512, small=True, expandable=False)]


def test_small_requests_share_a_2mib_segment_until_it_is_full() -> None:
    a = CachingAllocator()
    for _ in range(3):  # 3 * 600 KiB = 1800 KiB fit in 2048 KiB
        a.malloc(600 * KiB)
    assert (a.allocated_bytes, a.reserved_bytes) == (3 * 614400, 2 * MiB)
    a.malloc(600 * KiB)  # the 248 KiB left is too small: a second segment
    assert (a.allocated_bytes, a.reserved_bytes) == (4 * 614400, 4 * MiB)


def test_small_block_splits_off_a_leftover_of_exactly_512_bytes() -> None:
    a = CachingAllocator()
    a.malloc(MiB)
    a.malloc(MiB - 512)  # leaves 512 bytes: still split off in the small pool
    assert a.allocated_bytes == 2 * MiB - 512
    a.malloc(1)  # and reused
    assert (a.allocated_bytes, a.reserved_bytes) == (2 * MiB, 2 * MiB)


def test_medium_request_splits_a_20mib_segment_whose_remainder_is_reused() -> None:
    a = CachingAllocator()
    a.malloc(5 * MiB)
    assert (a.allocated_bytes, a.reserved_bytes) == (5 * MiB, 20 * MiB)
    a.malloc(5 * MiB)
    assert (a.allocated_bytes, a.reserved_bytes) == (10 * MiB, 20 * MiB)
    a.malloc(5 * MiB)
    a.malloc(5 * MiB)  # takes the last 5 MiB exactly
    assert (a.allocated_bytes, a.reserved_bytes) == (20 * MiB, 20 * MiB)
    a.malloc(5 * MiB)
    assert (a.allocated_bytes, a.reserved_bytes) == (25 * MiB, 40 * MiB)


def test_large_request_keeps_a_leftover_of_1mib_unsplit_and_counts_it() -> None:
    # 11 MiB -> 12 MiB segment; the 1 MiB leftover is not > kSmallSize, so the block stays whole and
    # memory_allocated counts block->size, all 12 MiB.
    a = CachingAllocator()
    h = a.malloc(11 * MiB)
    assert (a.allocated_bytes, a.reserved_bytes, a.block_size(h)) == (12 * MiB, 12 * MiB, 12 * MiB)


def test_nearly_full_20mib_segment_is_not_split() -> None:
    a = CachingAllocator()
    h = a.malloc(19 * MiB + 512 * KiB)  # leftover 0.5 MiB <= 1 MiB
    assert (a.allocated_bytes, a.reserved_bytes, a.block_size(h)) == (20 * MiB, 20 * MiB, 20 * MiB)
    a.free(h)
    assert (a.allocated_bytes, a.reserved_bytes) == (0, 20 * MiB)  # cached, not returned
    a.empty_cache()
    assert (a.allocated_bytes, a.reserved_bytes, a.segments()) == (0, 0, [])


def test_empty_cache_keeps_segments_that_are_partly_in_use() -> None:
    a = CachingAllocator()
    first = a.malloc(5 * MiB)
    a.malloc(5 * MiB)
    small = a.malloc(KiB)
    a.malloc(KiB)
    a.free(first)  # free head block of a split segment
    a.free(small)
    a.empty_cache()
    assert (a.allocated_bytes, a.reserved_bytes) == (5 * MiB + KiB, 22 * MiB)


def test_large_leftover_over_1mib_is_split_off_and_reused() -> None:
    a = CachingAllocator()
    a.malloc(10 * MiB + 512 * KiB)  # 12 MiB segment, 1.5 MiB leftover is split off
    assert (a.allocated_bytes, a.reserved_bytes) == (10 * MiB + 512 * KiB, 12 * MiB)
    a.malloc(MiB + 512 * KiB)  # a large-pool request that fits the leftover exactly
    assert (a.allocated_bytes, a.reserved_bytes) == (12 * MiB, 12 * MiB)


def test_pools_do_not_share_blocks() -> None:
    a = CachingAllocator()
    a.free(a.malloc(1))  # a free 2 MiB small segment stays cached
    a.malloc(MiB + 512 * KiB)  # large pool: cannot use it
    assert (a.allocated_bytes, a.reserved_bytes) == (MiB + 512 * KiB, 22 * MiB)


def test_best_fit_prefers_lowest_address_among_equal_blocks() -> None:
    a = CachingAllocator()
    blk_a, _, blk_c = (a.malloc(5 * MiB) for _ in range(3))  # D: 5 MiB free at the end
    a.free(blk_a)  # free A (5 MiB at offset 0) and D (5 MiB at offset 15) tie on size
    h = a.malloc(4 * MiB)  # lands in A (lower address); leftover 1 MiB is not split
    assert a.block_size(h) == 5 * MiB and a.allocated_bytes == 15 * MiB
    a.free(blk_c)  # C merges with D into 10 MiB ...
    a.malloc(10 * MiB)  # ... which takes a 10 MiB request without a new segment
    assert (a.allocated_bytes, a.reserved_bytes) == (20 * MiB, 20 * MiB)


def test_free_merges_with_neighbours_so_a_larger_request_fits() -> None:
    a = CachingAllocator()
    blk_a, blk_b, _ = (a.malloc(5 * MiB) for _ in range(3))
    a.free(blk_a)
    a.free(blk_b)  # merges with A: 10 MiB free at offset 0, 5 MiB free at offset 15
    h = a.malloc(8 * MiB)
    assert a.block_size(h) == 8 * MiB  # 2 MiB leftover is split off
    assert (a.allocated_bytes, a.reserved_bytes) == (13 * MiB, 20 * MiB)


def test_new_segment_after_releasing_a_cached_one_counts_a_retry() -> None:
    a = CachingAllocator(capacity_bytes=40 * MiB)
    h20 = a.malloc(20 * MiB)
    a.malloc(11 * MiB)  # 12 MiB segment: 32 MiB reserved
    a.free(h20)
    a.malloc(22 * MiB)  # 32 + 22 > 40: the cached 20 MiB segment is released, then 12 + 22 fits
    assert (a.allocated_bytes, a.reserved_bytes) == (34 * MiB, 34 * MiB)
    assert (a.num_alloc_retries, a.num_ooms, a.peak_reserved_bytes) == (1, 0, 34 * MiB)


def test_exactly_at_capacity_fits_without_retry() -> None:
    a = CachingAllocator(capacity_bytes=32 * MiB)
    a.malloc(20 * MiB)
    a.malloc(12 * MiB)
    assert (a.reserved_bytes, a.num_alloc_retries) == (32 * MiB, 0)
    with pytest.raises(torch.OutOfMemoryError):
        a.malloc(1)


def test_oom_when_nothing_can_be_released() -> None:
    a = CachingAllocator(capacity_bytes=40 * MiB)
    a.malloc(30 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as err:
        a.malloc(12 * MiB)
    assert str(err.value).startswith(
        "CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total capacity of 40.00 MiB of which "
        "10.00 MiB is free. Of the allocated memory 30.00 MiB is allocated by PyTorch, and 0 bytes is "
        "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    assert isinstance(err.value, torch.cuda.OutOfMemoryError)
    assert (a.allocated_bytes, a.reserved_bytes) == (30 * MiB, 30 * MiB)
    assert (a.num_alloc_retries, a.num_ooms) == (1, 1)


def test_oom_with_fragmented_split_segment_reports_unallocated_reserved() -> None:
    a = CachingAllocator(capacity_bytes=40 * MiB)
    a.malloc(11 * MiB)  # 12 MiB segment, wholly allocated
    a.malloc(5 * MiB)  # 20 MiB segment with 15 MiB free: split, so it cannot be released
    with pytest.raises(torch.OutOfMemoryError) as err:
        a.malloc(16 * MiB)  # > 15 MiB free block; 32 + 16 > 40
    assert (
        "Tried to allocate 16.00 MiB. GPU 0 has a total capacity of 40.00 MiB of which 8.00 MiB is free. "
        "Of the allocated memory 17.00 MiB is allocated by PyTorch, and 15.00 MiB is reserved by PyTorch "
        "but unallocated."
    ) in str(err.value)


def test_oom_message_in_gib_and_cache_stays_released_after_oom() -> None:
    a = CachingAllocator(capacity_bytes=24 * GiB)
    a.free(a.malloc(1))  # a cached 2 MiB small segment
    a.malloc(20 * GiB)
    with pytest.raises(torch.OutOfMemoryError) as err:
        a.malloc(5 * GiB)
    assert "Tried to allocate 5.00 GiB. GPU 0 has a total capacity of 24.00 GiB of which 4.00 GiB" in str(
        err.value
    )
    assert (a.reserved_bytes, a.peak_reserved_bytes, a.num_alloc_retries) == (20 * GiB, 20 * GiB + 2 * MiB, 1)


def test_expandable_segments_reserve_less_when_sizes_keep_growing() -> None:
    sizes = [12 * MiB, 14 * MiB, 16 * MiB, 18 * MiB]  # a batch growing step by step
    classic, expandable = CachingAllocator(), CachingAllocator(expandable_segments=True)
    for a in (classic, expandable):
        for n in sizes:
            a.free(a.malloc(n))
    assert classic.reserved_bytes == 12 * MiB + 14 * MiB + 16 * MiB + 18 * MiB  # a stranded segment each
    assert expandable.reserved_bytes == 20 * MiB  # one 20 MiB page, reused by every size
    assert expandable.peak_reserved_bytes == 20 * MiB


def test_expandable_segment_maps_and_unmaps_whole_pages() -> None:
    a = CachingAllocator(expandable_segments=True)
    h12 = a.malloc(12 * MiB)  # page 0; 8 MiB free tail
    assert (a.allocated_bytes, a.reserved_bytes) == (12 * MiB, 20 * MiB)
    h14 = a.malloc(14 * MiB)  # the 8 MiB tail plus page 1: split exactly, 14 MiB free after it
    assert (a.allocated_bytes, a.reserved_bytes, a.block_size(h14)) == (26 * MiB, 40 * MiB, 14 * MiB)
    assert a.segments() == [SegmentInfo(40 * MiB, 26 * MiB, small=False, expandable=True)]
    a.free(h14)
    a.empty_cache()  # page 1 is wholly free and unmapped; [12, 20) MiB stays mapped and free
    assert a.reserved_bytes == 20 * MiB
    a.free(h12)
    a.empty_cache()
    assert (a.reserved_bytes, a.segments()) == (0, [])


def test_expandable_growth_starts_from_the_free_tail_before_unmapped_space() -> None:
    a = CachingAllocator(expandable_segments=True)
    a.malloc(12 * MiB)  # page 0, 8 MiB free tail
    a.malloc(25 * MiB)  # the tail + 17 MiB: one more page, not the two that 25 MiB alone would take
    assert (a.allocated_bytes, a.reserved_bytes) == (37 * MiB, 40 * MiB)


def test_expandable_best_fit_ranks_the_growable_tail_by_its_grown_size() -> None:
    a = CachingAllocator(expandable_segments=True)
    blk_a = a.malloc(10 * MiB)  # page 0: A [0, 10)
    a.malloc(10 * MiB)  # B [10, 20)
    a.malloc(12 * MiB)  # page 1: C [20, 32), free tail [32, 40)
    a.free(blk_a)  # free: A (10 MiB) and the 8 MiB tail, which could grow into unmapped space
    a.malloc(7 * MiB)  # the tail is smaller, yet get_free_block moves on to A
    a.malloc(10 * MiB)  # so A is no longer free for this one: the tail grows by a page
    assert (a.allocated_bytes, a.reserved_bytes) == (39 * MiB, 60 * MiB)


def test_expandable_segment_address_space_is_one_and_an_eighth_of_capacity() -> None:
    # 160 MiB capacity: address space 180 MiB, nine 20 MiB pages.
    a = CachingAllocator(capacity_bytes=160 * MiB, expandable_segments=True)
    pages = [a.malloc(20 * MiB) for _ in range(8)]
    a.free(pages[1])
    a.free(pages[3])
    a.empty_cache()  # holes at pages 1 and 3
    a.free(pages[7])  # page 7 free; only page 8 of address space is left after it
    a.malloc(50 * MiB)  # would need pages 7-9: no room, so a second segment once page 7 is unmapped
    assert (a.allocated_bytes, a.reserved_bytes, a.num_alloc_retries) == (150 * MiB, 160 * MiB, 1)
    assert [s.size for s in a.segments()] == [20 * MiB, 20 * MiB, 60 * MiB, 60 * MiB]


def test_expandable_small_pool_maps_2mib_pages() -> None:
    a = CachingAllocator(expandable_segments=True)
    for _ in range(4):
        a.malloc(600 * KiB)  # 2400 KiB: a second 2 MiB page, contiguous with the first
    assert (a.allocated_bytes, a.reserved_bytes) == (4 * 614400, 4 * MiB)
    assert a.segments() == [SegmentInfo(4 * MiB, 4 * 614400, small=True, expandable=True)]


def test_expandable_oom_when_free_space_is_not_a_whole_page() -> None:
    a = CachingAllocator(capacity_bytes=40 * MiB, expandable_segments=True)
    a.malloc(25 * MiB)  # two 20 MiB pages, the last 15 MiB of them free
    with pytest.raises(torch.OutOfMemoryError) as err:
        a.malloc(1)  # the small pool needs a 2 MiB page; no whole large page is free to unmap
    assert (
        "Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 40.00 MiB of which 0 bytes is free. "
        "Of the allocated memory 25.00 MiB is allocated by PyTorch, and 15.00 MiB is reserved"
    ) in str(err.value)
    assert (a.reserved_bytes, a.num_alloc_retries, a.num_ooms) == (40 * MiB, 1, 1)


def test_expandable_retry_unmaps_free_pages_to_make_room() -> None:
    a = CachingAllocator(capacity_bytes=40 * MiB, expandable_segments=True)
    a.free(a.malloc(30 * MiB))  # 40 MiB mapped, all free
    a.malloc(1)
    assert (a.allocated_bytes, a.reserved_bytes, a.num_alloc_retries) == (512, 2 * MiB, 1)


def test_free_of_unknown_or_freed_handle_is_rejected() -> None:
    a = CachingAllocator()
    h = a.malloc(1)
    a.free(h)
    with pytest.raises(ConfigError):
        a.free(h)
    with pytest.raises(ConfigError):
        a.free(12345)


def test_reset_peak_restarts_from_current_values() -> None:
    a = CachingAllocator()
    h = a.malloc(11 * MiB)
    a.free(h)
    a.empty_cache()
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (12 * MiB, 12 * MiB)
    a.malloc(1)
    a.reset_peak()
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes, a.stats().peak_event_index) == (512, 2 * MiB, 2)


def test_peak_event_index_points_at_the_event_that_set_the_peak() -> None:
    events = [(True, 1, 5 * MiB), (True, 2, 30 * MiB), (False, 2, 0), (True, 3, 40 * MiB), (False, 1, 0)]
    stats = replay(events)
    assert (stats.peak_reserved_bytes, stats.peak_event_index) == (90 * MiB, 3)
    assert replay([]).peak_event_index == -1


def test_replay_matches_driving_the_allocator_by_hand() -> None:
    events = [(True, 1, 5 * MiB), (True, 2, 0), (True, 3, 700 * KiB), (False, 1, 0), (False, 2, 0)]
    events += [(True, 4, 11 * MiB), (True, 5, 3 * MiB), (False, 3, 0)]
    a = CachingAllocator()
    handles = {}
    for is_alloc, key, nbytes in events:
        if is_alloc:
            handles[key] = a.malloc(nbytes)
        else:
            a.free(handles.pop(key))
    # 11 MiB and then 3 MiB are cut from the 20 MiB segment freed at event 3: no new segment.
    expected = AllocatorStats(
        allocated_bytes=14 * MiB,
        reserved_bytes=20 * MiB + 2 * MiB,
        peak_allocated_bytes=14 * MiB + 700 * KiB,
        peak_reserved_bytes=22 * MiB,
        num_alloc_retries=0,
        num_ooms=0,
        capacity_bytes=None,
        oom_at_event=None,
        peak_event_index=2,
    )
    assert a.stats() == expected
    assert replay(events) == expected


def test_replay_stops_at_the_first_oom() -> None:
    # the free of key 99 after the OOM would be rejected if the replay went on
    events = [(True, 1, 20 * MiB), (True, 2, 10 * MiB), (False, 1, 0), (True, 3, 40 * MiB), (False, 99, 0)]
    stats = replay(events, capacity_bytes=40 * MiB)
    assert stats.oom_at_event == 3
    assert (stats.allocated_bytes, stats.reserved_bytes) == (10 * MiB, 10 * MiB)  # 20 MiB released on retry
    assert (stats.num_alloc_retries, stats.num_ooms, stats.peak_reserved_bytes) == (1, 1, 30 * MiB)
    assert replay(events[:3], capacity_bytes=40 * MiB).oom_at_event is None


def test_replay_rejects_malformed_traces() -> None:
    with pytest.raises(ConfigError):
        replay([(False, 7, 0)])
    with pytest.raises(ConfigError):
        replay([(True, 7, 10), (True, 7, 10)])


def test_replay_of_200k_events_is_fast() -> None:
    rng = random.Random(0)
    events: list[tuple[bool, int, int]] = []
    live: list[int] = []
    key = 0
    while len(events) < 200_000:
        key += 1
        n = rng.randrange(1, SMALL_SIZE) if rng.random() < 0.6 else rng.randrange(SMALL_SIZE, 64 * MiB)
        events.append((True, key, n))
        live.append(key)
        if rng.random() < 0.95:
            j = rng.randrange(len(live))
            live[j], live[-1] = live[-1], live[j]
            events.append((False, live.pop(), 0))
    for expandable in (False, True):
        start = time.perf_counter()
        stats = replay(events, expandable_segments=expandable)
        assert time.perf_counter() - start < 5.0
        alive = set(live)
        assert stats.allocated_bytes >= sum(round_size(n) for alloc, k, n in events if alloc and k in alive)


class _ReferenceAllocator:
    """Classic mode written the slow, obvious way: a scan over every block of every segment."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.segments: list[tuple[int, bool, list[list[int]]]] = []  # (order, small, [[size, owner]])
        self.retries = 0

    def reserved(self) -> int:
        return sum(size for _, _, blocks in self.segments for size, _ in blocks)

    def malloc(self, nbytes: int, owner: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        best = None
        for order, seg_small, blocks in self.segments:
            offset = 0
            for i, (bsize, bowner) in enumerate(blocks):
                if seg_small == small and bowner == 0 and bsize >= size:
                    candidate = ((bsize, order, offset), blocks, i)
                    best = candidate if best is None or candidate[0] < best[0] else best
                offset += bsize
        if best is None:
            alloc = allocation_size(size)
            if self.capacity is not None and self.reserved() + alloc > self.capacity:
                self.segments = [s for s in self.segments if not (len(s[2]) == 1 and s[2][0][1] == 0)]
                self.retries += 1
                if self.reserved() + alloc > self.capacity:
                    raise torch.OutOfMemoryError("reference")
            order = max((s[0] for s in self.segments), default=-1) + 1
            self.segments.append((order, small, [[alloc, 0]]))
            blocks, i = self.segments[-1][2], 0
        else:
            _, blocks, i = best
        remaining = blocks[i][0] - size
        if remaining >= 512 if small else remaining > SMALL_SIZE:
            blocks[i : i + 1] = [[size, owner], [remaining, 0]]
        else:
            blocks[i][1] = owner

    def free(self, owner: int) -> None:
        for _, _, blocks in self.segments:
            for i, block in enumerate(blocks):
                if block[1] == owner:
                    block[1] = 0
                    if i + 1 < len(blocks) and blocks[i + 1][1] == 0:
                        block[0] += blocks.pop(i + 1)[0]
                    if i > 0 and blocks[i - 1][1] == 0:
                        blocks[i - 1][0] += blocks.pop(i)[0]
                    return


_SIZES = st.one_of(
    st.just(0),
    st.integers(1, SMALL_SIZE),
    st.integers(SMALL_SIZE + 1, MIN_LARGE_ALLOC - 1),
    st.integers(MIN_LARGE_ALLOC, 48 * MiB),
)
_OPS = st.lists(st.tuples(st.booleans(), _SIZES, st.integers(0, 1000)), max_size=80)
_CAPACITY = st.one_of(st.none(), st.integers(8 * MiB, 200 * MiB))


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, capacity=_CAPACITY)
def test_classic_mode_matches_a_brute_force_reference(ops, capacity) -> None:
    a, ref = CachingAllocator(capacity), _ReferenceAllocator(capacity)
    live: list[tuple[int, int]] = []
    for owner, (is_alloc, nbytes, pick) in enumerate(ops, start=1):
        if is_alloc or not live:
            try:
                handle = a.malloc(nbytes)
            except torch.OutOfMemoryError:
                with pytest.raises(torch.OutOfMemoryError):
                    ref.malloc(nbytes, owner)
            else:
                if nbytes:
                    ref.malloc(nbytes, owner)
                live.append((handle, owner))
        else:
            handle, ref_owner = live.pop(pick % len(live))
            a.free(handle)
            ref.free(ref_owner)
        sizes = {o: s for _, _, blocks in ref.segments for s, o in blocks if o}
        assert {o: a.block_size(h) for h, o in live if h} == sizes
        assert (a.allocated_bytes, a.reserved_bytes) == (sum(sizes.values()), ref.reserved())
        assert a.num_alloc_retries == ref.retries


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, capacity=_CAPACITY, expandable=st.booleans())
def test_accounting_invariants_hold_on_random_sequences(ops, capacity, expandable) -> None:
    a = CachingAllocator(capacity, expandable_segments=expandable)
    live: list[tuple[int, int]] = []
    ooms = 0
    for is_alloc, nbytes, pick in ops:
        if is_alloc or not live:
            before = a.allocated_bytes
            try:
                live.append((a.malloc(nbytes), nbytes))
            except torch.OutOfMemoryError:
                ooms += 1
                assert capacity is not None and a.allocated_bytes == before
                if not expandable:  # a new segment really does not fit, even with the cache released
                    assert a.reserved_bytes + allocation_size(nbytes) > capacity
        else:
            a.free(live.pop(pick % len(live))[0])
        for handle, nbytes in live:
            slack = SMALL_SIZE if round_size(nbytes) > SMALL_SIZE and not expandable else 0
            assert round_size(nbytes) <= a.block_size(handle) <= round_size(nbytes) + slack
        assert a.allocated_bytes == sum(a.block_size(h) for h, _ in live)
        assert a.allocated_bytes <= a.reserved_bytes <= (capacity or a.reserved_bytes)
        segments = a.segments()
        assert sum(s.size for s in segments) == a.reserved_bytes
        assert sum(s.allocated_bytes for s in segments) == a.allocated_bytes
        for s in segments:
            if expandable:
                assert s.size % (SMALL_BUFFER if s.small else LARGE_BUFFER) == 0
            elif s.small:
                assert s.size == SMALL_BUFFER
            else:
                assert s.size == LARGE_BUFFER or (s.size >= MIN_LARGE_ALLOC and s.size % ROUND_LARGE == 0)
        assert a.peak_allocated_bytes >= a.allocated_bytes and a.peak_reserved_bytes >= a.reserved_bytes
    assert a.num_ooms == ooms
    for handle, _ in live:
        a.free(handle)
    assert a.allocated_bytes == 0
    a.empty_cache()
    assert (a.reserved_bytes, a.segments()) == (0, [])


def _order_decides(s: int, head: int, g: int) -> list[tuple[bool, int, int]]:
    """Two free blocks of ``s`` bytes, one a whole segment, one the tail of a segment whose ``head`` bytes are live;
    a request of ``s`` takes the one at the lower address, and a request of ``g`` then needs a new segment, which
    fits only if the whole free segment is left to release. The split segment is made first."""
    return [(True, 2, s + head), (True, 1, s), (False, 2, 0), (True, 3, head), (False, 1, 0), (True, 4, s),
            (True, 5, g)]  # fmt: skip


def test_which_of_two_equal_free_blocks_is_reused_follows_the_segments_addresses() -> None:
    """Ascending addresses (the first segment lowest) reuse the split segment's tail, and the whole free segment is
    released for the last request; descending ones (each new segment below the last, as the driver gave the
    recorded Llama-3.1-8B LoRA steps) reuse the whole free segment and leave nothing to release, so the last
    request runs out of memory."""
    s, head, g = 64 * MiB, 20 * MiB, 100 * MiB
    capacity = 2 * s + head + g - 2 * MiB
    events = _order_decides(s, head, g)
    ascending = replay(events, capacity_bytes=capacity)
    descending = replay(events, capacity_bytes=capacity, descending_addresses=True)
    assert descending.oom_at_event == len(events) - 1
    assert ascending.oom_at_event is None and ascending.num_alloc_retries == 1
    assert ascending.peak_reserved_bytes == (s + head) + g  # the whole free segment released, the new one made


class _Stream:
    """A trace's timeline as ``MemoryTrace`` keeps it: storage ids, ``~sid`` for a free, sizes and op labels by id."""

    def __init__(self, events: list[tuple[bool, int, int]], op: dict[int, str] | None = None) -> None:
        self.events = [key if is_alloc else ~key for is_alloc, key, _ in events]
        self.nbytes = {key: nbytes for is_alloc, key, nbytes in events if is_alloc}
        self.paged: set[int] = set()
        self.op = op or {}


@pytest.mark.parametrize(("release", "runs"), [("2.11", False), ("2.12", False), ("2.13", True), ("2.14", True)])
def test_an_estimate_replays_the_tie_order_of_the_allocators_torch(monkeypatch, release: str, runs: bool) -> None:
    """NOTE [ Fits whatever addresses the driver gives ]: up to torch 2.12 the newest segment lies lowest and its
    block is reused first, which leaves nothing to release; from 2.13 the oldest segment's block is, and the step
    runs (``BATCHFIT_ALLOCATOR_TORCH`` names the release)."""
    from batchfit.memory.estimate import ALLOCATOR_TORCH, _bounded_replay

    monkeypatch.setenv(ALLOCATOR_TORCH, release)
    s, head, g = 64 * MiB, 20 * MiB, 100 * MiB
    events = _order_decides(s, head, g)
    replayed = _bounded_replay(_Stream(events), 2 * s + head + g - 2 * MiB, False)
    assert (replayed is not None) is runs
    if replayed is not None:
        assert replayed.peak_reserved_bytes == (s + head) + g


def test_a_torch_release_that_cannot_be_read_is_one_error_naming_the_setting(monkeypatch) -> None:
    from batchfit.errors import ConfigError
    from batchfit.memory.estimate import ALLOCATOR_TORCH, allocator_tie_order

    monkeypatch.setenv(ALLOCATOR_TORCH, "newest")
    with pytest.raises(ConfigError, match="BATCHFIT_ALLOCATOR_TORCH='newest' names no torch release"):
        allocator_tie_order()


def test_a_cudnn_workspace_that_does_not_fit_is_done_without() -> None:
    """NOTE [ A workspace cuDNN can do without ]: an optional allocation that runs out of memory (after the cache
    was released and the request retried) is counted as an out-of-memory error and skipped with its free; the step
    goes on. The same request not optional ends the replay there."""
    from batchfit.memory.allocator.caching import StorageEvents
    from batchfit.memory.estimate import _bounded_replay
    from batchfit.memory.kernels.cudnn import WORKSPACE

    act, ws, grad = 40 * MiB, 60 * MiB, 30 * MiB
    events = [(True, 1, act), (True, 2, ws), (False, 2, 0), (True, 3, grad), (False, 1, 0), (False, 3, 0)]
    timeline = _Stream(events, {2: f"{WORKSPACE} (forward)"})
    capacity = act + grad + 20 * MiB  # room for the step's tensors, not for the workspace beside them
    kept = replay(StorageEvents(timeline.events, timeline.nbytes), capacity_bytes=capacity)
    assert kept.oom_at_event == 1
    done = _bounded_replay(timeline, capacity, False)
    assert done is not None
    assert (done.num_ooms, done.num_alloc_retries, done.peak_allocated_bytes) == (1, 1, act + grad)
    assert _bounded_replay(_Stream(events), capacity, False) is None  # the same request, not a workspace
