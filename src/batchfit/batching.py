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
