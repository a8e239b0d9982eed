"""The trace of an accumulating step (two micro-batches per optimizer step), built from the trace of
a plain one instead of running a second forward and backward.

NOTE [ A second micro-batch is the first one again, with the gradients alive ]
A step with gradient accumulation runs, per optimizer step, micro-batch 1 (exactly the plain step's
batch, forward and backward), then micro-batch 2, then the optimizer. Micro-batch 2 runs the same ops
on the same shapes, so it allocates and frees what the plain step's second micro-batch did (the
trace's second step: the first one also allocates what is made once, such as a library's workspace),
with three differences, all readable from the plain trace:

* the gradients of micro-batch 1 are alive throughout;
* where backward hands a parameter its gradient, autograd adds it into the ``.grad`` in place
  (``AccumulateGrad``: ``variable_grad += new_grad`` for dense tensors with grad mode off), so the
  backward op's output is freed right there instead of becoming the ``.grad``, and a gradient that
  micro-batch 1 *copied* into a new storage (a layout that breaks the layout contract) is not
  allocated at all (``Tracer`` records which, ``MemoryTrace.grads``);
* what a micro-batch frees of the one before it (the previous batch and loss, released when the
  loop's variables are reassigned) is the previous micro-batch's.

FSDP2's sharded gradients, views of one reduce-scatter output per unit, are handed over as that buffer, once,
where a later micro-batch frees its own (NOTE [ Gradients that are views of a reduce-scatter's output ] in
``memory/trace/tracer.py``): a backward output like the others.

The plain trace's other lifetimes must be of the kinds this models (freed within the micro-batch, a
gradient, kept until the next micro-batch or the end, or never freed); anything else (a gradient that
is not dense or is a view of a larger buffer, a storage of one step freed by the optimizer, a free of
something made elsewhere) makes ``accumulating_trace`` return None, and the step is traced for real.
``tests/test_accumulation.py`` compares the result with a real trace of the accumulating step, event
for event, across the zoo.

Used for GPU targets only: on the CPU the trace measures real kernels' scratch, and the in-place add
of micro-batch 2 is a kernel the plain step never ran. A model whose sizes depend on the batch's
values (tokens routed by their ids) gets micro-batch 2 with the sizes of the plain step's second batch:
one drawn batch as good as another, but not the one a real trace of the accumulating step would draw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ..categories import Category
from ..trace.tracer import MemoryTrace

__all__ = ["accumulating_trace"]

_MICRO = ("batch", "forward", "backward")
"""The phases of one micro-batch, in order; then ``optimizer`` and ``zero_grad``."""


class _NotModelled(Exception):
    """A lifetime the NOTE does not cover: trace the accumulating step for real."""


@dataclasses.dataclass
class _Step:
    start: int
    """First event of the step's batch phase."""
    optimizer: int
    """First event of the step's optimizer phase (one past its micro-batch)."""


def _steps(trace: MemoryTrace) -> list[_Step]:
    """The two steps of a plain trace: one batch, forward and backward each, in order; else not modelled."""
    names = [(name, step) for _, name, step in trace.phases]
    expected = [("setup", 0)]
    for step in range(2):
        expected += [(p, step) for p in (*_MICRO, "optimizer", "zero_grad")]
    if names != [*expected, ("end", 2)]:
        raise _NotModelled
    starts = {(name, step): index for index, name, step in trace.phases}
    return [_Step(starts[("batch", s)], starts[("optimizer", s)]) for s in range(2)]


def accumulating_trace(plain: MemoryTrace) -> MemoryTrace | None:
    """The trace of two optimizer steps of two micro-batches each, from ``plain``'s two steps of one
    (NOTE above), or None where a lifetime in ``plain`` is not one the NOTE models."""
    try:
        return _synthesise(plain)
    except _NotModelled:
        return None


def _synthesise(plain: MemoryTrace) -> MemoryTrace:
    first, second = _steps(plain)
    events, end = plain.events, len(plain.events)
    born: dict[int, int] = {}
    freed: dict[int, int] = {}
    for i, e in enumerate(events):
        if e >= 0:
            born[e] = i
        else:
            freed[~e] = i
    grads = _handed_over(plain, second, born)
    gradients = {g[1] for g in plain.grads if plain.role.get(g[1]) == Category.GRADIENTS}
    zero_grad = next(i for i, name, step in plain.phases if (name, step) == ("zero_grad", 1))
    closing = plain.phases[-1][0]  # the "end" marker: what is freed after it goes with the model
    # What the second micro-batch frees of the first (the previous batch and loss), and what of its
    # own the loop releases after the last step: paired in birth order, one loop variable's two values.
    carried_in = sorted(
        (~e for e in events[second.start : second.optimizer] if e < 0 and born.get(~e, end) < second.start),
        key=lambda sid: born.get(sid, -1),
    )
    carried_out = sorted(
        (e for e in _births(events, second.start, second.optimizer)
         if e not in gradients and zero_grad <= freed.get(e, end) < closing),
        key=born.__getitem__,
    )  # fmt: skip
    for sid in carried_in:
        if not first.start <= born.get(sid, -1) < first.optimizer:
            raise _NotModelled  # the second micro-batch frees something the first did not make
    if [plain.nbytes[s] for s in carried_in] != [plain.nbytes[s] for s in carried_out]:
        raise _NotModelled
    for step, carried in ((first, set(carried_in)), (second, set(carried_out))):
        for e in _births(events, step.start, step.optimizer):
            f = freed.get(e, end)
            if not (f < step.optimizer or f >= closing or e in carried or e in gradients):
                raise _NotModelled  # e.g. a storage of the micro-batch the optimizer frees
    pair = dict(zip(carried_in, carried_out))

    out = dataclasses.replace(
        plain, events=[], nbytes=dict(plain.nbytes), role=dict(plain.role), module=dict(plain.module),
        phases=[], op=dict(plain.op), flops=dict(plain.flops), rows=dict(plain.rows), grads=[],
        notes=list(plain.notes), reductions=dict(plain.reductions),
    )  # fmt: skip
    tables = (out.nbytes, out.module, *out.carried())
    fresh = max(plain.nbytes, default=-1) + 1
    not_allocated = {sid for _, sid, copied, _ in grads if copied}  # added into micro-batch 1's in place
    handed = {sid: made_in for _, sid, copied, made_in in grads if not copied}  # a temporary in micro-batch 2
    markers = [(index, name) for index, name, step in plain.phases if step == 1 and name in _MICRO]

    def copy_micro(step: int, previous: dict[int, int]) -> dict[int, int]:
        """The second step's micro-batch again, as micro-batch 2 of ``step``; ``previous`` maps what it
        frees of the micro-batch before to that one's storages. Returns template sid -> copy's sid."""
        nonlocal fresh
        made: dict[int, int] = {}
        k = h = 0
        for i in range(second.start, second.optimizer + 1):
            while k < len(markers) and markers[k][0] == i:
                out.phases.append((len(out.events), markers[k][1], step))
                k += 1
            while h < len(grads) and grads[h][0] == i:  # the backward's output, added in and freed
                if not grads[h][2]:
                    out.events.append(~made[grads[h][1]])
                h += 1
            if i == second.optimizer:
                break
            e = events[i]
            if e < 0:
                out.events.append(~made.get(~e, previous.get(~e, ~e)))
            elif e not in not_allocated:
                made[e] = fresh
                for table in tables:
                    if e in table:
                        table[fresh] = table[e]
                if e in handed:  # what the real step records: a backward output, not a gradient
                    out.role[fresh] = Category.TEMPORARIES
                    out.module[fresh] = handed[e]
                    out.rows.pop(fresh, None)
                out.events.append(fresh)
                fresh += 1
        return made

    def emit(lo: int, hi: int, rename: dict[int, int]) -> None:
        """``plain``'s events ``lo:hi`` as they are, but for the frees ``rename``d; with their phases."""
        for index, name, step in plain.phases:
            if lo <= index < hi or (index >= hi == end):  # the last stretch takes the closing marker
                out.phases.append((len(out.events) + index - lo, name, step))
        out.events.extend(~rename[~e] if e < 0 and ~e in rename else e for e in events[lo:hi])

    # Step 0: the plain first micro-batch, then the second step's again, with the gradients alive.
    emit(0, first.optimizer, {})
    a = copy_micro(0, {sid: sid for sid in carried_in})
    emit(first.optimizer, second.start, {})
    # Step 1: the plain second micro-batch (freeing micro-batch 2 of step 0's), then its copy.
    emit(second.start, second.optimizer, {sid: a[pair[sid]] for sid in carried_in})
    b = copy_micro(1, {sid: pair[sid] for sid in carried_in})
    emit(second.optimizer, end, {sid: b[sid] for sid in carried_out})
    for phase in _MICRO:
        for step, total in ((0, plain.flops.get((phase, 0), 0) + plain.flops.get((phase, 1), 0)),
                            (1, 2 * plain.flops.get((phase, 1), 0))):  # fmt: skip
            if total:
                out.flops[(phase, step)] = total
    return out


def _handed_over(plain: MemoryTrace, second: _Step, born: dict[int, int]) -> list[tuple[int, int, bool, str]]:
    """The second step's gradient hand-overs whose gradient is born in its micro-batch (kept ones,
    ``zero_grad(set_to_none=False)``, exist already and are added into in place), in timeline order."""
    if any(sid is None for _, sid, _, _ in plain.grads):
        raise _NotModelled  # sparse (its accumulation makes new storages), or a view of a larger buffer
    out = []
    for index, sid, copied, made_in in plain.grads:
        if second.start <= index <= second.optimizer and born.get(sid, -1) >= second.start:
            out.append((index, sid, copied, made_in))
    if len({g[1] for g in out}) != len(out):
        raise _NotModelled  # one parameter's gradient handed over twice in a micro-batch
    return out


def _births(events: list[int], lo: int, hi: int) -> Iterable[int]:
    return (e for e in events[lo:hi] if e >= 0)
