"""The objects alive before a trace are frozen while it runs, and only then (``memory/heap.py``)."""

from __future__ import annotations

import gc

import pytest

from batchfit.memory.heap import older_objects_frozen


@pytest.fixture
def thawed():
    """The process as a user's is: nothing frozen (the suite freezes after each module: conftest.py)."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    yield
    if frozen:
        gc.freeze()


def test_older_objects_are_frozen_during_the_call_and_thawed_after(thawed) -> None:
    seen = []

    @older_objects_frozen
    def traced(depth: int) -> int:
        seen.append(gc.get_freeze_count())
        return traced(depth - 1) if depth else 7  # nested: the outer freeze stands, nothing refrozen

    assert gc.get_freeze_count() == 0
    assert traced(2) == 7
    assert seen[0] > 1000 and seen == [seen[0]] * 3
    assert gc.get_freeze_count() == 0


def test_thawed_after_a_call_that_raises(thawed) -> None:
    @older_objects_frozen
    def failing() -> None:
        assert gc.get_freeze_count() > 0
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        failing()
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_is_left_as_it_is(thawed) -> None:
    gc.freeze()
    own = gc.get_freeze_count()
    try:
        assert older_objects_frozen(gc.get_freeze_count)() == own
        assert gc.get_freeze_count() == own  # not thawed: they are the process's, not ours
    finally:
        gc.unfreeze()


def test_a_disabled_collector_is_left_alone(thawed) -> None:
    gc.disable()
    try:
        assert older_objects_frozen(gc.get_freeze_count)() == 0
    finally:
        gc.enable()
