"""The fewest blocks a plan's micro-batch needs checkpointed, where checkpointing every block is more than it needs.

NOTE [ Checkpointing only what the micro-batch needs ]
The ladder turns activation checkpointing on for every block (``planning/ladder.py``); when that rung is
the plan, its micro-batch often fits with far fewer blocks recomputed, and each block not recomputed is
one block's forward less per micro-batch. Checkpointing the first k blocks (NOTE [ Checkpointing some
blocks ] in ``activation_checkpointing.py``) keeps k blocks' inputs instead of their activations, so a
step's memory falls by about one block's worth per block from k = 0 (nothing) to k = N (every block):
the two ends, estimated at the plan's micro-batch, give a first guess of the least k whose step fits,
and each look narrows the range where it lies (memory only falls as k grows) and guesses again from
the range's ends. Each of those steps is traced at full depth (a stack half checkpointed is not
periodic), so the search looks at as few as it can: two when the memory falls by the same amount per
block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..activation_checkpointing import checkpoint_blocks_of, selected_blocks
from ..gpu.catalog import Device
from ..memory.cache import CACHE
from ..memory.estimate import Estimate
from ..memory.trace.fake_step import fake_model
from ..workload import Setup, Workload
from .options import fit_estimate_at

__all__ = ["FewestBlocks", "block_count", "fewest_blocks"]


@dataclass(frozen=True)
class FewestBlocks:
    """The first ``blocks`` of ``of`` blocks checkpointed: the least recompute whose step fits, its estimate."""

    blocks: int
    of: int
    estimate: Estimate

    def remedies(self, every_block: tuple[str, ...]) -> tuple[str, ...]:
        """A plan's remedies ``every_block`` (checkpointing every block among them) with these blocks named."""
        named = f"activation checkpointing of {self.blocks} of {self.of} blocks"
        return tuple(named if r == "activation checkpointing" else r for r in every_block)


def block_count(wl: Workload) -> int:
    """How many blocks checkpointing numbers in ``wl``'s model (``checkpoint_blocks_of``; 0: none to choose)."""
    classes = tuple(c for c in wl.checkpoint_blocks if selected_blocks((c,)) is None)

    def count() -> int:
        return len(checkpoint_blocks_of(fake_model(wl), classes)) if classes else 0

    return CACHE.fact("checkpointed blocks", wl, None, count)


def fewest_blocks(
    wl: Workload, dev: Device, setup: Setup, sharded: bool, gpus: int, micro: int, budget: int,
    announce: Callable[[str], None] | None = None,
) -> FewestBlocks | None:  # fmt: skip
    """The fewest first blocks of ``wl`` to checkpoint for one rank's step at ``micro`` items to fit ``budget``
    bytes (what the device shows), under ``setup`` otherwise; None when that is every block (or none is needed,
    or the model has fewer than two blocks). See the NOTE above."""
    n = block_count(wl)
    if n < 2:
        return None
    seen: dict[int, Estimate] = {}

    def at(k: int) -> Estimate:
        if k not in seen:
            if announce is not None and 0 < k < n:
                announce(f"checkpointing {k} of {n} blocks at {micro} item{'s' if micro != 1 else ''}")
            ck = None if k == 0 else ("blocks" if k == n else k)
            seen[k] = fit_estimate_at(wl, dev, dataclasses.replace(setup, checkpointing=ck), sharded, gpus, micro)
        return seen[k]

    def fits(k: int) -> bool:
        return at(k).device_total_bytes <= budget

    if fits(0) or not fits(n):
        return None
    # The least k that fits lies in (low, high]: k = 0 does not fit, k = n does. Each look is where the line
    # through the bracket's two ends meets the budget (the guess, then its neighbour when the line holds).
    low, high = 0, n
    while high - low > 1:
        above, below = at(low).device_total_bytes, at(high).device_total_bytes
        step = (above - below) / (high - low)
        probe = low + math.ceil((above - budget) / step) if step > 0 else (low + high) // 2
        probe = min(high - 1, max(low + 1, probe))
        low, high = (low, probe) if fits(probe) else (probe, high)
    if high == n:
        return None
    return FewestBlocks(high, n, at(high))
