"""A model's stacks of repeated blocks, and the same model cut to a few blocks of each.

A stack is a ``ModuleList`` or ``Sequential`` (numbered ``0..N-1``) holding a run of modules of one
class whose parameters, buffers, tensor attributes and settings repeat with a period: equal in every
block (period 1), or alternating (local/global attention, a dense and a mixture-of-experts layer every
other block: period 2). A block's own index, and any integer attribute that grows by one from block
to block with it (``layer_idx``), is not a setting. The run may leave out blocks at either end that
differ (T5's first block, which alone holds the relative-position table). ``cut_stacks`` keeps the
first three periods of each run, its last period and the blocks around it, renumbered as ``ModuleList``
renumbers after a deletion, so that the model's own code indexes and iterates the shorter container as
usual (the kept blocks keep their settings, ``layer_idx`` included: the last block is the last); a block
that was cut away raises if anything still calls it. What the cut model's trace says about the full
model is ``memory/synthesis/depth.py``'s business.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["BlockCalledAfterCut", "Stack", "block_signatures", "cut_stacks", "find_stacks", "synthesis_enabled"]

_SIMPLE = (int, float, bool, str, type(None))
_MIN_CANDIDATE = 3
"""Blocks a container needs before it is looked at as a stack at all."""
KEPT_PERIODS = 4
"""Periods of a stack the cut keeps: the first and the last (which may differ, being at the ends of the
stack) and the two after the first, which must repeat exactly (``memory/synthesis/sweeps.py``): consecutive, so
that a forward that depends on a block's index with a period of its own shows it."""


def synthesis_enabled() -> bool:
    """Whether deep models are traced cut and written at full depth (``memory/synthesis/depth.py``):
    ``BATCHFIT_DEPTH_SYNTHESIS``, on unless ``0``."""
    return os.environ.get("BATCHFIT_DEPTH_SYNTHESIS", "1").strip().lower() not in ("0", "false", "no", "off")


class BlockCalledAfterCut(RuntimeError):
    """A block removed from its container ran: the model reaches its blocks some other way."""


@dataclass(frozen=True)
class Stack:
    """One stack: where it is, which of its blocks repeat, and what the cut keeps."""

    path: str
    """The container's name in the model (``model.layers``; ``""`` for the model itself)."""
    size: int
    """Blocks in the container."""
    start: int
    """Index of the first repeating block."""
    length: int
    """Repeating blocks (a multiple of ``period``)."""
    period: int
    offset: int = 0
    """Blocks the cut drops before this stack in its container: another stack's, where one container holds two
    runs cut apart (NOTE [ A stack some of whose blocks are checkpointed ] in ``memory/synthesis/stackplan.py``)."""

    @property
    def cut_start(self) -> int:
        """Index of the first repeating block in the cut container."""
        return self.start - self.offset

    @property
    def kept(self) -> int:
        """Repeating blocks the cut keeps: the first three periods and the last."""
        return KEPT_PERIODS * self.period

    @property
    def inserted(self) -> int:
        """Blocks written into the trace beyond those traced (between the third period and the last)."""
        return self.length - self.kept

    @property
    def written_from(self) -> int:
        """Index, among the repeating blocks, of the first block written rather than traced."""
        return (KEPT_PERIODS - 1) * self.period

    def full_of(self, kept: int) -> int:
        """Index, among the full stack's repeating blocks, of the cut stack's repeating block ``kept``."""
        return kept if kept < self.written_from else kept + self.inserted

    def kept_of(self, full: int) -> int | None:
        """The cut stack's repeating block that is the full stack's ``full`` (None: a written one)."""
        if full < self.written_from:
            return full
        return full - self.inserted if full >= self.written_from + self.inserted else None

    def seen_from_outside(self, kept: int) -> int:
        """The full stack's block that the cut stack's repeating block ``kept`` is to the model's other
        parts: the first two periods counted from the start, the others from the end (after the
        blocks, the head reads the last block's output and the one before it)."""
        return kept if kept < 2 * self.period else kept + self.inserted

    def inserted_before(self, shallow: int) -> int:
        """Blocks this stack's cut dropped before the cut container's block ``shallow`` as the model's other
        parts see it (``seen_from_outside``; the blocks after the repeating ones too)."""
        return self.inserted if shallow >= self.cut_start + 2 * self.period else 0


def _read(module: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """A module's own tensors (parameters, buffers, plain tensor attributes) and its settings (simple
    public attributes): one pass over its attributes."""
    found = [(k, t) for k, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
    settings = {}
    for k, v in vars(module).items():
        if k.startswith("_") or k == "training":
            continue
        if isinstance(v, torch.Tensor):
            if not isinstance(v, nn.Parameter):
                found.append((k, v))
        elif isinstance(v, _SIMPLE) or (isinstance(v, tuple) and all(isinstance(x, _SIMPLE) for x in v)):
            settings[k] = v
    return found, settings


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return _read(module)[0]


def _raw_signature(
    block: nn.Module, read: dict[int, Any] | None = None
) -> tuple[list[Any], dict[tuple[str, str], Any], list[int], bool]:
    """Structure, settings by (submodule, name), ids of its tensors, and whether any is uninitialised
    (``read``: ``_read`` of the modules, by id, where the caller has it)."""
    from torch.nn.parameter import is_lazy

    rows: list[Any] = []
    settings: dict[tuple[str, str], Any] = {}
    ids: list[int] = []
    lazy = False
    for name, module in block.named_modules(remove_duplicate=False):
        own, simple = read[id(module)] if read is not None else _read(module)
        tensors = []
        for key, t in own:
            lazy = lazy or is_lazy(t)
            ids.append(id(t))
            tensors.append((key, () if is_lazy(t) else tuple(t.shape), t.dtype, t.requires_grad, t.layout))
        hooks = (len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks))
        rows.append((name, type(module), tuple(tensors), hooks))
        for key, value in simple.items():
            settings[(name, key)] = value
    return rows, settings, ids, lazy


def block_signatures(blocks: list[nn.Module], numbered: bool = True) -> tuple[Any, ...]:
    """What a block's trace depends on that its construction decides: its classes, tensors' layouts,
    hooks and settings (its index included; with ``numbered`` False, without the settings that number the
    blocks' positions, ``layer_idx``), block by block."""
    raw = [_raw_signature(block) for block in blocks]
    index_like = set() if numbered else _index_like([settings for _, settings, _, _ in raw])
    return tuple((type(block), tuple(rows), tuple(sorted(((k, v) for k, v in settings.items() if k not in index_like),
                                                         key=repr)))
                 for block, (rows, settings, _, _) in zip(blocks, raw))  # fmt: skip


def _index_like(settings: list[dict[tuple[str, str], Any]]) -> set[tuple[str, str]]:
    """Integer settings that grow by one from block to block (``layer_idx``): a block's position."""
    out = set()
    for key in set().union(*settings):
        values = [s.get(key) for s in settings]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            if len({v - i for i, v in enumerate(values)}) == 1 and len(values) > 1:
                out.add(key)
    return out


def _period_run(sigs: list[Any], period: int) -> tuple[int, int]:
    """The longest ``[start, end)`` whose signatures repeat with ``period`` (``end - start`` a multiple of it)."""
    best = (0, 0)
    i = period
    while i < len(sigs):
        if sigs[i] != sigs[i - period]:
            i += 1
            continue
        j = i
        while j < len(sigs) and sigs[j] == sigs[j - period]:
            j += 1
        start = i - period
        end = start + (j - start) // period * period
        if end - start > best[1] - best[0]:
            best = (start, end)
        i = j
    return best


def _numbered(container: nn.Module) -> list[nn.Module] | None:
    keys = list(container._modules)
    if keys != [str(i) for i in range(len(keys))] or any(m is None for m in container._modules.values()):
        return None
    return list(container._modules.values())  # type: ignore[arg-type]


def find_stacks(model: nn.Module) -> tuple[list[Stack], list[str]]:
    """The stacks worth cutting (outermost first, none inside another's block), and why a container of
    like blocks that holds most of the model's parameters is not one.
    """
    stacks: list[Stack] = []
    reasons: list[str] = []
    inside: list[str] = []  # block prefixes of stacks found: containers under them are left alone
    owners: dict[int, int] = {}
    read: dict[int, Any] = {}
    for _, module in model.named_modules(remove_duplicate=False):  # a module held twice counts twice
        if id(module) not in read:
            read[id(module)] = _read(module)
        for _, t in read[id(module)][0]:
            owners[id(t)] = owners.get(id(t), 0) + 1
    total = _elements(model)
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        if any(path == p or path.startswith(p + ".") for p in inside):
            continue
        blocks = _numbered(container)
        if blocks is None or len(blocks) < _MIN_CANDIDATE or len({type(b) for b in blocks}) > 1:
            continue
        where = path or type(model).__name__
        stack, reason = _stack_of(path, blocks, owners, read)
        if stack is None:
            if 2 * _elements(container) >= total:  # most of the model: where a cut would have paid
                reasons.append(f"{where}: {reason}")
            continue
        stacks.append(stack)
        inside.extend(f"{path}.{i}" if path else str(i) for i in range(len(blocks)))
    return stacks, reasons


def _elements(module: nn.Module) -> int:
    from torch.nn.parameter import is_lazy

    return sum(p.numel() for p in module.parameters() if not is_lazy(p))


def _stack_of(path: str, blocks: list[nn.Module], owners: dict[int, int],
              read: dict[int, Any]) -> tuple[Stack | None, str]:  # fmt: skip
    raw = [_raw_signature(b, read) for b in blocks]
    if any(lazy for *_, lazy in raw):
        return None, "its blocks have uninitialised (lazy) parameters"
    index_like = _index_like([settings for _, settings, _, _ in raw])
    sigs = []
    for block, (rows, settings, ids, _) in zip(blocks, raw):
        kept = tuple(sorted((k, v) for k, v in settings.items() if k not in index_like))
        # A tensor held twice within a block is fine; one shared with another block or the rest is not.
        seen: dict[int, int] = {}
        for i in ids:
            seen[i] = seen.get(i, 0) + 1
        shared = any(owners.get(i, 0) > n for i, n in seen.items())
        sigs.append((type(block), tuple(rows), kept, shared))
    best: Stack | None = None
    numbered: dict[Any, int] = {}
    kinds = [numbered.setdefault(sig, len(numbered)) for sig in sigs]  # equal signatures, equal numbers
    for period in range(1, len(blocks) // (KEPT_PERIODS + 1) + 1):
        start, end = _period_run(kinds, period)
        if any(sigs[i][3] for i in range(start, end)):
            continue
        stack = Stack(path, len(blocks), start, end - start, period)
        if stack.inserted >= period and (best is None or stack.inserted > best.inserted):
            best = stack
    if best is None:
        if any(s[3] for s in sigs):
            return None, "its blocks share parameters or buffers"
        return None, (f"no run of its blocks repeats {KEPT_PERIODS + 1} times or more with equal shapes and "
                      "settings")  # fmt: skip
    return best, ""


def _guard(module: nn.Module, args: Any) -> None:
    raise BlockCalledAfterCut(f"{type(module).__name__} was cut from its container but still ran")


def cut_stacks(model: nn.Module, stacks: list[Stack]) -> list[nn.Module]:
    """Keep the first three and the last period of each stack's repeating blocks (and the blocks around
    them); returns the blocks cut away, each of which now raises ``BlockCalledAfterCut`` when called."""
    dropped: list[nn.Module] = []
    for stack in sorted(stacks, key=lambda st: -st.start):  # a container's later stack first: indices stay full
        container = model.get_submodule(stack.path) if stack.path else model
        blocks = list(container._modules.values())
        cut = stack.start + stack.written_from
        gone = blocks[cut : cut + stack.inserted]
        container._modules.clear()
        for i, block in enumerate(blocks[:cut] + blocks[cut + stack.inserted :]):
            container._modules[str(i)] = block
        for block in gone:
            block.register_forward_pre_hook(_guard)  # type: ignore[union-attr]
        dropped.extend(gone)  # type: ignore[arg-type]
    return dropped
