"""Writing the full-depth trace from a trace whose stacks were cut to four periods (``memory/depth.py``).

``memory/sweeps.py`` reads the cut trace: its sweeps over each stack's blocks, and the template the
blocks between a stack's ends repeat. The written trace keeps every event of the cut trace in place,
with the turns of the missing blocks written from the template between the third period's turn and
the last's in each sweep, with fresh storages; a turn frees a neighbour's storage by its distance
(which in the full stack can be a written block), and a block next to an end reads that end's
storages as the middle turn next to it did. The model's other parts see the first two periods from
the start of the stack and the others from its end. Then it is checked: every storage born once and
freed at most once, after its birth, and each written storage freed where the traced ones of its kind
are. FLOPs and notes are the traced blocks' and the template's for every written block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .blocklabels import Labels
from .stacks import Stack
from .sweeps import BlockNames, Irregular, Key, Sweep, SweepReader, frees_in_order
from .tracer import MemoryTrace

__all__ = ["write_full_depth"]


def write_full_depth(trace: MemoryTrace, labels: Labels, stacks: list[Stack], root: str) -> MemoryTrace:
    """The full-depth trace of the step ``trace`` was cut from (``memory/depth.py``'s NOTE).

    Raises:
        Irregular: the cut trace does not repeat as assumed; trace the step at full depth instead.
    """
    trace, labels = frees_in_order(trace, labels)
    writer = _Writer(trace, labels, stacks, root)
    writer.segment()
    writer.align()
    return writer.write()


class _Writer(SweepReader):
    """Writes the full-depth trace from what ``SweepReader`` read."""

    def write(self) -> MemoryTrace:
        t = self.t
        out = MemoryTrace(nbytes=dict(t.nbytes), role=dict(t.role), op=dict(t.op), rows=dict(t.rows),
                          module={}, notes=[], flops={}, paged=set(t.paged))  # fmt: skip
        self.out = out
        self.fresh = max(t.nbytes, default=-1) + 1
        self.written: dict[tuple[Key, int], int] = {}  # (key, full block) -> written sid
        self._names_written: dict[tuple[str, int, int], str] = {}
        for sid, name in t.module.items():
            turn = self.turn.get(self.born.get(sid, -1))
            if turn is None:
                out.module[sid] = self.names.written(name, None, 0, 0)
            else:
                out.module[sid] = self.names.written(name, turn[1], turn[2], self._full(turn[1], turn[2]))
        new_index: dict[int, int] = {}
        compiled: dict[tuple[int, int], list[tuple]] = {}
        starts = {sweep.start: sweep for sweep in self.sweeps}
        i, n = 0, len(t.events)
        while i < n:
            sweep = starts.get(i)
            if sweep is None:
                new_index[i] = len(out.events)
                self._emit(i, None, 0, 0)
                i += 1
                continue
            st = self.stacks[sweep.stack]
            for full, kept in self._turns(sweep):
                if kept is not None and not st.period <= kept < 3 * st.period:  # an end block's own turn
                    a, b = sweep.runs[kept]
                    for x in range(a, b):
                        new_index[x] = len(out.events)
                        self._emit(x, sweep.stack, kept, full)
                    continue
                phase = full % st.period
                template = compiled.get((id(sweep), phase))
                if template is None:
                    template = compiled[(id(sweep), phase)] = self._compile(sweep, phase)
                for entry in template:
                    own = entry[0] if kept == phase + st.period else entry[1] if kept == phase + 2 * st.period else None
                    if own is not None:
                        new_index[own] = len(out.events)
                    self._emit_middle(sweep, phase, entry, full, own)
            i = sweep.end
        new_index[n] = len(out.events)
        for _, sid, copied, made in self.grads.get(n, ()):
            out.grads.append((len(out.events), sid, copied, self.names.written(made, None, 0, 0)))
        out.phases = [(new_index[index], phase, step) for index, phase, step in t.phases]
        out.flops = self._flops()
        out.notes = _notes(t.notes, self.names, self.stacks)
        self._check()
        return out

    def _full(self, stack: int, block: int) -> int:
        """Full index, within the stack's repeating blocks, of kept block ``block``."""
        return self.stacks[stack].full_of(block)

    def _turns(self, sweep: Sweep) -> Iterator[tuple[int, int | None]]:
        """``(full index, kept block or None for a written one)`` of each turn of the full sweep, in order."""
        st = self.stacks[sweep.stack]
        order = range(st.length - 1, -1, -1) if sweep.descending else range(st.length)
        for full in order:
            yield full, st.kept_of(full)

    def _target(self, sid: int, stack: int | None, block: int, full: int) -> int:
        """The storage ``sid`` (freed or handed over by ``block``'s turn, full index ``full``, or by a
        fixed event: ``stack`` None) stands for: a block's storage by its distance from the turn, or as
        the model's other parts see the block; anything else as it is."""
        turn = self.turn.get(self.born.get(sid, -1))
        key = self.key.get(sid)
        if turn is None or key is None:
            return sid
        if stack is None or turn[1] != stack:  # as the model's other parts see the block
            return self._storage(key, self.stacks[turn[1]].seen_from_outside(turn[2]), turn[1])
        return self._storage(key, full + turn[2] - block, stack)

    def _storage(self, key: Key, full: int, stack: int) -> int:
        st = self.stacks[stack]
        if not 0 <= full < st.length:
            raise Irregular("a block frees a storage of a block the stack does not have")
        kept = st.kept_of(full)
        sid = self.by_key.get((key, kept)) if kept is not None else self.written.get((key, full))
        if sid is None:
            raise Irregular("a block frees a storage its neighbour does not make")
        return sid

    def _emit(self, index: int, stack: int | None, block: int, full: int) -> None:
        """Event ``index`` of the cut trace as block ``full``'s (an end block's own, or a fixed event)."""
        out = self.out
        for _, sid, copied, made in self.grads.get(index, ()):
            target = self._target(sid, stack, block, full) if sid is not None else None
            out.grads.append((len(out.events), target, copied, self._made_in(made, sid, stack, block, full)))
        e = self.t.events[index]
        out.events.append(e if e >= 0 else ~self._target(~e, stack, block, full))

    def _compile(self, sweep: Sweep, phase: int) -> list[tuple]:
        """The template of ``phase`` as ``_emit_middle`` writes it: each pair of middle events with what
        they free or hand over, read once for all the blocks written from it."""
        period = self.stacks[sweep.stack].period
        blocks = (phase + period, phase + 2 * period)
        out = []
        for a, b in sweep.templates[phase]:
            refs = list(zip(self._refs(a, sweep.stack, blocks[0]), self._refs(b, sweep.stack, blocks[1])))
            hands = [(sid, copied, made) for _, sid, copied, made in self.grads.get(a, ())]
            out.append((a, b, self.t.events[a], refs, hands))
        return out

    def _emit_middle(self, sweep: Sweep, phase: int, entry: tuple, full: int, own: int | None) -> None:
        """A template event as block ``full``'s: a middle turn's own (``own``, its event index), or a
        written block's with a fresh storage."""
        out, t, stack = self.out, self.t, sweep.stack
        _, _, e, refs, hands = entry
        if e >= 0 and own is not None and not hands:  # a middle turn's own allocation, as it is
            out.events.append(t.events[own])
            return
        block = phase + self.stacks[stack].period
        targets = [self._pick(sweep, phase, ra, rb, full) for ra, rb in refs]
        if e < 0:
            freed, targets = targets[0], targets[1:]
        for (sid, copied, made), target in zip(hands, targets):
            out.grads.append((len(out.events), target, copied, self._made_in(made, sid, stack, block, full)))
        if e < 0:
            out.events.append(~freed)  # type: ignore[operator]
        elif own is not None:
            out.events.append(t.events[own])
        else:
            sid = self.fresh
            self.fresh += 1
            self.written[(self.key[e], full)] = sid
            out.events.append(sid)
            out.nbytes[sid] = t.nbytes[e]
            out.module[sid] = self._written_name(t.module.get(e, ""), stack, block, full)
            for table in (out.role, out.op, out.rows):
                if e in table:
                    table[sid] = table[e]  # type: ignore[index]
            if e in t.paged:
                out.paged.add(sid)

    def _written_name(self, name: str, stack: int, block: int, full: int) -> str:
        key = (name, block, full)
        found = self._names_written.get(key)
        if found is None:
            found = self._names_written[key] = self.names.written(name, stack, block, full)
        return found

    def _made_in(self, made: str, sid: int | None, stack: int | None, block: int, full: int) -> str:
        """The module that made a handed-over gradient, named as its storage is: by distance from the
        turn handing it over when the storage is a neighbour's, else as the turn that made it is."""
        turn = self.turn.get(self.born.get(sid, -1)) if sid is not None else None
        if turn is None or (turn[1] == stack and sid in self.key):
            return self.names.written(made, stack, block, full)
        st = self.stacks[turn[1]]
        target = st.seen_from_outside(turn[2]) if sid in self.key else st.full_of(turn[2])
        return self.names.written(made, turn[1], turn[2], target)

    def _flops(self) -> dict[tuple[str, int], int]:
        totals: dict[tuple[str, int], int] = {}
        by_label = self.labels.flops
        for (phase, step, _), n in by_label.items():
            totals[(phase, step)] = totals.get((phase, step), 0) + n
        if totals != {k: v for k, v in self.t.flops.items() if v}:
            raise Irregular("the trace's floating-point work is not all labelled")
        for (phase, step, label), n in by_label.items():
            if label is None:
                continue
            st = self.stacks[label[0]]
            if st.period <= label[1] < 2 * st.period:  # the template's period
                if by_label.get((phase, step, (label[0], label[1] + st.period)), 0) != n:
                    raise Irregular("two blocks between the ends of a stack do different floating-point work")
                totals[(phase, step)] += n * (st.inserted // st.period)
        return {k: v for k, v in totals.items() if v}

    def _check(self) -> None:
        """Every storage born once, freed at most once, after its birth; written storages freed as the
        kept ones of their kind are."""
        alive: set[int] = set()
        born: set[int] = set()
        freed: set[int] = set()
        for e in self.out.events:
            if e >= 0:
                if e in born:
                    raise Irregular("the written trace allocates a storage twice")
                born.add(e)
                alive.add(e)
            else:
                if ~e not in alive:
                    raise Irregular("the written trace frees a storage that is not alive")
                alive.discard(~e)
                freed.add(~e)
        for (key, _), sid in self.written.items():
            period = self.stacks[self.sweeps[key[0]].stack].period
            kinds = {self.by_key[(key, key[1] + period)] in freed, self.by_key[(key, key[1] + 2 * period)] in freed}
            if len(kinds) == 1 and (sid in freed) not in kinds:
                raise Irregular("a written block's storage lives differently from the traced blocks' own")


    def _pick(self, sweep: Sweep, phase: int, ra: tuple, rb: tuple, full: int) -> int | None:
        """The storage a block between the ends (full index ``full``) frees or hands over where the two
        middle turns freed ``ra`` and ``rb``: an end block's own, where the block is next to that end as
        the middle turn that read it was; else what the middle turns do between themselves."""
        st = self.stacks[sweep.stack]
        if ra == rb:
            return None if ra[1] is None else self._storage(ra[2], full + ra[1], sweep.stack)
        interior = None
        for ref, block in ((ra, phase + st.period), (rb, phase + 2 * st.period)):
            if self._to_middle(ref, sweep.stack, block):
                interior = ref
                continue
            if ref[0] == "fixed":  # made before the sweep (``_carried``): that middle turn's own alone
                if full == st.full_of(block):
                    return ref[1]
                continue
            end = block + ref[1] if ref[0] == "rel" else self.turn[self.born[ref[1]]][2]
            if full + end - block == st.full_of(end):  # next to that end, as the middle turn was
                return self._storage(ref[2], st.full_of(end), sweep.stack) if ref[0] == "rel" else ref[1]
        assert interior is not None
        return self._storage(interior[2], full + interior[1], sweep.stack)

    # -- writing the full-depth trace ------------------------------------------------------------


def _notes(notes: list[str], names: BlockNames, stacks: list[Stack]) -> list[str]:
    """The notes of the full-depth step: a note made in a block between the ends of a stack is made in
    every such block (a note begins with the module it was made in: ``module: text``)."""
    out: list[str] = []
    i = 0
    while i < len(notes):
        module, _, text = notes[i].partition(": ")
        found = names.block(module) if text else None
        if found is None:
            out.append(f"{names.written(module, None, 0, 0)}: {text}" if text else notes[i])
            i += 1
            continue
        group: dict[int, list[tuple[str, str]]] = {}  # kept block -> its notes, (module, text)
        while i < len(notes):
            module, _, text = notes[i].partition(": ")
            block = names.block(module) if text else None
            if block is None or block[0] != found[0]:
                break
            group.setdefault(block[1], []).append((module, text))
            i += 1
        out.extend(_notes_of_stack(group, names, found[0], stacks[found[0]]))
    return out


def _notes_of_stack(group: dict[int, list[tuple[str, str]]], names: BlockNames, s: int, stack: Stack) -> list[str]:
    period = stack.period

    def seen(block: int) -> list[tuple[Any, str]]:
        return [(names.relative(module, s, block), text) for module, text in group.get(block, [])]

    if any(seen(b) != seen(b + period) for b in range(period, 2 * period)):
        raise Irregular("two blocks between the ends of a stack make different notes")
    order = list(group)  # the blocks as their notes were first made: forward, or backward's reverse
    if order not in (sorted(order), sorted(order, reverse=True)):
        raise Irregular("the notes of a stack's blocks are not made in the blocks' order")
    out = []
    for full in range(stack.length) if order == sorted(order) else range(stack.length - 1, -1, -1):
        kept = stack.kept_of(full)
        source = kept if kept is not None else period + full % period
        out.extend(f"{names.written(module, s, source, full)}: {text}" for module, text in group.get(source, []))
    return out
