"""A deterministic global-batch sampler: the same items in global batch t, whatever the world size.

NOTE [ Which items a rank takes ]
Epoch ``e`` visits the dataset in the order ``torch.randperm(n, generator=seed + e)``. Global batch
``t`` of that epoch is the slice ``perm[t*G : (t+1)*G]`` — a fixed set of items that depends on the
seed, the epoch and ``t`` only. Rank ``r`` of ``W`` takes a contiguous part of it: ranks get
``G // W`` items, the first ``G % W`` ranks one more (``batching.rank_shares``), in rank order. A
checkpoint stores the position as (epoch, global batch index), so a run resumed on another number
of GPUs continues with exactly the global batches an uninterrupted run would have seen. The last
``n % G`` items of an epoch are dropped (a short last batch would change the maths of that step).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ..batching import rank_shares
from ..errors import ConfigError
from .distributed import rank, world_size


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's item indices for each global batch (use as a DataLoader ``batch_sampler``).

    Args:
        dataset_size: items in the map-style dataset.
        global_batch_size: items per optimizer step, over all ranks.
        rank, world_size: this process's place (``torch.distributed`` defaults when None).
        seed: the shuffle seed; ``shuffle=False`` visits items in order.

    Example:
        >>> s = GlobalBatchSampler(10, 4, rank=1, world_size=2, shuffle=False)
        >>> list(s)
        [[2, 3], [6, 7]]
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if rank is None or world_size is None:
            rank, world_size = _dist_place()
        if global_batch_size < 1:
            raise ConfigError(f"the global batch size must be >= 1, got {global_batch_size}")
        if world_size > global_batch_size:
            raise ConfigError(
                f"a global batch of {global_batch_size} cannot give each of {world_size} ranks an item; "
                f"use a global batch >= {world_size} or fewer processes"
            )
        if dataset_size < global_batch_size:
            raise ConfigError(
                f"the dataset has {dataset_size} items, fewer than one global batch of {global_batch_size}"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside the world of {world_size}")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.position = 0
        """Index of the next global batch within the epoch."""
        shares = rank_shares(global_batch_size, world_size)
        self._start = sum(shares[:rank])
        self._stop = self._start + shares[rank]

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch_size

    def global_batch(self, epoch: int, index: int) -> list[int]:
        """All item indices of global batch ``index`` of ``epoch`` (every rank's share, in rank order)."""
        order = self._order(epoch)
        g = self.global_batch_size
        return order[index * g : (index + 1) * g]

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_size, generator=gen).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order(self.epoch)
        g = self.global_batch_size
        while self.position < self.batches_per_epoch:
            t = self.position
            self.position += 1
            yield order[t * g + self._start : t * g + self._stop]
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.batches_per_epoch - self.position

    def state_dict(self) -> dict[str, Any]:
        """The position in global-batch units (independent of the world size)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "dataset_size": self.dataset_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a state from a different data order."""
        for key in ("seed", "shuffle", "global_batch_size", "dataset_size"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"the saved sampler has {key}={state[key]!r} but this run has {getattr(self, key)!r}; "
                    "resume with the same data and global batch size"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def _dist_place() -> tuple[int, int]:
    return rank(), world_size()
