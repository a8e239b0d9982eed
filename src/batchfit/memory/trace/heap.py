"""The garbage collector's full collections, deferred while a step is traced or replayed.

A trace makes hundreds of thousands of short-lived Python objects (fake tensors, their metadata, the
events), so the cyclic garbage collector runs many times during it, and now and then a full
collection walks every object the process holds: with torch and transformers imported some 400,000
objects, 0.2 s on two cores, a quarter of a 70B model's estimate spent on objects that were alive
before the trace and will be after it. So while a trace or a replay runs, full collections wait (the
oldest generation's threshold is raised, and put back after): the young generations are collected as
ever, so the trace's own garbage cycles go as soon as before, and a tensor is freed when its last
reference goes; nothing the trace records depends on it. A full collection that came due meanwhile
runs at the next collection after it.

(Freezing the older objects instead, ``gc.freeze`` and ``gc.unfreeze``, makes a full collection in the
window cheap, but it then counts the long-lived objects as the few it walked, so that full collections
of every object follow one another after the window until one has counted them all again.)

A process that turned the collector off is left as it is. Python's incremental collector (3.14 on)
ignores the oldest generation's threshold and needs none of this.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["full_collections_deferred"]

F = TypeVar("F", bound=Callable[..., Any])

_NEVER = 2**31 - 1
"""A threshold the oldest generation's count does not reach."""


def full_collections_deferred(fn: F) -> F:
    """``fn`` runs with full collections deferred until it returns (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        young, middle, oldest = gc.get_threshold()
        gc.set_threshold(young, middle, _NEVER)
        try:
            return fn(*args, **kwargs)
        finally:
            gc.set_threshold(young, middle, oldest)

    return wrapper  # type: ignore[return-value]
