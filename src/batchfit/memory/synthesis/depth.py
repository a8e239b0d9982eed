"""A deep model's trace written from a trace of the same step with its stacks cut to four periods.

NOTE [ Depth synthesis ]
A trace costs time in proportion to the model's depth, and most models repeat one block N times: the
same ops on the same shapes, the same parameter, gradient and optimizer-state storages, the same
activations kept for backward. So the step is traced with every stack (``memory/synthesis/stacks.py``) cut to
four periods of its repeating blocks (four blocks, or eight where layers alternate in pairs: the first
three periods and the last), each event labelled with the block it belongs to
(``memory/synthesis/blocklabels.py``), read (``memory/synthesis/sweeps.py``) and written at full depth
(``memory/synthesis/fulldepth.py``):
wherever the cut step sweeps over the blocks (a forward, a backward in reverse, the parameters'
registration, each of the optimizer's loops, ``zero_grad``), the missing blocks' events are written
between the third period and the last, each block's as the two middle periods' are, with fresh
storages; a storage a block frees of another block is that block's neighbour at the same distance.
The allocator model then replays it as any trace: nothing downstream knows.

What it assumes, and checks on the cut trace before it is used:

* the blocks between the ends repeat: the events of the two middle periods' blocks (consecutive blocks
  of the model) are equal, phase by phase, up to storage identity (sizes, roles, ops, modules, rows,
  gradient hand-overs, FLOPs, notes), but for what each reads of the end next to it; the ends (the
  first and the last period) may differ, and are kept as they are;
* every event of a sweep belongs to one block's turn, in order, with nothing of the other parts between
  two blocks but the loop's own work, alike between every two of them and without floating-point work
  (a layer-drop draw before each block, freeing the one before it), which is written with the block
  after it; an op outside the blocks never computes one tensor from several of them (a loss over
  every layer's router logits has the depth in its size);
* the forward does not depend on a block's index other than by a period (which the two consecutive
  middle periods show), on the number of blocks, or on one block in the middle of the stack being
  special; the model reaches its blocks through their container (a block cut away raises if called).

A trace that fails a check, or a step that fails cut, is traced at full depth and the estimate's notes
say why; so is a model whose container of like blocks, holding most of its parameters, is not a stack
(blocks that differ in shape, share parameters, or are uninitialised). ``tests/test_depth.py`` compares
the written traces with real full-depth ones, event for event, across the zoo.
``BATCHFIT_DEPTH_SYNTHESIS=0`` turns it off.

A trace does not depend on what the process ran before: TorchScript functions, whose executor runs a
function's first call through another plan than the later ones, are traced through the same plan on
every call (``memory/trace/construct.py``), so a stack's first block is traced as the others are.

On the CPU the trace measures real kernels' scratch per op signature (``memory/kernels/cpu_probe.py``); the blocks
a trace leaves out run the signatures of those it keeps, so the written trace is the CPU's as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from ...activation_checkpointing import selected_blocks
from ...errors import first_line
from ..cache import CACHE
from ..trace.tracer import MemoryTrace
from .blocklabels import BlockRecorder, block_labels
from .fulldepth import write_full_depth
from .stackplan import CutPlan, plan_cut, plan_failed
from .stacks import BlockCalledAfterCut, Stack, cut_stacks, find_stacks, synthesis_enabled
from .sweeps import Irregular

if TYPE_CHECKING:
    from ...workload import Workload

__all__ = ["STATS", "DepthCut", "synthesis_enabled", "trace_deep"]


@dataclass
class DepthStats:
    """What the traces of this process did (for benchmarks and curiosity)."""

    blocks_traced: int = 0
    """Repeating blocks that ran in traced steps."""
    blocks_written: int = 0
    """Repeating blocks the traces stand for (traced + written)."""
    traces_written: int = 0
    """Traces written at full depth from a cut one."""
    full_depth: list[str] = field(default_factory=list)
    """Why a trace that could have been cut was traced at full depth."""


STATS = DepthStats()


class DepthCut:
    """The cut of one traced model: its stacks, and the recorder that labels its trace's events.

    ``trace_workload`` calls ``prepare`` before it builds the model (the stacks known from a build on
    the ``meta`` device: ``memory/synthesis/stackplan.py``), builds it inside ``building()`` (the blocks the cut
    drops built empty), and calls ``apply`` on the built model before it makes the optimizer; when a
    stack was cut, ``recorder`` is the ``BlockRecorder`` to give the ``Tracer``.
    """

    def __init__(self) -> None:
        self.stacks: list[Stack] = []
        self.reasons: list[str] = []
        self.recorder: Any = None
        self.root = ""
        self.plan: Any = None
        self.classes: tuple[type, ...] = ()
        self.declined = False

    def prepare(self, workload: Workload, param_dtype: Any, classes: tuple[type, ...] = ()) -> None:
        """Know the model's stacks before it is built, where a build on ``meta`` shows them (each split into the
        runs of blocks ``classes`` checkpoint alike where some blocks are selected: NOTE [ A stack some of whose blocks
        are checkpointed ] in ``memory/synthesis/stackplan.py``, which needs that build)."""
        self.classes = classes
        self.plan = plan_cut(workload, param_dtype, classes)
        if self.plan is None and selected_blocks(classes) is not None:
            self.decline("some blocks are checkpointed, not all, and the model cannot be built on meta to find "
                         "which of its blocks are alike")  # fmt: skip

    def decline(self, reason: str) -> None:
        """No cut for this step: it is traced at full depth, and its estimate says ``reason``."""
        self.plan = None
        self.declined = True
        self.reasons.append(reason)

    def building(self) -> contextlib.AbstractContextManager:
        """The context to build the model in: the dropped blocks constructed empty, as planned."""
        return self.plan.skipping() if self.plan is not None else contextlib.nullcontext()

    def built_as_planned(self, model: nn.Module) -> bool:
        """Whether the model built in ``building()`` is as planned (else: build it again, whole)."""
        return self.plan is None or self.plan.built_as_planned(model)

    def plan_failed(self, workload: Workload, param_dtype: Any) -> None:
        """The build did not go as planned: build this workload's model whole, now and from now on."""
        self.plan = None
        plan_failed(workload, param_dtype, self.classes)
        if selected_blocks(self.classes) is not None:
            self.decline("some blocks are checkpointed, not all, and the model was not built as planned")

    def apply(self, model: nn.Module) -> None:
        """Find ``model``'s stacks (or take the plan's) and cut each to four periods of its blocks."""
        if self.declined:
            return
        if self.plan is not None:
            self.stacks, self.reasons = list(self.plan.stacks), list(self.plan.reasons)
        else:
            self.stacks, self.reasons = find_stacks(model)
        if not self.stacks:
            return
        cut_stacks(model, self.stacks)
        self.root = type(model).__name__
        prefixes = {}
        for s, stack in enumerate(self.stacks):
            for b in range(stack.kept):
                index = stack.cut_start + b
                prefixes[f"{stack.path}.{index}" if stack.path else str(index)] = (s, b)
        modules, tensors = block_labels(model, self.root, prefixes)
        self.recorder = BlockRecorder(modules, tensors)


# NOTE [ One cut step for neighbouring selections ]
# A search for the fewest blocks to checkpoint (``planning/partial.py``) traces the step with the first k of N
# blocks checkpointed whole for several k: at k = 72 and 71 of 80, say, each cut (NOTE [ A stack some of whose
# blocks are checkpointed ]) keeps four blocks of the checkpointed run and four of the rest, renumbered 0 to 7 in
# the cut container. The two cut models are the same model: the same blocks (up to the settings that number a
# block's position, which the cut step's checks already assume change nothing), checkpointed alike, in the same
# places; only the runs' lengths differ, which the cut step does not see and the writer takes from the stacks. So
# the cut step of one selection is kept (with its labels) in the trace cache's memory, under its ``CutPlan.shape``
# and the rest of the step's trace key, and a selection of the same shape is written from it with its own stacks,
# untraced: a second probe of the search costs a write, not a trace (seconds for a deep tensor-parallel rank).
# ``tests/test_partial_checkpointing.py`` compares such a trace with the one its own cut step writes.
def trace_deep(
    trace: Callable[[DepthCut | None], MemoryTrace], alike: tuple[str, CutPlan] | None = None
) -> MemoryTrace:
    """The full-depth trace of a step: ``trace(cut)`` traces it cut (``cut.apply`` on the model) and it
    is written at full depth, or ``trace(None)`` traces it as it is (see the NOTE). ``alike``: the key of the cut
    step among steps that differ only in which blocks are checkpointed, and the step's planned cut (NOTE above)."""
    if not synthesis_enabled():
        return trace(None)
    kept = CACHE.recall(alike[0]) if alike is not None else None
    if kept is not None:
        shallow, labels, root = kept
        plan = alike[1]  # type: ignore[index]
        try:
            return _written(shallow, labels, list(plan.stacks), root, list(plan.reasons))
        except Exception:  # noqa: BLE001 - not as the kept one was: this selection's own cut step below
            pass
    cut = DepthCut()
    try:
        shallow = trace(cut)
    except Exception as e:  # noqa: BLE001 - a cut step that fails is traced whole (which raises if it must)
        if not cut.stacks:
            raise
        reason = f"the step failed with its stacks cut ({_why(e)})"
        return _full_depth(trace, reason)
    if not cut.stacks:
        for reason in cut.reasons:
            shallow.notes.append(f"traced at full depth (no depth synthesis): {reason}")
        return shallow
    try:
        labels = cut.recorder.labels(shallow)
        if labels.mixed:
            raise Irregular(labels.mixed)
        full = _written(shallow, labels, cut.stacks, cut.root, cut.reasons)
    except Irregular as e:
        return _full_depth(trace, str(e))
    except Exception as e:  # noqa: BLE001 - writing the full depth failed: the step is traced whole instead
        return _full_depth(trace, f"writing the full depth failed ({_why(e)})")
    STATS.blocks_traced += sum(s.kept for s in cut.stacks)
    if alike is not None and cut.stacks == list(alike[1].stacks):  # cut as planned: its shape is the plan's
        CACHE.keep(alike[0], (shallow, labels, cut.root))
    return full


def _written(shallow: MemoryTrace, labels: Any, stacks: list[Stack], root: str, reasons: list[str]) -> MemoryTrace:
    """The full-depth trace written from the cut step ``shallow`` for ``stacks``, its notes saying ``reasons``."""
    full = write_full_depth(shallow, labels, stacks, root)
    STATS.blocks_written += sum(s.length for s in stacks)
    STATS.traces_written += 1
    full.notes.extend(f"traced at full depth (no depth synthesis): {r}" for r in reasons)
    return full


def _why(e: Exception) -> str:
    if isinstance(e.__cause__, BlockCalledAfterCut):
        e = e.__cause__
    return f"{type(e).__name__}: {first_line(e)}"


def _full_depth(trace: Callable[[DepthCut | None], MemoryTrace], reason: str) -> MemoryTrace:
    STATS.full_depth.append(reason)
    full = trace(None)
    full.notes.append(f"traced at full depth (no depth synthesis): {reason}")
    return full
