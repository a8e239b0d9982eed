"""Reading a trace whose stacks were cut to four periods (``synthesis/depth.py``): its sweeps, their turns, and the
template the blocks between the ends of a stack repeat.

The cut trace is read as fixed events (the model's other parts) and *sweeps*: wherever the step goes
over a stack's blocks in order (a forward, a backward in reverse, one of the optimizer's loops), the
events of each block's turn, one turn after another. A stack keeps its first three periods and its
last. The first and the last are its ends and may differ from the rest: the first block reads the
embedding's output (and in a fine-tuned model may not need its input's gradient), the last block's
output goes to the head, and the first turn of a sweep makes what is made once (a library's
workspace). The two middle periods are consecutive blocks of the model with a neighbour on each side,
as every block between the ends has: their turns must agree event for event, phase by phase of the
period, up to storage identity and to what each reads of the end next to it (the first middle block
frees the first block's storages where the second frees the first middle block's). Together they are
the *template* every block written between the third period and the last takes (``memory/synthesis/fulldepth.py``).
Storages are named by ``(sweep, phase, position in the template)`` plus the block (the end turns are
aligned to the template too, where they agree with it), so a turn frees "the storage of block ``n + d``
at that position".
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from ..trace.tracer import MemoryTrace
from .blocklabels import Label, Labels
from .stacks import Stack

__all__ = ["Irregular", "Key", "SweepReader", "frees_in_order"]

Key = tuple[int, int, int]
"""A storage's name within its block: ``(sweep, phase, position in the template)``."""


class Irregular(Exception):
    """The cut trace does not repeat as depth synthesis assumes (the message says where)."""


@dataclass
class Sweep:
    stack: int
    runs: list[tuple[int, int]]
    """``(start, end)`` event range of each kept block's turn, by block index."""
    descending: bool
    templates: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per phase: the two middle turns' events, paired (the template)."""

    @property
    def start(self) -> int:
        return min(a for a, _ in self.runs)

    @property
    def end(self) -> int:
        return max(b for _, b in self.runs)


class BlockNames:
    """Module names of the cut model, read relative to a block and written at full depth."""

    def __init__(self, stacks: list[Stack], root: str) -> None:
        self.stacks = stacks
        self.prefixes = [f"{root}.{s.path}." if s.path else f"{root}." for s in stacks]
        self._parsed: dict[str, tuple[int, int, str] | None] = {}

    def parse(self, name: str) -> tuple[int, int, str] | None:
        """``(stack, container index in the cut model, rest of the name)`` of a module in a stack's container (of
        two stacks in one container, the one whose kept blocks hold it, else the first)."""
        found = self._parsed.get(name, ())
        if found != ():
            return found  # type: ignore[return-value]
        out = None
        for s, prefix in enumerate(self.prefixes):
            if out is not None and prefix != self.prefixes[out[0]]:
                continue
            if name.startswith(prefix):
                index, dot, rest = name[len(prefix) :].partition(".")
                st = self.stacks[s]
                if index.isdigit() and (out is None or 0 <= int(index) - st.cut_start < st.kept):
                    out = (s, int(index), dot + rest)
        self._parsed[name] = out
        return out

    def block(self, name: str) -> tuple[int, int, str] | None:
        """``(stack, kept block, rest)`` of a module inside a kept block."""
        parsed = self.parse(name)
        if parsed is None:
            return None
        s, index, rest = parsed
        b = index - self.stacks[s].cut_start
        return (s, b, rest) if 0 <= b < self.stacks[s].kept else None

    def relative(self, name: str, stack: int, block: int) -> Any:
        """``name`` as seen from ``block`` of ``stack``: a kept block's module by its distance."""
        found = self.block(name)
        if found is None or found[0] != stack:
            return name
        return ("block", found[1] - block, found[2])

    def written(self, name: str, stack: int | None, block: int, full: int) -> str:
        """``name`` in the full model, for a storage of ``block`` (full index ``full``) of ``stack``."""
        return self.name_at(self.written_parts(name, stack, block), full)

    @staticmethod
    def name_at(parts: tuple[str, int | None, str], full: int) -> str:
        """The name ``written_parts`` gave ``parts`` of, for block ``full``."""
        head, offset, tail = parts
        return head if offset is None else f"{head}{full + offset}{tail}"

    def written_parts(self, name: str, stack: int | None, block: int) -> tuple[str, int | None, str]:
        """``written(name, stack, block, full)`` for every ``full`` at once, read once for all the blocks
        written from one template: ``head``, where the name does not depend on ``full`` (``offset`` None),
        else ``f"{head}{full + offset}{tail}"`` (a module of the block or of a neighbour)."""
        parsed = self.parse(name)
        if parsed is None:
            return name, None, ""
        s, index, rest = parsed
        st = self.stacks[s]
        b = index - st.cut_start
        if s == stack and 0 <= b < st.kept:
            return self.prefixes[s], st.start + b - block, rest
        full = index + sum(x.inserted_before(index) for x in self.stacks if x.path == st.path)
        return f"{self.prefixes[s]}{full}{rest}", None, ""


def frees_in_order(trace: MemoryTrace, labels: Labels) -> tuple[MemoryTrace, Labels]:
    """``trace`` with each run of consecutive frees in one order: the other parts' first, then by block,
    each block's in the order its storages were born.

    The storages a run frees are freed together as far as the allocator is concerned (its state after
    them does not depend on their order: freed blocks merge with free neighbours either way), and
    Python frees some in an order of its own (autocast's cache of weight copies, a dict, at the end of
    a forward). A run is cut where a phase starts or a gradient is handed over.
    """
    events, lab = list(trace.events), list(labels.events)
    born = {e: i for i, e in enumerate(events) if e >= 0}
    cuts = {index for index, _, _ in trace.phases} | {entry[0] for entry in trace.grads}
    i, n = 0, len(events)
    while i < n:
        if events[i] >= 0:
            i += 1
            continue
        j = i + 1
        while j < n and events[j] < 0 and j not in cuts:
            j += 1
        if j - i > 1:
            order = sorted(range(i, j), key=lambda x: (lab[x] is not None, lab[x] or (0, 0), born.get(~events[x], -1)))
            events[i:j] = [events[x] for x in order]
            lab[i:j] = [lab[x] for x in order]
        i = j
    return dataclasses.replace(trace, events=events), dataclasses.replace(labels, events=lab)


class SweepReader:
    """The sweeps of a cut trace, their turns' storages named, and each phase's template (checked)."""

    def __init__(self, trace: MemoryTrace, labels: Labels, stacks: list[Stack], root: str) -> None:
        self.t = trace
        self.labels = labels
        self.stacks = stacks
        self.names = BlockNames(stacks, root)
        self.sweeps: list[Sweep] = []
        self.born: dict[int, int] = {}  # sid -> event index of its birth
        for i, e in enumerate(trace.events):
            if e >= 0:
                self.born[e] = i
        self.turn: dict[int, tuple[int, int, int]] = {}  # event index -> (sweep, stack, kept block)
        self.key: dict[int, Key] = {}  # sid -> its name within its block
        self.by_key: dict[tuple[Key, int], int] = {}  # (key, kept block) -> sid
        self.grads: dict[int, list[tuple[int, int | None, bool, str]]] = {}  # event index -> hand-overs before it
        for entry in trace.grads:
            self.grads.setdefault(entry[0], []).append(entry)

    # -- reading the cut trace ------------------------------------------------------------------
    def segment(self) -> None:
        """Find the sweeps: consecutive turns (runs of one label) of every kept block, in order."""
        lab = self.labels.events
        runs: list[tuple[Label, int, int]] = []
        i, n = 0, len(lab)
        starts = {index for index, _, _ in self.t.phases}  # a turn never runs on into the next phase
        while i < n:
            label = lab[i]
            j = i + 1
            while j < n and lab[j] == label and j not in starts:
                j += 1
            if label is not None:
                runs.append((label, i, j))
            i = j
        used = [False] * len(runs)
        for r, (label, _, _) in enumerate(runs):
            if not used[r]:
                self._sweep_from(runs, r, label, used)
        for r, (label, _, _) in enumerate(runs):
            if not used[r] and r > 0 and used[r - 1]:
                self._sweep_back(runs, r, label, used)
        for r, (label, start, end) in enumerate(runs):
            if not used[r] and any(self.t.events[x] >= 0 for x in range(start, end)):
                raise Irregular(f"block {label[1]} of a stack allocates outside its turn in a sweep over the blocks")
        for index, _, _ in self.t.phases:
            if any(sweep.start < index < sweep.end for sweep in self.sweeps):
                raise Irregular("a phase of the step starts in the middle of a sweep over the blocks")

    def _sweep_back(self, runs: list[tuple[Label, int, int]], r: int, label: Label, used: list[bool]) -> None:
        """A sweep that turns back where the one before it ended (a list of ``_foreach`` outputs made in
        order and freed in reverse): the two sweeps' turns of the end block are one run of events. It is
        split where each of the two is as long as its sweep's turn of the block next to it."""
        before = next((sw for sw in self.sweeps if sw.end == runs[r][1]), None)
        if before is None or before.stack != label[0]:
            return
        last = 0 if before.descending else len(before.runs) - 1
        if label[1] != last + (1 if before.descending else -1):
            return
        chain = self._chain(runs, r, label, not before.descending, len(before.runs) - 1)
        if chain is None:
            return
        shared = before.runs[last]
        neighbour = before.runs[last + (1 if before.descending else -1)]
        mine = runs[chain[0]][1:]
        split = shared[0] + neighbour[1] - neighbour[0]
        if shared[1] - split != mine[1] - mine[0]:
            return  # the two turns of the end block cannot be told apart: left as they are (irregular)
        before.runs[last] = (shared[0], split)
        spans = [(last, split, shared[1])] + [(runs[c][0][1], runs[c][1], runs[c][2]) for c in chain]
        self._add_sweep(label[0], spans, not before.descending)
        for c in chain:
            used[c] = True

    def _chain(self, runs: list[tuple[Label, int, int]], r: int, label: Label, descending: bool,
               count: int, gaps: bool = False) -> list[int] | None:  # fmt: skip
        """``count`` adjacent runs from ``r`` whose blocks go down (or up) by one from ``label``'s (with
        ``gaps``: consecutive runs, events of the other parts between them allowed)."""
        chain = [r]
        while len(chain) < count:
            nxt = chain[-1] + 1
            want = (label[0], label[1] + (-1 if descending else 1) * len(chain))
            if nxt >= len(runs) or runs[nxt][0] != want or (runs[nxt][1] != runs[chain[-1]][2] and not gaps):
                return None
            chain.append(nxt)
        return chain

    def _loop_turns(self, runs: list[tuple[Label, int, int]],
                    chain: list[int]) -> list[tuple[int, int, int]] | None:  # fmt: skip
        """The turns of a sweep whose runs ``chain`` are, each turn after the first taking the events of
        the other parts before it: the loop over the blocks doing the same work between every two blocks
        (a layer-drop draw, which frees the draw before it); None where that work is not alike between
        every two turns, or is more than such work (``_loop_work``)."""
        turns = [(runs[chain[0]][0][1], runs[chain[0]][1], runs[chain[0]][2])]
        between = set()
        for before, c in zip(chain, chain[1:]):
            work = self._loop_work(runs[before][2], runs[c][1])
            if work is None:
                return None
            between.add(work)
            turns.append((runs[c][0][1], runs[before][2], runs[c][2]))
        return turns if len(between) == 1 else None

    def _loop_work(self, a: int, b: int) -> tuple | None:
        """Events ``a`` to ``b`` (the other parts' work between two turns) as a signature: what each
        makes, and what each frees, by its place among those made there or else by what it is; None where
        a phase starts, a gradient is handed over or an op does floating-point work there."""
        if a == b:
            return ()
        if any(a <= index <= b for index, _, _ in self.t.phases) or any(a < x < b for x in self.grads):
            return None
        if any(a <= x <= b for x in self.labels.loose_flops):
            return None
        t = self.t
        made: dict[int, int] = {}
        out: list[tuple] = []
        for x in range(a, b):
            e = t.events[x]
            sid = e if e >= 0 else ~e
            what = (t.nbytes[sid], t.role.get(sid), t.op.get(sid), t.rows.get(sid), t.module.get(sid))
            if e >= 0:
                made[e] = len(made)
                out.append(("a", *what))
            else:
                out.append(("f", made[sid]) if sid in made else ("f", "earlier", *what))
        return tuple(out)

    def _add_sweep(self, stack: int, spans: list[tuple[int, int, int]], descending: bool) -> None:
        sweep = Sweep(stack, [(a, b) for _, a, b in sorted(spans)], descending)
        for block, (a, b) in enumerate(sweep.runs):
            for x in range(a, b):
                self.turn[x] = (len(self.sweeps), stack, block)
        self.sweeps.append(sweep)

    def _sweep_from(self, runs: list[tuple[Label, int, int]], r: int, label: Label, used: list[bool]) -> None:
        kept = self.stacks[label[0]].kept
        for descending in (False, True):
            if label[1] != (kept - 1 if descending else 0):
                continue
            chain = self._chain(runs, r, label, descending, kept, gaps=True)
            turns = self._loop_turns(runs, chain) if chain is not None else None
            if chain is not None and turns is not None:
                self._add_sweep(label[0], turns, descending)
                for c in chain:
                    used[c] = True
                return

    def _alloc_sig(self, sid: int, stack: int, block: int) -> tuple:
        t = self.t
        return (t.nbytes[sid], t.role.get(sid), t.op.get(sid), t.rows.get(sid),
                self.names.relative(t.module.get(sid, ""), stack, block))  # fmt: skip

    def _coarse(self, index: int, stack: int, block: int) -> tuple:
        """What alignment compares of an event: an allocation's storage, a free's storage by the turn
        that made it (before storages have names), and the hand-overs just before it; ``_template``
        then compares what alignment paired in full."""
        e = self.t.events[index]
        sig: tuple = ("a", self._alloc_sig(e, stack, block)) if e >= 0 else ("f", self._coarse_ref(~e, stack, block))
        hand = self.grads.get(index)
        if hand:
            sig += tuple((self._coarse_ref(sid, stack, block) if sid is not None else None, copied,
                          self.names.relative(made, stack, block)) for _, sid, copied, made in hand)  # fmt: skip
        return sig

    def _coarse_ref(self, sid: int, stack: int, block: int) -> tuple:
        turn = self.turn.get(self.born.get(sid, -1))
        if turn is None or turn[1] != stack:
            return ("fixed",)
        return ("turn", turn[0], turn[2] - block, self._alloc_sig(sid, stack, turn[2]))

    def align(self) -> None:
        """Name the storages of each sweep's turns, and take each phase's template from its two middle
        turns, which must agree event for event."""
        middles = []
        for s_index, sweep in enumerate(self.sweeps):
            period = self.stacks[sweep.stack].period
            for phase in range(period):
                first, second, third, last = (phase + k * period for k in range(4))
                pairs = self._pairs(sweep, second, third)
                middles.append((sweep, phase, pairs))
                position_of: dict[int, int] = {}
                for position, (a, b) in enumerate(pairs):
                    position_of[a] = position_of[b] = position
                    if self.t.events[a] >= 0:
                        self._name(self.t.events[a], (s_index, phase, position), second)
                        self._name(self.t.events[b], (s_index, phase, position), third)
                for end, middle in ((first, second), (last, third)):  # the ends, where they agree
                    for a, b in self._pairs(sweep, end, middle, exact=False):
                        if self.t.events[a] >= 0 and b in position_of:
                            self._name(self.t.events[a], (s_index, phase, position_of[b]), end)
        for sweep, phase, pairs in middles:
            for a, b in pairs:
                self._check_middles(sweep, phase, a, b)
            sweep.templates.append(pairs)

    def _name(self, sid: int, key: Key, block: int) -> None:
        self.key[sid] = key
        self.by_key[(key, block)] = sid

    def _pairs(self, sweep: Sweep, first: int, second: int, exact: bool = True) -> list[tuple[int, int]]:
        """The events of two turns aligned (only those that agree, unless ``exact``: then all must)."""
        (a0, a1), (b0, b1) = sweep.runs[first], sweep.runs[second]
        if exact:  # paired by position: ``_check_middles`` compares them in full
            if a1 - a0 != b1 - b0:
                raise Irregular("two blocks between the ends of a stack do not repeat (their turns differ in length)")
            return [(a0 + x, b0 + x) for x in range(a1 - a0)]
        sig_a = [self._coarse(i, sweep.stack, first) for i in range(a0, a1)]
        sig_b = [self._coarse(i, sweep.stack, second) for i in range(b0, b1)]
        if sig_a == sig_b:
            return [(a0 + x, b0 + x) for x in range(a1 - a0)]
        pairs: list[tuple[int, int]] = []
        matcher = difflib.SequenceMatcher(None, sig_a, sig_b, autojunk=False)  # type: ignore[arg-type]
        for i, j, size in matcher.get_matching_blocks():
            pairs.extend((a0 + i + x, b0 + j + x) for x in range(size))
        return pairs

    def _refs(self, index: int, stack: int, block: int) -> list[tuple]:
        """The storages an event frees or hands over, as seen from its block: ``("rel", distance, key)``,
        ``("end", sid)`` for one only an end turn of this stack has, ``("fixed", sid)`` otherwise."""
        e = self.t.events[index]
        sids = ([] if e >= 0 else [~e]) + [sid for _, sid, _, _ in self.grads.get(index, ())]
        refs: list[tuple] = []
        for sid in sids:
            turn = self.turn.get(self.born.get(sid, -1)) if sid is not None else None
            if turn is None or turn[1] != stack:
                refs.append(("fixed", sid))
            elif sid in self.key:
                refs.append(("rel", turn[2] - block, self.key[sid]))
            else:
                refs.append(("end", sid))
        return refs

    def _check_middles(self, sweep: Sweep, phase: int, a: int, b: int) -> None:
        """Raise where a pair of events of the middle turns differ beyond what each reads of an end
        turn (which ``_pick`` resolves block by block when the trace is written)."""
        period = self.stacks[sweep.stack].period
        blocks = (phase + period, phase + 2 * period)
        ea, eb = self.t.events[a], self.t.events[b]
        if (ea >= 0) != (eb >= 0) or (
            ea >= 0 and self._alloc_sig(ea, sweep.stack, blocks[0]) != self._alloc_sig(eb, sweep.stack, blocks[1])
        ):
            raise Irregular("two blocks between the ends of a stack do not repeat (they allocate differently)")
        hands = (self.grads.get(a, ()), self.grads.get(b, ()))
        if [h[2] for h in hands[0]] != [h[2] for h in hands[1]]:
            raise Irregular("two blocks between the ends of a stack hand over different gradients")
        refs = zip(self._refs(a, sweep.stack, blocks[0]), self._refs(b, sweep.stack, blocks[1]))
        for k, (ra, rb) in enumerate(refs):
            if ra == rb and (ra[0] == "rel" or ra == ("fixed", None)):
                continue
            if k == 0 and ea < 0 and (self._carried(sweep, ra, rb, blocks[0], blocks[1])
                                      or self._carried(sweep, rb, ra, blocks[1], blocks[0])):  # fmt: skip
                continue
            a_middle = self._to_middle(ra, sweep.stack, blocks[0])
            b_middle = self._to_middle(rb, sweep.stack, blocks[1])
            if not (a_middle or b_middle) or (a_middle and b_middle) or "fixed" in (ra[0], rb[0]):
                raise Irregular("two blocks between the ends of a stack do not repeat (they free different storages)")

    def _carried(self, sweep: Sweep, fixed: tuple, other: tuple, fixed_block: int, other_block: int) -> bool:
        """Whether the middle turn of ``fixed_block`` frees a storage made before the sweep where the
        other middle turn frees the first one's: a loop variable each turn drops for its own, the first
        of which the loop made before its first block (``_pick`` gives it to that turn alone)."""
        if fixed[0] != "fixed" or fixed[1] is None or other[0] != "rel" or other_block + other[1] != fixed_block:
            return False
        return self.born.get(fixed[1], sweep.start) < sweep.start

    def _to_middle(self, ref: tuple, stack: int, block: int) -> bool:
        period = self.stacks[stack].period
        return ref[0] == "rel" and period <= block + ref[1] < 3 * period
