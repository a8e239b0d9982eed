"""Writing the full-depth trace from a trace whose stacks were cut to two periods (``memory/depth.py``).

The cut trace is read as fixed events (the model's other parts) and *sweeps*: wherever the step goes
over a stack's blocks in order (a forward, a backward in reverse, one of the optimizer's loops), the
events of each block's turn, one turn after another. The two turns of each phase of the period (block
``b`` and ``b + period``) are aligned event by event; where they agree up to storage identity they are
the phase's *template*, the turn every written block takes. The two may differ only at the ends of the
stack: where one frees a storage of a neighbour that the other lacks (and frees a stand-in, or
nothing), the template frees the neighbour's, and what one of them alone allocates (made once: a
library's workspace) stays with that turn. Storages are named by ``(sweep, phase, position in the
template)`` plus the block, so a turn frees "the storage of block ``n + d`` at that position".

The written trace keeps every event of the cut trace in place, with the turns of the missing blocks
written between the first period's and the second's in each sweep; a turn of the cut trace frees its
neighbours by distance, which in the full stack can be a written block. Then it is checked: every
storage born once and freed at most once, after its birth, and each written storage freed where the
traced ones of its kind are.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .blocklabels import Label, Labels
from .stacks import Stack
from .tracer import MemoryTrace

__all__ = ["Irregular", "write_full_depth"]


class Irregular(Exception):
    """The cut trace does not repeat as depth synthesis assumes (the message says where)."""


@dataclass
class _Sweep:
    stack: int
    runs: list[tuple[int, int]]
    """``(start, end)`` event range of each kept block's turn, by block index."""
    descending: bool
    templates: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per phase: the template's events, each as ``(event index, kept block)`` of the turn it is read from."""

    @property
    def start(self) -> int:
        return min(a for a, _ in self.runs)

    @property
    def end(self) -> int:
        return max(b for _, b in self.runs)


class _Names:
    """Module names of the cut model, read as (stack, block, rest) and written at full depth."""

    def __init__(self, stacks: list[Stack], root: str) -> None:
        self.stacks = stacks
        self.prefixes = [f"{root}.{s.path}." if s.path else f"{root}." for s in stacks]
        self._parsed: dict[str, tuple[int, int, str] | None] = {}

    def parse(self, name: str) -> tuple[int, int, str] | None:
        """``(stack, container index in the cut model, rest of the name)`` of a module in a stack's container."""
        found = self._parsed.get(name, ())
        if found != ():
            return found  # type: ignore[return-value]
        out = None
        for s, prefix in enumerate(self.prefixes):
            if name.startswith(prefix):
                index, dot, rest = name[len(prefix) :].partition(".")
                if index.isdigit():
                    out = (s, int(index), dot + rest)
                    break
        self._parsed[name] = out
        return out

    def relative(self, name: str, stack: int, block: int) -> Any:
        """``name`` as seen from ``block`` of ``stack``: a kept block's module by its distance."""
        parsed = self.parse(name)
        if parsed is None or parsed[0] != stack:
            return name
        s, index, rest = parsed
        b = index - self.stacks[s].start
        if 0 <= b < self.stacks[s].kept:
            return ("block", b - block, rest)
        return name

    def written(self, name: str, stack: int | None, block: int, full: int) -> str:
        """``name`` in the full model, for a storage of ``block`` (full index ``full``) of ``stack``."""
        parsed = self.parse(name)
        if parsed is None:
            return name
        s, index, rest = parsed
        st = self.stacks[s]
        b = index - st.start
        if s == stack and 0 <= b < st.kept:
            index = st.start + full + (b - block)
        else:
            index = st.full_index(index)
        return f"{self.prefixes[s]}{index}{rest}"


def write_full_depth(trace: MemoryTrace, labels: Labels, stacks: list[Stack], root: str) -> MemoryTrace:
    """The full-depth trace of the step ``trace`` was cut from (``memory/depth.py``'s NOTE).

    Raises:
        Irregular: the cut trace does not repeat as assumed; trace the step at full depth instead.
    """
    writer = _Writer(trace, labels, stacks, root)
    writer.segment()
    writer.align()
    return writer.write()


class _Writer:
    def __init__(self, trace: MemoryTrace, labels: Labels, stacks: list[Stack], root: str) -> None:
        self.t = trace
        self.labels = labels
        self.stacks = stacks
        self.names = _Names(stacks, root)
        self.sweeps: list[_Sweep] = []
        self.born: dict[int, int] = {}  # sid -> event index of its birth
        for i, e in enumerate(trace.events):
            if e >= 0:
                self.born[e] = i
        self.turn: dict[int, tuple[int, int, int]] = {}  # event index -> (sweep, stack, block)
        self.key: dict[int, tuple[int, int, int]] = {}  # sid -> (sweep, phase, template position)
        self.by_key: dict[tuple[tuple[int, int, int], int], int] = {}  # (key, kept block) -> sid
        self.grads: dict[int, list[tuple[int, int | None, bool, str]]] = {}  # event index -> hand-overs before it
        for entry in trace.grads:
            self.grads.setdefault(entry[0], []).append(entry)

    # -- reading the cut trace ------------------------------------------------------------------
    def segment(self) -> None:
        """Find the sweeps: runs of one label, consecutive turns of blocks 0..2p-1 in order."""
        events, lab = self.t.events, self.labels.events
        runs: list[tuple[Label, int, int]] = []
        i, n = 0, len(events)
        while i < n:
            label = lab[i]
            j = i + 1
            while j < n and lab[j] == label:
                j += 1
            if label is not None:
                runs.append((label, i, j))
            i = j
        used = [False] * len(runs)
        for r, (label, start, _) in enumerate(runs):
            if used[r]:
                continue
            kept = self.stacks[label[0]].kept
            for descending in (False, True):
                first = kept - 1 if descending else 0
                if label[1] != first:
                    continue
                chain = [r]
                while len(chain) < kept:
                    nxt = chain[-1] + 1
                    want = (label[0], first + (-1 if descending else 1) * len(chain))
                    if nxt >= len(runs) or runs[nxt][0] != want or runs[nxt][1] != runs[chain[-1]][2]:
                        break
                    chain.append(nxt)
                if len(chain) == kept:
                    spans = sorted(((runs[c][0][1], runs[c][1], runs[c][2]) for c in chain))
                    sweep = _Sweep(label[0], [(a, b) for _, a, b in spans], descending)
                    for c in chain:
                        used[c] = True
                    s_index = len(self.sweeps)
                    self.sweeps.append(sweep)
                    for block, (a, b) in enumerate(sweep.runs):
                        for x in range(a, b):
                            self.turn[x] = (s_index, label[0], block)
                    break
        for r, (label, start, end) in enumerate(runs):
            if not used[r] and any(self.t.events[x] >= 0 for x in range(start, end)):
                raise Irregular(f"block {label[1]} of a stack allocates outside its turn in a sweep over the blocks")
        for index, _, _ in self.t.phases:
            for sweep in self.sweeps:
                if sweep.start < index < sweep.end:
                    raise Irregular("a phase of the step starts in the middle of a sweep over the blocks")

    def _alloc_sig(self, sid: int, stack: int, block: int) -> tuple:
        t = self.t
        return (t.nbytes[sid], t.role.get(sid), t.op.get(sid), self.names.relative(t.module.get(sid, ""), stack, block),
                t.rows.get(sid))  # fmt: skip

    def _coarse(self, index: int, stack: int, block: int) -> tuple:
        """What alignment compares of an event: an allocation's size, role and op, a free's storage by
        the turn that made it (before templates name storages), and the hand-overs just before it;
        ``_check_pair`` then compares what alignment paired in full."""
        e = self.t.events[index]
        if e >= 0:
            sig: tuple = ("a", self._alloc_sig(e, stack, block)[:3])
        else:
            sig = ("f", self._coarse_ref(~e, stack, block))
        hand = self.grads.get(index)
        if hand:
            sig += tuple((self._coarse_ref(sid, stack, block) if sid is not None else None, copied)
                         for _, sid, copied, _ in hand)  # fmt: skip
        return sig

    def _coarse_ref(self, sid: int, stack: int, block: int) -> tuple:
        turn = self.turn.get(self.born.get(sid, -1))
        if turn is None or turn[1] != stack:
            return ("fixed",)
        return ("turn", turn[0], turn[2] - block, self._alloc_sig(sid, stack, turn[2])[:3])

    def align(self) -> None:
        """Align the two turns of each phase of each sweep into its template; name the storages."""
        aligned = []
        for s_index, sweep in enumerate(self.sweeps):
            period = self.stacks[sweep.stack].period
            for phase in range(period):
                pairs = self._align_turns(sweep, phase, phase + period)
                aligned.append((sweep, phase, pairs))
                for position, (a, b) in enumerate(pairs):
                    ea = self.t.events[a] if a is not None else -1
                    if a is not None and b is not None and ea >= 0:
                        eb = self.t.events[b]
                        key = (s_index, phase, position)
                        self.key[ea], self.key[eb] = key, key
                        self.by_key[(key, phase)], self.by_key[(key, phase + period)] = ea, eb
        for sweep, phase, pairs in aligned:
            period = self.stacks[sweep.stack].period
            template = [self._check_pair(sweep, phase, period, a, b) for a, b in pairs]
            sweep.templates.append([x for x in template if x is not None])

    def _align_turns(self, sweep: _Sweep, first: int, second: int) -> list[tuple[int | None, int | None]]:
        (a0, a1), (b0, b1) = sweep.runs[first], sweep.runs[second]
        sig_a = [self._coarse(i, sweep.stack, first) for i in range(a0, a1)]
        sig_b = [self._coarse(i, sweep.stack, second) for i in range(b0, b1)]
        if sig_a == sig_b:
            return [(a0 + x, b0 + x) for x in range(a1 - a0)]
        pairs: list[tuple[int | None, int | None]] = []
        matcher = difflib.SequenceMatcher(None, sig_a, sig_b, autojunk=False)  # type: ignore[arg-type]
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
                pairs.extend((a0 + i1 + x, b0 + j1 + x) for x in range(i2 - i1))
            else:
                pairs.extend((a0 + x, None) for x in range(i1, i2))
                pairs.extend((None, b0 + x) for x in range(j1, j2))
        return pairs

    def _ref(self, sid: int, stack: int, block: int) -> tuple:
        """A storage as seen from ``block``: ``("rel", distance, key)``, or ``("fixed", sid)``."""
        key = self.key.get(sid)
        turn = self.turn.get(self.born.get(sid, -1))
        if key is None or turn is None or turn[1] != stack:
            return ("fixed", sid)
        return ("rel", turn[2] - block, key)

    def _event_refs(self, index: int, stack: int, block: int) -> list[tuple]:
        """The storages an event frees or hands over, as seen from its block (the free first)."""
        e = self.t.events[index]
        sids = ([] if e >= 0 else [~e]) + [sid for _, sid, _, _ in self.grads.get(index, ())]
        refs = []
        for sid in sids:
            if sid is None:
                refs.append(("none",))
                continue
            ref = self._ref(sid, stack, block)
            born = self.turn.get(self.born.get(sid, -1))
            if ref[0] == "fixed" and born is not None and born[1] == stack and born != self.turn.get(index):
                raise Irregular("a storage one block alone makes is freed by another block")
            refs.append(ref)
        return refs

    def _check_pair(
        self, sweep: _Sweep, phase: int, period: int, a: int | None, b: int | None
    ) -> tuple[int, int] | None:
        """The event the template takes of this aligned pair (``(index, kept block)``; None: it takes
        none); raises where the turns disagree."""
        kept = 2 * period
        blocks = (phase, phase + period)
        present = [(x, blk) for x, blk in zip((a, b), blocks) if x is not None]
        events = [self.t.events[x] for x, _ in present]
        refs = [self._event_refs(x, sweep.stack, blk) for x, blk in present]
        if len(present) == 1:
            (x, blk), other = present[0], blocks[1] if present[0][1] == blocks[0] else blocks[0]
            if events[0] >= 0:
                if self.grads.get(x):
                    raise Irregular("one block alone hands over a gradient")
                return None  # made once, by this turn alone: it stays with the turn
            if all(r[0] == "fixed" for r in refs[0]):
                return None  # a stand-in freed at the end of the stack
            if any(r[0] != "rel" or 0 <= other + r[1] < kept for r in refs[0]):
                raise Irregular("one block of a phase frees a storage its counterpart keeps")
            return x, blk
        if (events[0] >= 0) != (events[1] >= 0):
            raise Irregular("the turns of two blocks of one phase differ (an allocation against a free)")
        hands = [self.grads.get(x, ()) for x, _ in present]
        if len(refs[0]) != len(refs[1]) or [h[2] for h in hands[0]] != [h[2] for h in hands[1]]:
            raise Irregular("the turns of two blocks of one phase hand over different gradients")
        # Each difference must be an end of the stack: one side refers to a neighbour the other lacks.
        pairs: list[tuple[Any, Any]] = list(zip(*refs))
        pairs += [(self.names.relative(ma, sweep.stack, blocks[0]), self.names.relative(mb, sweep.stack, blocks[1]))
                  for (_, _, _, ma), (_, _, _, mb) in zip(*hands)]  # fmt: skip
        if events[0] >= 0:
            sa, sb = self._alloc_sig(events[0], sweep.stack, blocks[0]), self._alloc_sig(events[1], sweep.stack, blocks[1])
            if sa[:3] + sa[4:] != sb[:3] + sb[4:]:
                raise Irregular("the turns of two blocks of one phase allocate differently")
            pairs.append((sa[3], sb[3]))
        interior = set()
        for ra, rb in pairs:
            if ra == rb and not (isinstance(ra, tuple) and ra[0] == "fixed"):
                continue
            side = _end_of_stack(ra, rb, blocks, kept)
            if side is None:
                raise Irregular("the turns of two blocks of one phase free or name different storages")
            interior.add(side)
        if len(interior) > 1:
            raise Irregular("neither of two blocks of one phase frees as a block between two others would")
        return present[interior.pop() if interior else 0]

    # -- writing the full-depth trace ------------------------------------------------------------
    def write(self) -> MemoryTrace:
        t = self.t
        out = MemoryTrace(nbytes=dict(t.nbytes), role=dict(t.role), op=dict(t.op), rows=dict(t.rows),
                          module={}, notes=[], flops={})  # fmt: skip
        self.out = out
        self.fresh = max(t.nbytes, default=-1) + 1
        self.written: dict[tuple[tuple[int, int, int], int], int] = {}  # (key, full block) -> written sid
        self.full_of: dict[int, int] = {}  # kept sid born in a turn -> full index of its block
        for sid, name in t.module.items():
            turn = self.turn.get(self.born.get(sid, -1))
            if turn is None:
                out.module[sid] = self.names.written(name, None, 0, 0)
            else:
                out.module[sid] = self.names.written(name, turn[1], turn[2], self._full(turn[1], turn[2]))
        new_index: dict[int, int] = {}
        starts = {sweep.start: sweep for sweep in self.sweeps}
        i, n = 0, len(t.events)
        while i < n:
            sweep = starts.get(i)
            if sweep is None:
                new_index[i] = len(out.events)
                self._emit(i, None, 0, 0)
                i += 1
                continue
            for full, source in self._turns(sweep):
                if isinstance(source, int):  # a kept block's own turn
                    a, b = sweep.runs[source]
                    for x in range(a, b):
                        new_index[x] = len(out.events)
                        self._emit(x, sweep.stack, source, full)
                else:
                    self._emit_template(sweep, source[1], full)
            i = sweep.end
        new_index[n] = len(out.events)
        for index, entry in self.grads.items():
            if index == n:
                for _, sid, copied, made in entry:
                    out.grads.append((len(out.events), sid, copied, self.names.written(made, None, 0, 0)))
        out.phases = [(new_index[index], phase, step) for index, phase, step in t.phases]
        out.flops = self._flops()
        out.notes = _notes(t.notes, self.names, self.stacks)
        self._check()
        return out

    def _full(self, stack: int, block: int) -> int:
        """Full index, within the stack's repeating blocks, of kept block ``block``."""
        st = self.stacks[stack]
        return block if block < st.period else block + st.inserted

    def _turns(self, sweep: _Sweep) -> Iterator[tuple[int, Any]]:
        """``(full index, kept block or ("template", phase))`` of each turn of the full sweep, in order."""
        st = self.stacks[sweep.stack]
        order = range(st.length - 1, -1, -1) if sweep.descending else range(st.length)
        for full in order:
            if full < st.period:
                yield full, full
            elif full >= st.period + st.inserted:
                yield full, full - st.inserted
            else:
                yield full, ("template", full % st.period)

    def _target(self, sid: int, stack: int | None, block: int, full: int) -> int:
        """The storage ``sid`` (freed or handed over by ``block``'s turn, full index ``full``) stands for."""
        if stack is None:
            return sid
        ref = self._ref(sid, stack, block)
        if ref[0] == "fixed":
            return sid
        return self._storage(ref[2], full + ref[1], stack)

    def _storage(self, key: tuple[int, int, int], full: int, stack: int) -> int:
        st = self.stacks[stack]
        if not 0 <= full < st.length or full % st.period != key[1]:
            raise Irregular("a block frees a storage of a block the stack does not have")
        if full < st.period:
            return self.by_key[(key, full)]
        if full >= st.period + st.inserted:
            return self.by_key[(key, full - st.inserted)]
        sid = self.written.get((key, full))
        if sid is None:
            raise Irregular("a written block frees a storage before it is made")
        return sid

    def _emit(self, index: int, stack: int | None, block: int, full: int) -> None:
        out = self.out
        for _, sid, copied, made in self.grads.get(index, ()):
            target = self._target(sid, stack, block, full) if sid is not None else None
            out.grads.append((len(out.events), target, copied, self.names.written(made, stack, block, full)))
        e = self.t.events[index]
        out.events.append(e if e >= 0 else ~self._target(~e, stack, block, full))

    def _emit_template(self, sweep: _Sweep, phase: int, full: int) -> None:
        out, t = self.out, self.t
        for x, block in sweep.templates[phase]:
            e = t.events[x]
            for _, sid, copied, made in self.grads.get(x, ()):
                target = self._target(sid, sweep.stack, block, full) if sid is not None else None
                out.grads.append((len(out.events), target, copied, self.names.written(made, sweep.stack, block, full)))
            if e < 0:
                out.events.append(~self._target(~e, sweep.stack, block, full))
                continue
            sid = self.fresh
            self.fresh += 1
            self.written[(self.key[e], full)] = sid
            out.events.append(sid)
            out.nbytes[sid] = t.nbytes[e]
            out.module[sid] = self.names.written(t.module.get(e, ""), sweep.stack, block, full)
            for table in (out.role, out.op, out.rows):
                if e in table:
                    table[sid] = table[e]  # type: ignore[index]

    def _flops(self) -> dict[tuple[str, int], int]:
        totals: dict[tuple[str, int], int] = {}
        by_label = self.labels.flops
        for (phase, step, label), n in by_label.items():
            totals[(phase, step)] = totals.get((phase, step), 0) + n
        for (phase, step, label), n in by_label.items():
            if label is None:
                continue
            st = self.stacks[label[0]]
            if label[1] < st.period:
                twin = by_label.get((phase, step, (label[0], label[1] + st.period)), 0)
                if twin != n:
                    raise Irregular("two blocks of one phase do different floating-point work")
                totals[(phase, step)] += n * (st.inserted // st.period)
            elif (phase, step, (label[0], label[1] - st.period)) not in by_label:
                raise Irregular("two blocks of one phase do different floating-point work")
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
        for (key, full), sid in self.written.items():
            stack = self.sweeps[key[0]].stack
            period = self.stacks[stack].period
            kinds = {self.by_key[(key, key[1])] in freed, self.by_key[(key, key[1] + period)] in freed}
            if len(kinds) == 1 and (sid in freed) not in kinds:
                raise Irregular("a written block's storage lives differently from the traced blocks' own")


def _end_of_stack(ra: Any, rb: Any, blocks: tuple[int, int], kept: int) -> int | None:
    """Which side (0, 1) refers to a neighbour block the other side's block lacks, where the other
    refers to something else in its place (None: they differ otherwise)."""
    for side, (mine, theirs) in enumerate(((ra, rb), (rb, ra))):
        if isinstance(mine, tuple) and mine[0] in ("rel", "block") and not _is_relative(theirs):
            if not 0 <= blocks[1 - side] + mine[1] < kept:
                return side
    return None


def _is_relative(x: Any) -> bool:
    return isinstance(x, tuple) and x[0] in ("rel", "block")


def _notes(notes: list[str], names: _Names, stacks: list[Stack]) -> list[str]:
    """The notes of the full-depth step: a note made in a kept block is made in every block."""
    out: list[str] = []
    labelled: list[tuple[tuple[int, int] | None, str, str]] = []
    for note in notes:
        module, sep, rest = note.partition(": ")
        parsed = names.parse(module) if sep else None
        label = None
        if parsed is not None:
            st = stacks[parsed[0]]
            block = parsed[1] - st.start
            if 0 <= block < st.kept:
                label = (parsed[0], block)
        labelled.append((label, module, sep + rest))
    i = 0
    while i < len(labelled):
        label, module, rest = labelled[i]
        if label is None:
            out.append(names.written(module, None, 0, 0) + rest if rest.startswith(": ") else module)
            i += 1
            continue
        stack = stacks[label[0]]
        j = i
        group: dict[int, list[tuple[str, str]]] = {}
        while j < len(labelled) and labelled[j][0] is not None and labelled[j][0][0] == label[0]:  # type: ignore[index]
            group.setdefault(labelled[j][0][1], []).append((labelled[j][1], labelled[j][2]))  # type: ignore[index]
            j += 1
        blocks = [labelled[x][0][1] for x in range(i, j)]  # type: ignore[index]
        ordered = blocks == sorted(blocks) and set(blocks) == set(range(stack.kept))
        texts = {b: [(names.relative(m, label[0], b), r) for m, r in group[b]] for b in group}
        if not ordered or any(texts.get(b) != texts.get(b + stack.period) for b in range(stack.period)):
            raise Irregular("the notes of two blocks of one phase differ")
        for full in range(stack.length):
            kept = full if full < stack.period else full - stack.inserted
            source = kept if full < stack.period or full >= stack.period + stack.inserted else full % stack.period
            for m, r in group[source]:
                out.append(names.written(m, label[0], source, full) + r)
        i = j
    return out
