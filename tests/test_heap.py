"""Full garbage collections wait while a trace runs, young ones do not (``memory/trace/heap.py``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from batchfit.memory.trace.heap import full_collections_deferred


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generations collected while the test runs, with thresholds that make full collections frequent."""
    seen: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    saved = gc.get_threshold()
    gc.set_threshold(50, 2, 2)
    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*saved)


def _churn() -> None:
    for _ in range(20_000):
        a: list = []
        a.append(a)  # a cycle: only the collector frees it


def test_no_full_collection_while_the_call_runs_and_young_ones_as_ever(collections) -> None:
    gc.collect()
    _churn()
    assert 2 in collections  # the same work outside the call does collect the oldest generation
    collections.clear()
    full_collections_deferred(_churn)()
    assert collections and 2 not in collections  # young generations were collected, the oldest was not
    assert gc.get_threshold() == (50, 2, 2)


def test_thresholds_put_back_after_a_call_that_raises_and_after_a_nested_one(collections) -> None:
    @full_collections_deferred
    def failing(depth: int) -> None:
        assert gc.get_threshold()[2] > 2
        if depth:
            failing(depth - 1)
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        failing(2)
    assert gc.get_threshold() == (50, 2, 2)


def test_a_disabled_collector_is_left_alone(collections) -> None:
    gc.disable()
    try:
        assert full_collections_deferred(gc.get_threshold)() == (50, 2, 2)
        assert not gc.isenabled()
    finally:
        gc.enable()
