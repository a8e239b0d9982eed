"""Which block of a stack each event of a trace belongs to (the labels depth synthesis reads).

NOTE [ Labelling a trace by block ]
An event gets the label ``(stack, block)`` of the block it belongs to, or None when it belongs to the
model's other parts (the embedding, the head, the loss), from what the ``Tracer`` tells a
``BlockRecorder`` as the step runs:

* in a forward (a checkpointed block's recomputation too): the block of the innermost module running
  that is one of the model's (a module kept outside the model's tree, such as a shared activation,
  runs as part of its caller);
* in backward: the label of the forward that made the node running, known by the node's sequence
  number (autograd numbers nodes as ops make them; the recorder notes the number at each change of
  label in the forward), or, for a node no forward made (a parameter's ``AccumulateGrad``), the label
  of the last node that ran;
* outside every module (the optimizer's step, ``zero_grad``, the loss's own code): the block of the
  tensor the event is about. A parameter, buffer or tensor attribute belongs to the block holding it,
  and a gradient or optimizer state to its parameter's; an op's new output to the block of the tensors
  it was computed from (index by index for the multi-tensor ``_foreach`` ops), resolved once the trace
  is over, when the optimizer's step counters are known to be states. A free belongs to the freed
  storage's block, except that a loop's variable dropped on the next turn (the per-parameter optimizer
  loop rebinds ``denom``) belongs to the turn that drops it: a group of consecutive frees between two
  events of one label, of storages of that label and at most one other, takes that label. So does a
  group of frees made outside the blocks between the turns of two neighbour blocks: a loop over the
  blocks rebinding its variable when the next block returns (``output = layer(output)``).

An op outside the blocks whose output is computed from several blocks of one stack (a loss over every
layer's router logits, a norm of all gradients stacked) has a size that depends on the depth: the
labels say so (``Labels.mixed``) and the trace is not synthesised. Except for the one such op whose size
follows from its inputs: ``stack`` or ``cat`` of equal pieces, as many from every kept block, made under
``no_grad`` (so autograd makes nothing of its size in backward) and read only by ops whose outputs are no
larger than a piece (reductions): the per-parameter norms ``clip_grad_norm_`` stacks and reduces. Its
output is the model's other parts' (it is made and freed once), and ``Labels.stacked`` gives the writer
its pieces, so that it writes the output's size at full depth: one piece more for each piece a written
block adds. (A CPU kernel's scratch for an op over several blocks' tensors is fine too when the kernel
allocated none.)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...workload import parameter_attachments
from ..trace.tracer import CPU_SCRATCH, MemoryTrace
from .stacks import _tensors

__all__ = ["BlockRecorder", "Label", "Labels"]

Label = tuple[int, int]
"""``(stack, block)``: the stack's index in the recorder's list, the block's index among the kept ones."""
_NO_MODULE = "no module"
"""The context of an event outside every module."""
_STACKING = ("aten.stack.", "aten.cat.")
"""Ops whose output is their inputs side by side: its size follows from theirs (see the NOTE)."""
_UNNUMBERED = 1 << 63
"""Sequence numbers from here up are not a forward's (``AccumulateGrad``'s is the largest integer)."""


@dataclass
class Labels:
    """The labels of one trace's events and storages."""

    events: list[Label | None]
    """Per event of the trace."""
    owner: dict[int, Label | None]
    """Per storage: the block it belongs to (None: the model's other parts)."""
    flops: dict[tuple[str, int, Label | None], int] = field(default_factory=dict)
    """FLOPs by phase, step and the label of the op that did them."""
    mixed: str = ""
    """Why the step's ops mix blocks outside them (empty: they do not)."""
    stacked: dict[int, tuple[Label | None, ...]] = field(default_factory=dict)
    """Storages outside the blocks that stack or concatenate equal pieces of several blocks: the label of each
    piece (see the NOTE)."""
    loose_flops: list[int] = field(default_factory=list)
    """Where ops outside the blocks did floating-point work: the number of events before each returned."""


class BlockRecorder:
    """Told by the ``Tracer`` where each event happens and what each op outside the blocks reads.

    Args:
        module_labels: the label of every module of the model (as the tracer names it): a kept block's
            for those inside one, None for the others.
        tensor_labels: the label of every model tensor (by ``id``) inside a kept block.
    """

    def __init__(self, module_labels: dict[str, Label | None], tensor_labels: dict[int, Label]) -> None:
        self._module_labels = module_labels
        self._tensor_labels = tensor_labels
        self._where: list[Any] = []  # per event: a label, None (another module) or _NO_MODULE
        self._owned: dict[int, Label | None] = {}
        self._inputs: dict[int, tuple[int, ...]] = {}  # new storage -> storages it was computed from
        self._mixing: list[tuple[int, tuple[int, ...]]] = []  # outside the blocks: an output, the storages it read
        self._flops: list[tuple[str, int, Any, int]] = []  # (phase, step, label or a storage, flops)
        self._backward: Label | None = None  # the label of the last node that ran
        self._numbers: list[int] = []  # the sequence number at each change of label in a forward
        self._numbered: list[Label | None] = []  # ... and the label from there on
        self._next_number = 0
        self._during_op: list[int] = []  # storages a kernel made inside the op running now
        self._loose_flops: list[int] = []  # events so far, after each op outside the blocks with FLOPs
        self._untracked: set[int] = set()  # storages made under no_grad outside backward: autograd never sees them

    def _here(self, tracer: Any) -> Any:
        """The label of what runs now: a block's, None (the other parts) or ``_NO_MODULE``."""
        forward = tracer.forward_modules()
        if forward:
            for name in reversed(forward):
                if name in self._module_labels:
                    return self._module_labels[name]
            return None
        node = torch._C._current_autograd_node()
        if node is None:
            return _NO_MODULE
        number = node._sequence_nr()
        if number < _UNNUMBERED:
            at = bisect.bisect_right(self._numbers, number) - 1
            self._backward = self._numbered[at] if at >= 0 else None
        return self._backward

    def event(self, tracer: Any) -> None:
        """An event (allocation or free) happened now."""
        here = self._here(tracer)
        self._where.append(here)
        e = tracer.trace.events[-1]
        if here is _NO_MODULE and e >= 0 and tracer.current_op() is not None:
            self._during_op.append(e)  # a kernel's scratch: the op's, whatever block the op's is

    def own(self, sid: int, tensor: torch.Tensor) -> None:
        """``sid`` is ``tensor`` itself, its gradient or one of its optimizer states."""
        self._owned[sid] = self._tensor_labels.get(id(tensor))

    def after_op(self, tracer: Any, func: Any, args: tuple, outputs: list, first_new: int, flops: int) -> None:
        """What an op read, for the storages it made outside the blocks."""
        here = self._here(tracer)
        if tracer.forward_modules() or torch._C._current_autograd_node() is None:
            # Autograd makes an op's node before it runs the op: this op's nodes are numbered from
            # where the last op's left off.
            tag = None if here is _NO_MODULE else here
            if not self._numbered or self._numbered[-1] != tag:
                self._numbers.append(self._next_number)
                self._numbered.append(tag)
            self._next_number = torch._C._autograd._get_sequence_nr()
        if isinstance(here, tuple):
            if flops:
                self._flops.append((tracer.phase, tracer.step, here, flops))
            return
        new = [tracer.storage_id(t) for t in outputs]
        new = [s if s is not None and s >= first_new else None for s in new]
        if not torch.is_grad_enabled() and torch._C._current_autograd_node() is None:
            self._untracked.update(s for s in new if s is not None)  # under no_grad, outside backward
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a)]
        if lists and all(len(a) == len(outputs) for a in lists):  # a _foreach op: output i from inputs i
            for i, sid in enumerate(new):
                if sid is not None:
                    self._note(sid, [tracer.storage_id(a[i]) for a in lists], here)
        else:
            read = [tracer.storage_id(t) for t in _tensors_in(args)]
            for sid in new:
                if sid is not None:
                    self._note(sid, read, here)
        for sid in self._during_op:
            if sid not in self._inputs:
                self._note(sid, [tracer.storage_id(t) for t in _tensors_in(args)], here)
        self._during_op.clear()
        if flops:
            self._loose_flops.append(len(tracer.trace.events))
            first = next((s for s in new if s is not None), None)
            self._flops.append((tracer.phase, tracer.step, first if here is _NO_MODULE else None, flops))

    def _note(self, sid: int, read: list[int | None], here: Any) -> None:
        inputs = tuple(s for s in read if s is not None)
        if here is _NO_MODULE:
            self._inputs[sid] = inputs
        self._mixing.append((sid, inputs))

    def labels(self, trace: MemoryTrace) -> Labels:
        """The labels of ``trace``'s events and storages (see the NOTE)."""
        owner: dict[int, Label | None] = {}
        stacked: dict[int, tuple[Label | None, ...]] = {}
        mixed = ""
        born_where: dict[int, Any] = {}
        for e, where in zip(trace.events, self._where):
            if e >= 0:
                born_where[e] = where

        def spans(sid: int, inputs: tuple[int, ...], seen: set[Label]) -> bool:
            """Whether ``sid`` stacks equal pieces, as many from every kept block (noted in ``stacked``)."""
            op = trace.op.get(sid, "")
            if op.startswith(CPU_SCRATCH):  # a CPU kernel's scratch of an op over several blocks' tensors
                return trace.nbytes.get(sid) == 0  # none, at any depth
            if not op.startswith(_STACKING) or sid not in self._untracked:
                return False
            piece = trace.nbytes.get(inputs[0], 0) if inputs else 0
            if any(sid in read and trace.nbytes.get(other, 0) > piece for other, read in self._inputs.items()):
                return False  # something the size of the whole was computed from it: its size is the depth's too
            pieces = tuple(resolve(s) for s in inputs)
            per_block: dict[Label, int] = {}
            for label in pieces:
                if label is not None:
                    per_block[label] = per_block.get(label, 0) + 1
            if len({trace.nbytes.get(s) for s in inputs}) != 1 or len(set(per_block.values())) != 1:
                return False
            stacked[sid] = pieces
            return True

        def resolve(sid: int) -> Label | None:
            nonlocal mixed
            if sid in owner:
                return owner[sid]
            owner[sid] = None  # while its inputs resolve (an input never depends on its output)
            if sid in self._owned:
                found = self._owned[sid]
            elif born_where.get(sid) is _NO_MODULE:
                inputs = self._inputs.get(sid, ())
                seen = {resolve(s) for s in inputs} - {None}
                if len({s[0] for s in seen}) < len(seen) and not spans(sid, inputs, seen) and not mixed:
                    mixed = f"an op outside the blocks computed one tensor from {len(seen)} of them"
                found = next(iter(seen)) if len(seen) == 1 else None
            else:
                found = born_where.get(sid)
            owner[sid] = found
            return found

        for sid, inputs in self._mixing:
            seen = {resolve(s) for s in inputs} - {None}
            if len({s[0] for s in seen}) < len(seen) and sid not in stacked and not spans(sid, inputs, seen):
                mixed = mixed or f"an op outside the blocks computed one tensor from {len(seen)} of them"
        events: list[Label | None] = []
        for e, where in zip(trace.events, self._where):
            if where is _NO_MODULE:
                events.append(resolve(e if e >= 0 else ~e))
            else:
                events.append(where)
        _smooth_loop_frees(trace, events, self._where)
        flops: dict[tuple[str, int, Label | None], int] = {}
        for phase, step, who, n in self._flops:
            label = who if isinstance(who, tuple) else (resolve(who) if isinstance(who, int) else None)
            key = (phase, step, label)
            flops[key] = flops.get(key, 0) + n
        return Labels(events, owner, flops, mixed, stacked, list(self._loose_flops))


def _tensors_in(args: Any) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _smooth_loop_frees(trace: MemoryTrace, events: list[Label | None], where: list[Any]) -> None:
    """Frees made outside the blocks by a loop over them take the label of the turn they close (see the
    NOTE): a group of consecutive frees made outside every block, in one phase, between two events of
    one label (of that label's storages and at most one other block's), or between the turns of two
    neighbour blocks (a loop variable rebound when the next block returns)."""
    starts = sorted(index for index, _, _ in trace.phases)
    phase_of = [0] * len(events)
    k = 0
    for i in range(len(events)):
        while k + 1 < len(starts) and starts[k + 1] <= i:
            k += 1
        phase_of[i] = k

    def outside(x: int) -> bool:
        return trace.events[x] < 0 and (where[x] is _NO_MODULE or where[x] is None)

    i = 0
    n = len(events)
    while i < n:
        if not outside(i):
            i += 1
            continue
        j = i
        while j < n and outside(j):
            j += 1
        if i > 0 and j < n and phase_of[i - 1] == phase_of[i] == phase_of[j]:
            before, after = events[i - 1], events[j]
            if before == after:
                relabel = len({events[x] for x in range(i, j)} - {None, before}) <= 1
            else:
                relabel = before is not None and after is not None and before[0] == after[0] and abs(
                    before[1] - after[1]) == 1  # fmt: skip
            if relabel:
                for x in range(i, j):
                    events[x] = before
        i = j


def block_labels(
    model: nn.Module, root: str, prefixes: dict[str, Label]
) -> tuple[dict[str, Label | None], dict[int, Label]]:
    """Labels of the model's modules (as the tracer names them: ``root.path``; None outside the blocks)
    and of the tensors inside the blocks whose paths are ``prefixes``' keys."""
    modules: dict[str, Label | None] = {f"{root}.{name}" if name else root: None for name, _ in model.named_modules()}
    tensors: dict[int, Label] = {}
    for prefix, label in prefixes.items():
        block = model.get_submodule(prefix)
        for name, module in block.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            modules[f"{root}.{full}"] = label
            for _, t in _tensors(module):
                tensors.setdefault(id(t), label)
                for held in parameter_attachments(t) if isinstance(t, nn.Parameter) else ():
                    tensors.setdefault(id(held), label)  # a quantised weight's scales and codes: the block's too
    return modules, tensors
