"""Traces compared as the estimate reads them: storages numbered by birth, each described by its bytes,
role, module, op, rows and whether it is paged; runs of frees as sets; phases, FLOPs, gradient hand-overs and notes."""

from __future__ import annotations

from typing import Any

from batchfit.memory.trace.tracer import MemoryTrace


def canonical(trace: MemoryTrace) -> tuple[list[int], list[tuple], list[tuple], dict]:
    """The trace with storages numbered by birth, each described by what the estimate reads of it.

    A run of consecutive frees is compared as a set: the allocator's state after them does not
    depend on their order (freed blocks merge with free neighbours either way), and the order in
    which a graph's tensors die is the order Python drops them, which a second trace need not repeat.
    """
    number: dict[int, int] = {}
    events: list[int] = []
    frees: list[int] = []
    for e in trace.events:
        if e < 0:
            frees.append(~number[~e])
            continue
        events += sorted(frees)
        frees = []
        number[e] = len(number)
        events.append(number[e])
    events += sorted(frees)
    by_number = sorted(number, key=number.__getitem__)
    meta = [(trace.nbytes[s], trace.role.get(s), trace.module.get(s), trace.op.get(s), trace.rows.get(s),
             s in trace.paged) for s in by_number]  # fmt: skip
    return events, meta, trace.phases, trace.flops


def everything(trace: MemoryTrace) -> tuple[Any, ...]:
    """``canonical`` and the gradient hand-overs (storages numbered by birth) and the notes."""
    number = {e: k for k, e in enumerate(e for e in trace.events if e >= 0)}
    grads = [(index, number.get(sid) if sid is not None else None, copied, made) for index, sid, copied, made
             in trace.grads]  # fmt: skip
    return (*canonical(trace), grads, list(trace.notes))
