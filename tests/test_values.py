"""Value shadows computed when read: the same values as computed at once, and no work for values
nobody reads (``memory/trace/values.py``, NOTE [ Values computed when read ])."""

from __future__ import annotations

import pytest
import torch

from batchfit.memory.trace import values
from batchfit.memory.trace.construct import fake_session
from batchfit.memory.trace.values import real_of


def _pending(t: torch.Tensor) -> bool:
    return type(getattr(t.untyped_storage(), values._REAL, None)) is values._Deferred


def _runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    ran: list[str] = []
    run = values._Run.run

    def counted(self: values._Run) -> list[torch.Tensor] | None:
        if self.flat is not None:
            ran.append(str(self.func))
        return run(self)

    monkeypatch.setattr(values._Run, "run", counted)
    return ran


def test_a_value_nobody_reads_is_never_computed_and_one_read_is_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _runs(monkeypatch)
    with fake_session():
        positions = torch.arange(4096, dtype=torch.float32)
        table = torch.outer(positions, torch.ones(64)).cos()  # a rotary table: read by nobody
        assert _pending(table) and ran == []
        lengths = (torch.arange(8) % 3).cumsum(0)
        assert lengths.tolist() == [0, 1, 3, 3, 4, 6, 6, 7]
        assert sorted(ran) == sorted(["aten.arange.default", "aten.remainder.Scalar", "aten.cumsum.default"])
        assert lengths[2:].tolist() == [3, 3, 4, 6, 6, 7]  # a view: a window on the same value
        assert len(ran) == 3 and _pending(table)


def test_a_deferred_op_sees_its_inputs_as_they_were_when_it_was_dispatched() -> None:
    with fake_session():
        x = torch.arange(4.0)
        doubled = x * 2
        plus = doubled + 1
        x.add_(10)  # written after ``doubled`` read it: ``doubled`` keeps the old value
        x[1:3].mul_(0)
        doubled.sub_(1)  # written after ``plus`` read it
        assert real_of(doubled).tolist() == [-1.0, 1.0, 3.0, 5.0]
        assert real_of(plus).tolist() == [1.0, 3.0, 5.0, 7.0]
        assert real_of(x).tolist() == [10.0, 0.0, 0.0, 13.0]


def test_a_deferred_factory_keeps_the_default_dtype_it_was_dispatched_under() -> None:
    previous = torch.get_default_dtype()
    with fake_session():
        torch.set_default_dtype(torch.float64)
        try:
            steps = torch.arange(0, 1, 0.1)
            scaled = steps * 3.3
        finally:
            torch.set_default_dtype(previous)
        assert steps.dtype == torch.float64 and _pending(scaled)
        assert real_of(scaled).tolist() == (torch.arange(0, 1, 0.1, dtype=torch.float64) * 3.3).tolist()


def test_random_draws_are_made_in_dispatch_order_whatever_is_read_first() -> None:
    torch.manual_seed(7)
    with fake_session():
        first = torch.rand(5)
        second = torch.rand(5) + 1
        later, earlier = real_of(second).tolist(), real_of(first).tolist()
    torch.manual_seed(7)
    expected_first, expected_second = torch.rand(5), torch.rand(5) + 1
    assert earlier == expected_first.tolist() and later == expected_second.tolist()


def test_a_value_that_cannot_be_computed_stays_unknown() -> None:
    with fake_session() as mode:
        index = torch.tensor([0, 5])
        table = torch.arange(3.0)
        picked = table[index]  # out of range on the real values: the fake op cannot tell
        assert real_of(picked) is None
        assert bool(picked.sum() > 100) is False and mode.notes  # read as unknown, and noted
