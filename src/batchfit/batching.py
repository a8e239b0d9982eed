"""Batches: a tensor, a tuple/list or a dict (nested) whose tensors share the leading batch dimension.

The estimator, the fitter and the trainer all need the same three things of a batch: how many items
it holds, a slice of it, and its tensors. They live here so that every stage agrees on what an item is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .errors import ConfigError

Batch = Any  # torch.Tensor | tuple | list | dict, nested


def check_batch_size(batch_size: Any, what: str = "batch size") -> int:
    """An int >= 1 (a batch size, a count of micro-batches or GPUs), or one clear error naming the fix."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"{what} must be a whole number >= 1, got {batch_size!r}")
    return batch_size


def iter_tensors(batch: Batch) -> Iterator[torch.Tensor]:
    """Every tensor in ``batch``, depth first, in a stable order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from iter_tensors(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from iter_tensors(value)


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """The same structure with ``fn`` applied to every tensor (other leaves are kept as they are)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, map_tensors(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def batch_size_of(batch: Batch) -> int:
    """The leading dimension shared by every tensor of ``batch``.

    Raises:
        ConfigError: the batch holds no tensor, a 0-d tensor, or tensors that disagree.
    """
    sizes = set()
    for t in iter_tensors(batch):
        if t.dim() == 0:
            raise ConfigError(
                "a batch tensor has no leading batch dimension (0-d); give every tensor shape (batch, ...)"
            )
        sizes.add(int(t.shape[0]))
    if not sizes:
        raise ConfigError("the batch holds no tensor; return a tensor, a tuple/list or a dict of tensors")
    if len(sizes) > 1:
        raise ConfigError(
            f"batch tensors disagree on the leading (batch) dimension: {sorted(sizes)}; "
            "every tensor must have the same number of items first"
        )
    return sizes.pop()


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Items ``start:stop`` of every tensor (a view: no copy)."""
    return map_tensors(batch, lambda t: t[start:stop])


def split_batch(batch: Batch, sizes: Sequence[int]) -> list[Batch]:
    """Consecutive pieces of ``batch`` of the given sizes, which must add up to its size exactly."""
    total = batch_size_of(batch)
    if sum(sizes) != total or any(s <= 0 for s in sizes):
        raise ConfigError(f"cannot split a batch of {total} items into {list(sizes)}; the sizes must sum to {total}")
    pieces, start = [], 0
    for s in sizes:
        pieces.append(slice_batch(batch, start, start + s))
        start += s
    return pieces


# -- how a global batch is divided: ranks, then micro-batches -----------------------------------------
def rank_shares(global_batch_size: int, gpus: int) -> list[int]:
    """Items per rank: as equal as possible, the first ``G % gpus`` ranks taking one more."""
    q, r = divmod(global_batch_size, gpus)
    return [q + 1 if i < r else q for i in range(gpus)]


def split_share(share: int, max_micro: int) -> list[int]:
    """Micro-batch sizes for one rank's share: fewest micro-batches, equal when that is possible.

    With ``k = ceil(share / max_micro)`` micro-batches (the fewest that fit), the pieces are equal when
    ``k`` divides the share, and otherwise differ by one item, larger first (10 items with 4 at most
    give ``[4, 3, 3]``, not ``[4, 4, 2]``: no sliver, and a piece that is too big fails first). Uneven
    pieces cost nothing in exactness (the trainer weights by counts) and beat an equal split with more
    steps in throughput.
    """
    if share <= 0:
        return []
    k = -(-share // max_micro)
    q, r = divmod(share, k)
    return [q + 1 if i < r else q for i in range(k)]


def make_splits(global_batch_size: int, gpus: int, max_micro: int, *, same_count: bool = False) -> list[list[int]]:
    """Every rank's micro-batch sizes for one optimizer step.

    With ``same_count`` (FSDP: every micro-batch's forward and backward are collectives, so ranks must
    run as many micro-batches as each other) every rank splits its share into the busiest rank's
    number of pieces. A share with fewer items than that (only possible with one item per micro-batch)
    ends with *padding*: pieces of 0 items, which the trainer runs on a copy of a real item with a
    gradient weight of exactly zero, so that the rank joins every collective and the sum is unchanged.
    """
    shares = rank_shares(global_batch_size, gpus)
    splits = [split_share(s, max_micro) for s in shares]
    if same_count:
        k = max(len(s) for s in splits)
        splits = [[share // k + 1 if i < share % k else share // k for i in range(k)] for share in shares]
    return splits
