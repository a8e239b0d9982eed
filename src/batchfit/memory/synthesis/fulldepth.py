"""Writing the full-depth trace from a trace whose stacks were cut to four periods (``memory/synthesis/depth.py``).

``memory/synthesis/sweeps.py`` reads the cut trace: its sweeps over each stack's blocks, and the template the
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
from dataclasses import dataclass, field
from typing import Any

from ..trace.tracer import MemoryTrace
from .blocklabels import Labels
from .stacks import Stack
from .sweeps import BlockNames, Irregular, Key, Sweep, SweepReader, frees_in_order

__all__ = ["write_full_depth"]


def write_full_depth(trace: MemoryTrace, labels: Labels, stacks: list[Stack], root: str) -> MemoryTrace:
    """The full-depth trace of the step ``trace`` was cut from (``memory/synthesis/depth.py``'s NOTE).

    Raises:
        Irregular: the cut trace does not repeat as assumed; trace the step at full depth instead.
    """
    trace, labels = frees_in_order(trace, labels)
    writer = _Writer(trace, labels, stacks, root)
    writer.segment()
    writer.align()
    return writer.write()


@dataclass(eq=False)
class _Template:
    """One phase of a sweep's template, compiled once for every turn written from it.

    ``entries`` are the pairs of middle events with what each block reads (``_Writer._reading``), as
    ``_emit_middle`` writes them one by one: a middle turn's own, or a block ``near`` an end. Every other
    written block does the same ``steps``, so ``_write_block`` resolves nothing but the storages of its
    neighbours. Either way a written block's storages are fresh, the ``n``-th it makes named ``keys[n]``.
    """

    sweep: Sweep
    phase: int
    entries: list[tuple] = field(default_factory=list)
    steps: list[tuple[Key, list[int | None], int | None, tuple]] = field(default_factory=list)
    """``(key, its row of _Writer.at, None, hand-overs)`` for a storage made; ``(..., distance, ...)``
    for one freed, the storage of that key ``distance`` blocks away."""
    near: set[int] = field(default_factory=set)
    """Full indices of the blocks that read an end's storage somewhere (written entry by entry)."""
    keys: list[Key] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    names: list[tuple[str, int | None, str]] = field(default_factory=list)
    """The distinct ``BlockNames.written_parts`` of the storages' modules; ``name_of`` indexes them."""
    name_of: list[int] = field(default_factory=list)
    tables: list[tuple[dict, list[int], list[Any]]] = field(default_factory=list)
    """``(table, ns, values)``: the output's role, op and rows, ``values[i]`` that of the ``ns[i]``-th
    storage made."""
    paged: list[int] = field(default_factory=list)


class _Writer(SweepReader):
    """Writes the full-depth trace from what ``SweepReader`` read."""

    def _stacked_bytes(self, nbytes: int, pieces: tuple[Any, ...]) -> int:
        """The full-depth size of a storage stacking ``pieces`` equal pieces, as many from each kept block
        (``Labels.stacked``): one piece more for each a written block adds.

        Raises:
            Irregular: a kept block of a stack gives no piece (the written ones' count is not known).
        """
        per_block: dict[Any, int] = {}
        for label in pieces:
            if label is not None:
                per_block[label] = per_block.get(label, 0) + 1
        count = next(iter(per_block.values()))
        added = 0
        for s in {label[0] for label in per_block}:
            stack = self.stacks[s]
            if sum(1 for label in per_block if label[0] == s) != stack.kept or nbytes % len(pieces):
                raise Irregular("an op outside the blocks stacked pieces of some blocks of a stack, not all")
            added += count * stack.inserted
        return nbytes // len(pieces) * (len(pieces) + added)

    def write(self) -> MemoryTrace:
        t = self.t
        out = MemoryTrace(nbytes=dict(t.nbytes), role=dict(t.role), op=dict(t.op), rows=dict(t.rows),
                          module={}, notes=[], flops={}, paged=set(t.paged), reductions=dict(t.reductions))  # fmt: skip
        for sid, pieces in self.labels.stacked.items():
            out.nbytes[sid] = self._stacked_bytes(t.nbytes[sid], pieces)
        self.out = out
        self.fresh = max(t.nbytes, default=-1) + 1
        # key -> its storage in each block of the full stack (None: none yet): the kept storages, and
        # the written ones as they are written (a key names its sweep, so its stack)
        self.at: dict[Key, list[int | None]] = {}
        for (key, kept), sid in self.by_key.items():
            st = self.stacks[self.sweeps[key[0]].stack]
            self.at.setdefault(key, [None] * st.length)[st.full_of(kept)] = sid
        self.written: list[tuple[_Template, int]] = []  # each written block's template and first storage
        for sid, name in t.module.items():
            turn = self.turn.get(self.born.get(sid, -1))
            if turn is None:
                out.module[sid] = self.names.written(name, None, 0, 0)
            else:
                out.module[sid] = self.names.written(name, turn[1], turn[2], self._full(turn[1], turn[2]))
        new_index: dict[int, int] = {}
        compiled: dict[tuple[int, int], _Template] = {}
        starts = {sweep.start: (s, sweep) for s, sweep in enumerate(self.sweeps)}
        i, n = 0, len(t.events)
        while i < n:
            if i not in starts:
                new_index[i] = len(out.events)
                self._emit(i, None, 0, 0)
                i += 1
                continue
            s, sweep = starts[i]
            st = self.stacks[sweep.stack]
            for full, kept in self._turns(sweep):
                if kept is not None and not st.period <= kept < 3 * st.period:  # an end block's own turn
                    a, b = sweep.runs[kept]
                    for x in range(a, b):
                        new_index[x] = len(out.events)
                        self._emit(x, sweep.stack, kept, full)
                    continue
                phase = full % st.period
                template = compiled.get((s, phase))
                if template is None:
                    template = compiled[(s, phase)] = self._compile(sweep, phase)
                if kept is None:
                    self.written.append((template, self.fresh))
                    if full not in template.near:
                        self._write_block(template, full)
                        continue
                for entry in template.entries:  # a middle turn's own, or a written block next to an end
                    own = entry[0] if kept == phase + st.period else entry[1] if kept == phase + 2 * st.period else None
                    if own is not None:
                        new_index[own] = len(out.events)
                    self._emit_middle(template, entry, full, own)
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
        if not 0 <= full < self.stacks[stack].length:
            raise Irregular("a block frees a storage of a block the stack does not have")
        sid = self.at[key][full]
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

    def _compile(self, sweep: Sweep, phase: int) -> _Template:
        """The template of ``phase``, read once for all the blocks written from it (``_Template``)."""
        t, out, stack = self.t, self.out, sweep.stack
        period = self.stacks[stack].period
        blocks = (phase + period, phase + 2 * period)
        tpl = _Template(sweep, phase)
        tables: list[tuple[dict, list[int], list[Any]]] = [(table, [], []) for table in out.carried()]
        names: dict[tuple[str, int | None, str], int] = {}
        for a, b in sweep.templates[phase]:
            refs = zip(self._refs(a, stack, blocks[0]), self._refs(b, stack, blocks[1]))
            readings = [self._reading(sweep, phase, ra, rb) for ra, rb in refs]
            hands = [(sid, copied, made) for _, sid, copied, made in self.grads.get(a, ())]
            e = t.events[a]
            tpl.entries.append((a, b, e, readings, hands))
            for _, ends in readings:
                tpl.near.update(at for at, _, _ in ends)
            between = [between for between, _ in readings]  # what a written block reads of its neighbours
            if e < 0:  # the storage it frees, then those it hands over
                key, distance = between.pop(0)  # type: ignore[misc]
            else:
                key, distance = self.key[e], None
                made = len(tpl.keys)
                tpl.keys.append(key)
                tpl.nbytes.append(t.nbytes[e])
                parts = self.names.written_parts(t.module.get(e, ""), stack, blocks[0])
                tpl.name_of.append(names.setdefault(parts, len(names)))
                for (_, ns, values), source in zip(tables, t.carried(), strict=True):
                    if e in source:
                        ns.append(made)
                        values.append(source[e])  # type: ignore[index]
                if e in t.paged:
                    tpl.paged.append(made)
            hand_overs = tuple(
                (target, copied, self._made_parts(made, sid, stack, blocks[0]))
                for target, (sid, copied, made) in zip(between, hands)
            )
            tpl.steps.append((key, self.at[key], distance, hand_overs))
        tpl.names = list(names)
        tpl.tables = [table for table in tables if table[1]]
        return tpl

    def _write_block(self, tpl: _Template, full: int) -> None:
        """The turn of written block ``full`` (not next to an end), from ``tpl``: its storages fresh, made
        in the template's order, the storages it frees its neighbours' by their distance."""
        out, stack = self.out, tpl.sweep.stack
        events = out.events
        length = self.stacks[stack].length
        base = sid = self.fresh
        for key, row, distance, hand_overs in tpl.steps:
            if hand_overs:
                self._hand_over(tpl, hand_overs, full)
            if distance is None:
                row[full] = sid
                events.append(sid)
                sid += 1
            else:
                at = full + distance
                freed = row[at] if 0 <= at < length else None
                if freed is None:
                    freed = self._storage(key, at, stack)  # raises: no such storage
                events.append(~freed)
        self.fresh = sid
        made = range(base, sid)
        numbered = base.__add__  # the n-th storage made -> its sid
        out.nbytes.update(zip(made, tpl.nbytes))
        names = [self.names.name_at(parts, full) for parts in tpl.names]
        out.module.update(zip(made, map(names.__getitem__, tpl.name_of)))
        for table, ns, values in tpl.tables:
            table.update(zip(map(numbered, ns), values))
        out.paged.update(map(numbered, tpl.paged))

    def _hand_over(self, tpl: _Template, hand_overs: tuple, full: int) -> None:
        """The gradients written block ``full`` hands over before a step of ``tpl`` (``_write_block``)."""
        out, stack = self.out, tpl.sweep.stack
        for between, copied, made in hand_overs:
            target = None if between is None else self._storage(between[0], full + between[1], stack)
            out.grads.append((len(out.events), target, copied, self.names.name_at(made, full)))

    def _emit_middle(self, tpl: _Template, entry: tuple, full: int, own: int | None) -> None:
        """A template event as block ``full``'s: a middle turn's own (``own``, its event index), or a
        written block's with a fresh storage."""
        out, t, stack = self.out, self.t, tpl.sweep.stack
        _, _, e, readings, hands = entry
        if e >= 0 and own is not None and not hands:  # a middle turn's own allocation, as it is
            out.events.append(t.events[own])
            return
        block = tpl.phase + self.stacks[stack].period
        targets = [self._pick(reading, full, stack) for reading in readings]
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
            self.at[self.key[e]][full] = sid
            out.events.append(sid)
            out.nbytes[sid] = t.nbytes[e]
            out.module[sid] = self.names.written(t.module.get(e, ""), stack, block, full)
            for table in out.carried():
                if e in table:
                    table[sid] = table[e]  # type: ignore[index]
            if e in t.paged:
                out.paged.add(sid)

    def _made_in(self, made: str, sid: int | None, stack: int | None, block: int, full: int) -> str:
        """The module that made a handed-over gradient, named as its storage is: by distance from the
        turn handing it over when the storage is a neighbour's, else as the turn that made it is."""
        return self.names.name_at(self._made_parts(made, sid, stack, block), full)

    def _made_parts(self, made: str, sid: int | None, stack: int | None, block: int) -> tuple[str, int | None, str]:
        """``_made_in`` for every ``full`` at once (``BlockNames.written_parts``)."""
        turn = self.turn.get(self.born.get(sid, -1)) if sid is not None else None
        if turn is None or (turn[1] == stack and sid in self.key):
            return self.names.written_parts(made, stack, block)
        st = self.stacks[turn[1]]
        target = st.seen_from_outside(turn[2]) if sid in self.key else st.full_of(turn[2])
        return self.names.written(made, turn[1], turn[2], target), None, ""

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
        alive: dict[int, bool] = {}  # every storage born so far: whether it is still alive
        for e in self.out.events:
            if e >= 0:
                if e in alive:
                    raise Irregular("the written trace allocates a storage twice")
                alive[e] = True
            elif alive.get(~e):
                alive[~e] = False
            else:
                raise Irregular("the written trace frees a storage that is not alive")
        freed = {sid for sid, is_alive in alive.items() if not is_alive}
        kinds: dict[_Template, tuple[list[int], list[int]]] = {}  # n-th storages freed / kept in both middles
        for tpl, base in self.written:
            if tpl not in kinds:
                period = self.stacks[tpl.sweep.stack].period
                middles = [{self.by_key[(key, key[1] + k * period)] in freed for k in (1, 2)} for key in tpl.keys]
                kinds[tpl] = ([n for n, m in enumerate(middles) if m == {True}],
                              [n for n, m in enumerate(middles) if m == {False}])  # fmt: skip
            freed_in_both, kept_in_both = kinds[tpl]
            numbered = base.__add__  # the n-th storage the block made -> its sid
            if not (freed.issuperset(map(numbered, freed_in_both)) and freed.isdisjoint(map(numbered, kept_in_both))):
                raise Irregular("a written block's storage lives differently from the traced blocks' own")

    # NOTE [ A storage carried into a sweep ]
    # A turn may free a storage made before its sweep began, where the other middle turn frees its neighbour's
    # (``_carried``): a loop variable each turn drops for its own, or a storage the turn before it made outside
    # its own turn. FSDP2 beside sequence parallelism does the second: it unshards a block in the backward of
    # what runs before it (the last block's all-gather buffer is made in the final norm's backward, before the
    # backward sweep's first turn), and each block's turn frees the buffer of the block before it in the sweep.
    # At full depth the storage goes to the block next to the same end turn in the sweep's order: the block
    # after the first in an ascending sweep (the cut and full stacks agree there), the block before the last
    # block's period in a descending one, where the written blocks lie between them and the cut stack's
    # middle turn.
    def _reading(self, sweep: Sweep, phase: int, ra: tuple, rb: tuple) -> tuple[tuple[Key, int] | None, list[tuple]]:
        """What a block between the ends frees or hands over where the two middle turns freed ``ra`` and
        ``rb``: ``(between, ends)``. ``between`` is what the middle turns do between themselves, the
        storage ``(key, distance)`` from the block (None: no storage); ``ends`` lists the blocks that
        take an end block's own instead, next to that end as the middle turn that read it was:
        ``(full index, key, full index of the end)``, or ``(full index, None, sid)`` for the end's
        storage itself."""
        st = self.stacks[sweep.stack]
        if ra == rb:
            return (None if ra[1] is None else (ra[2], ra[1])), []
        between = None
        ends: list[tuple] = []
        for ref, block in ((ra, phase + st.period), (rb, phase + 2 * st.period)):
            if self._to_middle(ref, sweep.stack, block):
                between = (ref[2], ref[1])
            elif ref[0] == "fixed":  # made before the sweep: NOTE [ A storage carried into a sweep ]
                step = -1 if sweep.descending else 1  # the next turn of the sweep, in block indices
                ends.append((st.full_of(block - step) + step, None, ref[1]))
            elif ref[0] == "rel":
                end = block + ref[1]
                ends.append((st.full_of(end) + block - end, ref[2], st.full_of(end)))
            else:
                end = self.turn[self.born[ref[1]]][2]
                ends.append((st.full_of(end) + block - end, None, ref[1]))
        assert between is not None  # ``_check_middles``: one of the two middle turns reads the other
        return between, ends

    def _pick(self, reading: tuple, full: int, stack: int) -> int | None:
        """The storage block ``full`` frees or hands over where the middle turns read ``reading``
        (``_reading``)."""
        between, ends = reading
        for where, key, end in ends:
            if full == where:
                return end if key is None else self._storage(key, end, stack)
        return None if between is None else self._storage(between[0], full + between[1], stack)


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
