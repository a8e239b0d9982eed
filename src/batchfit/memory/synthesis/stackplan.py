"""A model's stacks known before it is built on fake tensors, so that the blocks a cut drops are never built.

Building a deep model on fake tensors costs time per block (a 70B model's 80 layers take a few
tenths of a second), and the cut (``memory/synthesis/stacks.py``) then throws most of them away. So the model is
first built on the ``meta`` device, where building costs little, and its stacks found there; each
block's place in the order modules are constructed is noted. The fake build then constructs the blocks
the cut would drop as empty placeholders (the block class's ``__init__`` skipped for those), and the
cut removes them as it would have removed the real ones. The plan is kept per workload for the
process.

It is only a shortcut: the fake build is checked against the plan (a placeholder exactly where a
dropped block was, each kept block the same as on ``meta``), and a model whose construction does not
follow it (a constructor that reads its blocks' attributes, a meta build that fails) is built whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...activation_checkpointing import apply_checkpointing, selected_blocks
from ..cache import Uncacheable, workload_digest
from ..steps import default_dtype
from ..trace.construct import fake_construction
from .stacks import Stack, block_signatures, find_stacks

if TYPE_CHECKING:
    from ...workload import Workload

__all__ = ["CutPlan", "plan_cut", "plan_failed"]

_PLACEHOLDER = "_batchfit_placeholder"


@dataclass(frozen=True)
class CutPlan:
    """The stacks of a model as its meta build showed them, and which constructions to skip."""

    stacks: tuple[Stack, ...]
    reasons: tuple[str, ...]
    skip: tuple[tuple[type, frozenset[int]], ...]
    """Per block class: the ordinals (among its instances, in construction order) of dropped blocks."""
    kept: tuple[tuple[str, tuple[Any, ...]], ...]
    """Per container of stacks: its path and the signatures of the blocks the cut keeps
    (``stacks.block_signatures``)."""
    shape: tuple[Any, ...] = ()
    """Where some blocks are checkpointed, the cut model whichever of the full model's blocks it keeps: per container
    of stacks, the blocks the cut keeps (their signatures but for the settings that number a block's position) and
    how each is checkpointed, and where each stack's kept blocks sit in it; else empty. Two selections of
    checkpointed blocks whose cuts have one shape trace the same cut step (NOTE [ One cut step for neighbouring
    selections ] in ``memory/synthesis/depth.py``)."""

    @contextlib.contextmanager
    def skipping(self) -> Iterator[None]:
        """While building: the dropped blocks' classes construct those instances as empty modules."""
        saved = []
        for cls, ordinals in self.skip:
            own = cls.__dict__.get("__init__")
            saved.append((cls, own))
            cls.__init__ = _skipping_init(cls, cls.__init__, ordinals)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for cls, own in reversed(saved):
                if own is None:
                    del cls.__init__
                else:
                    cls.__init__ = own  # type: ignore[method-assign]

    def built_as_planned(self, model: nn.Module) -> bool:
        """Whether ``model`` holds placeholders exactly where dropped blocks are, and kept blocks as planned."""
        for path, signatures in self.kept:
            try:
                container = model.get_submodule(path) if path else model
            except AttributeError:
                return False
            blocks = list(container._modules.values())
            stacks = [st for st in self.stacks if st.path == path]
            if len(blocks) != stacks[0].size:
                return False
            dropped = _dropped(stacks)
            kept = [b for i, b in enumerate(blocks) if i not in dropped]
            if any(_is_placeholder(b) for b in kept) or not all(_is_placeholder(blocks[i]) for i in dropped):
                return False
            if block_signatures(kept) != signatures:
                return False
        return True


def _dropped(stacks: list[Stack]) -> set[int]:
    """Container indices of the blocks the cut of ``stacks`` (of one container) drops."""
    return {i for st in stacks for i in range(st.start + st.written_from, st.start + st.written_from + st.inserted)}


def _is_placeholder(module: Any) -> bool:
    return isinstance(module, nn.Module) and module.__dict__.get(_PLACEHOLDER, False)


def _skipping_init(cls: type, init: Any, ordinals: frozenset[int]) -> Any:
    count = [0]

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if type(self) is cls:
            n = count[0]
            count[0] += 1
            if n in ordinals:
                nn.Module.__init__(self)
                object.__setattr__(self, _PLACEHOLDER, True)
                return
        init(self, *args, **kwargs)

    return __init__


class _values_not_written(TorchFunctionMode):  # noqa: N801 - used as a context, like torch.device
    """Initialisers that write values into a ``meta`` tensor return it as it is: it has no values, so
    they would only cost the time of their decompositions (a third of a deep model's meta build)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _VALUE_WRITES:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


_VALUE_WRITES = frozenset(
    [getattr(torch.Tensor, name) for name in ("uniform_", "normal_", "zero_", "fill_", "erfinv_", "mul_", "add_",
                                              "clamp_", "copy_", "exponential_", "log_normal_", "bernoulli_",
                                              "random_", "fill_diagonal_") if hasattr(torch.Tensor, name)]
    + [getattr(torch.nn.init, name) for name in ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_",
                                                 "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_",
                                                 "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
       if hasattr(torch.nn.init, name)]
)  # fmt: skip
"""Tensor methods and ``torch.nn.init`` functions that change a tensor's values only (never its shape,
dtype or device) and return it."""


_PLANS: dict[tuple[str, str], CutPlan | None] = {}


def _key(workload: Workload, param_dtype: torch.dtype | None) -> tuple[str, str] | None:
    try:
        return workload_digest(workload, param_dtype), str(param_dtype)
    except Uncacheable:
        return None


def plan_failed(workload: Workload, param_dtype: torch.dtype | None, classes: tuple[type, ...] = ()) -> None:
    """The fake build did not go as planned: build ``workload``'s model whole from now on."""
    key = _key(workload, param_dtype)
    if key is not None:
        _PLANS[(*key, _selection(classes))] = None


def plan_cut(workload: Workload, param_dtype: torch.dtype | None, classes: tuple[type, ...] = ()) -> CutPlan | None:
    """The cut of ``workload``'s model, from a build on the ``meta`` device (None: no factory to build,
    or it cannot be built there); kept per workload (and selection of checkpointed blocks among ``classes``:
    NOTE [ A stack some of whose blocks are checkpointed ]) for the process."""
    if isinstance(workload.model, nn.Module):
        return None
    key = _key(workload, param_dtype)
    if key is not None:
        key = (*key, _selection(classes))
    if key is not None and key in _PLANS:
        return _PLANS[key]
    plan = _plan(workload, param_dtype, classes if selected_blocks(classes) is not None else ())
    if key is not None:
        _PLANS[key] = plan
    return plan


def _selection(classes: tuple[type, ...]) -> str:
    """What of ``classes`` changes the cut: the names of all of them where some blocks are selected (the plan then
    depends on which), else nothing."""
    return "" if selected_blocks(classes) is None else ",".join(f"{c.__module__}.{c.__qualname__}" for c in classes)


# NOTE [ A stack some of whose blocks are checkpointed ]
# ``checkpointing=k`` (or ``"k+selective"``, or indices) checkpoints the first k blocks whole and the others
# not at all (or selectively): one stack of like blocks becomes two runs, each periodic, and a cut that keeps
# blocks of both runs in its middle periods would write the wrong blocks. The blocks are numbered as
# ``apply_checkpointing`` numbers them, on the meta build (the same call, on a throwaway model), and each
# stack is split into its parts, in whole periods, whose blocks are checkpointed alike: every part long
# enough to cut is cut as a stack of its own (one container then holds two stacks, the later one's indices in
# the cut container shifted by what the earlier one's cut dropped: ``Stack.offset``), and the blocks of a part
# too short are traced as the blocks around a stack are. For the first 71 of a 80-layer model's blocks
# checkpointed and the other 9 selectively, the cut keeps 4 of the 71 and 4 of the 9; for the first 78, it
# keeps 4 of the 78 and traces the 2 after them. A stack with no part long enough is left uncut.
def _alike_parts(stack: Stack, marks: list[Any]) -> list[Stack]:
    """The parts of ``stack``'s repeating blocks, in whole periods, whose ``marks`` are equal and that are still
    worth cutting, in order (empty: none is)."""
    parts = []
    end, i = stack.start + stack.length, stack.start
    while i < end:
        j = i
        while j < end and marks[j] == marks[i]:
            j += 1
        first = stack.start + -(-(i - stack.start) // stack.period) * stack.period
        part = Stack(stack.path, stack.size, first, max(0, (j - first) // stack.period * stack.period), stack.period)
        if part.inserted >= stack.period:
            parts.append(dataclasses.replace(part, offset=sum(p.inserted for p in parts)))
        i = j
    return parts


def _checkpointed_alike(model: nn.Module, stacks: list[Stack], classes: tuple[type, ...], reasons: list[str],
                        marks: dict[str, list[Any]]) -> list[Stack]:  # fmt: skip
    """``stacks`` split into the parts of blocks ``classes`` checkpoint alike (NOTE above); a stack with no such
    part worth cutting is left out, and ``reasons`` says so. ``marks`` gets each container's blocks' marks (how
    each is checkpointed), by path."""
    whole: dict[int, bool] = {}
    apply_checkpointing(model, classes, whole)
    parts_of_all = []
    for stack in stacks:
        container = model.get_submodule(stack.path) if stack.path else model
        marks[stack.path] = [tuple(whole[id(m)] for m in block.modules() if id(m) in whole)
                             for block in container.children()]  # fmt: skip
        parts = _alike_parts(stack, marks[stack.path])
        if not parts:
            reasons.append(f"{stack.path or 'the model'}: its checkpointed blocks and the others make no run long "
                           f"enough to cut")  # fmt: skip
        parts_of_all.extend(parts)
    return parts_of_all


def _plan(workload: Workload, param_dtype: torch.dtype | None, classes: tuple[type, ...] = ()) -> CutPlan | None:
    order: dict[int, tuple[type, int]] = {}
    counts: dict[type, int] = {}
    original = nn.Module.__init__

    def counting_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if id(self) not in order:
            n = counts.get(type(self), 0)
            counts[type(self)] = n + 1
            order[id(self)] = (type(self), n)
        original(self, *args, **kwargs)

    nn.Module.__init__ = counting_init  # type: ignore[method-assign]
    try:
        with torch.device("meta"), default_dtype(param_dtype), fake_construction(fakes=False), _values_not_written(), \
                warnings.catch_warnings():  # fmt: skip
            warnings.simplefilter("ignore")
            model = workload.build_model()
    except Exception:  # noqa: BLE001 - a constructor meta refuses: the model is built whole on fake tensors
        return None
    finally:
        nn.Module.__init__ = original  # type: ignore[method-assign]
    stacks, reasons = find_stacks(model)
    built = {s.path: list((model.get_submodule(s.path) if s.path else model)._modules.values()) for s in stacks}
    signatures, unnumbered = {}, {}  # of the blocks as the fake build makes them: before checkpointing changes them
    marks: dict[str, list[Any]] = {}
    if classes:
        signatures = {path: block_signatures(blocks) for path, blocks in built.items()}
        unnumbered = {path: block_signatures(blocks, numbered=False) for path, blocks in built.items()}
        try:
            stacks = _checkpointed_alike(model, stacks, classes, reasons, marks)
        except Exception:  # noqa: BLE001 - a model meta cannot checkpoint: traced at full depth, as it was
            return None
    skip: dict[type, set[int]] = {}
    kept, shape = [], []
    for path in dict.fromkeys(st.path for st in stacks):  # each container once, in order
        blocks, dropped = built[path], _dropped([st for st in stacks if st.path == path])
        if path in marks:
            shape.append((path, tuple((sig, m) for i, (sig, m) in enumerate(zip(unnumbered[path], marks[path]))
                                      if i not in dropped)))  # fmt: skip
        for i in sorted(dropped):
            cls, n = order.get(id(blocks[i]), (None, -1))
            if cls is not type(blocks[i]):
                return None
            skip.setdefault(cls, set()).add(n)
        if path in signatures:
            kept.append((path, tuple(sig for i, sig in enumerate(signatures[path]) if i not in dropped)))
        else:
            kept.append((path, block_signatures([b for i, b in enumerate(blocks) if i not in dropped])))
    if shape:
        shape.append(tuple((st.path, st.cut_start, st.kept, st.period) for st in stacks))
    return CutPlan(tuple(stacks), tuple(reasons), tuple((c, frozenset(n)) for c, n in skip.items()), tuple(kept),
                   tuple(shape))  # fmt: skip
