"""The fewest blocks a plan's micro-batch needs checkpointed, where checkpointing every block is more than it needs.

NOTE [ Checkpointing only what the micro-batch needs ]
The ladder turns activation checkpointing on for every block (``planning/ladder.py``); when that rung is
the plan, its micro-batch often fits with far fewer blocks recomputed, and each block not recomputed is
one block's forward less per micro-batch. Checkpointing the first k blocks (NOTE [ Checkpointing some
blocks ] in ``activation_checkpointing.py``) keeps k blocks' inputs instead of their activations, so a
step's memory falls by about one block's worth per block from k = 0 (nothing) to k = N (every block):
the two ends, estimated at the plan's micro-batch, give a first guess of the least k whose step fits,
and each look narrows the range where it lies (memory only falls as k grows) and guesses again from
the range's ends. Each of those steps costs a trace (written from a cut one: NOTE [ A stack some of whose
blocks are checkpointed ] in ``memory/synthesis/stackplan.py``), so the search looks at as few as it can:
two when the memory falls by the same amount per block. With ``selective``, the blocks after the first k
are checkpointed selectively instead of not at all (NOTE [ Some blocks whole, the rest selectively ]): k = 0
is every block selectively, and the least k is smaller, each block it spares recomputing only its cheap ops.

A plan has several such searches (two micro-batches, the other blocks kept or selective), and a step in
between costs a trace (seconds for a deep tensor-parallel rank), so ``fastest_first`` guesses
each search's k from its two ends alone, draws its time between the ends' times, and finishes the searches
fastest guess first, only while a guess beats the fastest found.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..activation_checkpointing import SELECTIVE, Checkpointing, apply_checkpointing, selected_blocks
from ..gpu.catalog import Device
from ..memory.cache import CACHE
from ..memory.estimate import Estimate, with_accumulation
from ..memory.trace.fake_step import fake_model
from ..workload import Setup, Workload
from .estimate import fit_estimate_at
from .search import FitAttempt, FitResult

__all__ = ["BlockSearch", "FewestBlocks", "block_count", "blocks_setting", "fastest_first", "fewest_blocks",
           "first_blocks_setting", "with_fewest_blocks"]


@dataclass(frozen=True)
class FewestBlocks:
    """The first ``blocks`` of ``of`` blocks checkpointed (with ``selective``, the others selectively): the least
    recompute whose step fits, its estimate."""

    blocks: int
    of: int
    estimate: Estimate
    selective: bool = False

    @property
    def setting(self) -> Checkpointing:
        """What ``checkpointing=`` takes for this step."""
        return blocks_setting(self.blocks, self.of, self.selective)

    def remedies(self, every_block: tuple[str, ...]) -> tuple[str, ...]:
        """A plan's remedies ``every_block`` (checkpointing every block among them) with these blocks named."""
        named = f"activation checkpointing of {self.blocks} of {self.of} blocks"
        if self.selective:
            named = (f"{named}, the rest selectively" if self.blocks else "selective activation checkpointing")
        return tuple(named if r == "activation checkpointing" else r for r in every_block)


def blocks_setting(k: int, of: int, selective: bool = False) -> Checkpointing:
    """``checkpointing=`` for the first ``k`` of ``of`` blocks checkpointed whole, with ``selective`` the others
    selectively (None: nothing checkpointed)."""
    return "blocks" if k >= of else first_blocks_setting(k, selective)


def first_blocks_setting(k: int, selective: bool = False) -> Checkpointing:
    """``checkpointing=`` for the first ``k`` blocks checkpointed whole, not every block, with ``selective`` the
    others selectively (None: nothing checkpointed)."""
    if selective:
        return (*range(k), SELECTIVE) if k else SELECTIVE
    return k or None


def block_count(wl: Workload) -> int:
    """How many blocks checkpointing numbers in ``wl``'s model (0: none to choose), counted by the call that numbers
    them in a step (``apply_checkpointing``, on a model built for it): a transformers model's own layers, each
    outermost block elsewhere."""
    classes = tuple(c for c in wl.checkpoint_blocks if selected_blocks((c,)) is None)

    def count() -> int:
        return apply_checkpointing(fake_model(wl), classes) if classes else 0

    return CACHE.fact("checkpointed blocks", wl, None, count)


def fewest_blocks(
    wl: Workload, dev: Device, setup: Setup, sharded: bool, gpus: int, micro: int, budget: int,
    announce: Callable[[str], None] | None = None, selective: bool = False,
) -> FewestBlocks | None:  # fmt: skip
    """The fewest first blocks of ``wl`` to checkpoint for one rank's step at ``micro`` items to fit ``budget``
    bytes (what the device shows), under ``setup`` otherwise (with ``selective``, the others selectively); None
    when that is every block (or, without ``selective``, none is needed), or the model has fewer than two
    blocks. See the NOTE above."""
    search = BlockSearch(wl, dev, setup, sharded, gpus, micro, budget, announce, selective)
    if search.of < 2:
        return None
    k = search.least()
    return FewestBlocks(k, search.of, search.at(k), selective) if _chosen(search, k) else None  # type: ignore[arg-type]


class BlockSearch:
    """The search for the least k of the model's N blocks whose step (the first k checkpointed; with ``selective``
    the others selectively) fits ``budget``, one rank's step at ``micro`` items; ``looked`` keeps every step it
    estimated, by k."""

    def __init__(
        self, wl: Workload, dev: Device, setup: Setup, sharded: bool, gpus: int, micro: int, budget: int,
        announce: Callable[[str], None] | None = None, selective: bool = False,
    ) -> None:  # fmt: skip
        self.wl, self.dev, self.setup, self.sharded, self.gpus = wl, dev, setup, sharded, gpus
        self.micro, self.budget, self.announce, self.selective = micro, budget, announce, selective
        self.of = block_count(wl)
        self.looked: dict[int, Estimate] = {}

    def at(self, k: int) -> Estimate:
        """The estimate with the first ``k`` blocks checkpointed (0: none, or every block selectively; N: every
        block)."""
        if k not in self.looked:
            n, micro = self.of, self.micro
            rest = ", the rest selectively" if self.selective else ""
            words = f"checkpointing {k} of {n} blocks{rest} at {micro} item{'s' if micro != 1 else ''}"
            say = self.announce
            announce = None if say is None else lambda: say(words)  # only when the step is traced, not kept
            ck = blocks_setting(k, n, self.selective)
            setup = dataclasses.replace(self.setup, checkpointing=ck)
            self.looked[k] = fit_estimate_at(self.wl, self.dev, setup, self.sharded, self.gpus, micro, announce)
        return self.looked[k]

    def fits(self, k: int) -> bool:
        return self.at(k).device_total_bytes <= self.budget

    def guess(self) -> int | None:
        """The least k that fits as the line through the two ends says, looking at no step in between (0: none,
        or every block selectively, fits; None: not even N fits, or no blocks to number)."""
        n = self.of
        if n == 0 or not self.fits(n):
            return None
        return 0 if self.fits(0) else min(n, max(1, self._on_the_line(0, n)))

    def _on_the_line(self, low: int, high: int) -> int:
        """Where the line through the steps at ``low`` and ``high`` blocks meets the budget (their middle where
        the memory does not fall between them)."""
        above, below = self.at(low).device_total_bytes, self.at(high).device_total_bytes
        step = (above - below) / (high - low)
        return low + math.ceil((above - self.budget) / step) if step > 0 else (low + high) // 2

    def least(self) -> int | None:
        """The least k that fits (0: no checkpointing needed, or every block selectively; N: every block), None:
        not even N fits, or the model has no blocks to number."""
        n = self.of
        if n == 0:
            return None
        if self.fits(0):
            return 0
        if not self.fits(n):
            return None
        # The least k that fits lies in (low, high]: k = 0 does not fit, k = n does. Each look is where the line
        # through the bracket's two ends meets the budget (the guess, then its neighbour when the line holds).
        low, high = 0, n
        while high - low > 1:
            probe = min(high - 1, max(low + 1, self._on_the_line(low, high)))
            low, high = (low, probe) if self.fits(probe) else (probe, high)
        return high


def fastest_first(
    searches: list[BlockSearch], seconds: Callable[[BlockSearch, int], float]
) -> list[tuple[BlockSearch, int]]:
    """Of ``searches`` (of one configuration: micro-batches, the other blocks kept or selective), the least k of
    each worth finding, as ``(search, k)``: k = 0 only where the other blocks are selective (k = 0 and k = N
    are no choice of blocks).

    Each search's least k is first guessed from its two ends (``BlockSearch.guess``: no step in between), and
    its time (``seconds(search, k)``, the configuration's predicted seconds per global batch) drawn between the
    two ends' times; the searches are then finished (a trace per step in between, seconds for a deep tensor-parallel
    rank) fastest guess first, while a guess is faster than the fastest found so far.
    """
    guessed = []
    for search in searches:
        k = search.guess()
        if _chosen(search, k):
            first, every = seconds(search, 0), seconds(search, search.of)
            guessed.append((first + (every - first) * k / search.of, search))  # type: ignore[operator]
    found: list[tuple[BlockSearch, int]] = []
    fastest = math.inf
    for predicted, search in sorted(guessed, key=lambda g: g[0]):
        if predicted >= fastest:
            break
        k = search.least()
        if _chosen(search, k):
            found.append((search, k))  # type: ignore[arg-type]
            fastest = min(fastest, seconds(search, k))  # type: ignore[arg-type]
    return found


def _chosen(search: BlockSearch, k: int | None) -> bool:
    """Whether ``k`` blocks whole is a choice of blocks: some, not every block (or none, the others selective)."""
    return k is not None and k < search.of and (k > 0 or search.selective)


def with_fewest_blocks(
    result: FitResult, wl: Workload, dev: Device, setup: Setup, shard_over: int,
    announce: Callable[[str], None] | None = None,
) -> FitResult:  # fmt: skip
    """``result``, a fit with every block checkpointed (``setup``), at the least recompute its answer needs: the
    fewest first blocks checkpointed whose step at the same batch (and sequence) still fits the same budget, or
    none at all (``fit(..., checkpointing="auto")``). The steps looked at join the attempts."""
    if result.max_seq_len is not None:
        wl = with_accumulation(wl.at_seq_len(result.max_seq_len), wl.accumulation_steps)
    search = BlockSearch(wl, dev, setup, shard_over > 1, shard_over, result.max_batch_size, result.capacity_bytes,
                         announce)  # fmt: skip
    k = search.least()
    if k is None or k == search.of:
        return result
    looked = [(j, e) for j, e in sorted(search.looked.items()) if j != search.of]
    attempts = tuple(
        FitAttempt(result.max_batch_size, e.device_total_bytes, e.device_total_bytes <= result.capacity_bytes,
                   "trace", seq_len=result.max_seq_len, checkpointed_blocks=j)
        for j, e in looked
    )  # fmt: skip
    return dataclasses.replace(
        result, estimate=search.at(k), checkpointing=k > 0, checkpointed_blocks=k or None,
        trials=result.trials + len(looked), attempts=result.attempts + attempts,
        expandable_max_batch_size=None,  # predicted for every block checkpointed
    )  # fmt: skip
