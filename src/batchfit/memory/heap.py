"""The garbage collector's view of the process while a step is traced or replayed.

A trace makes hundreds of thousands of short-lived Python objects (fake tensors, their metadata, the
events), so the cyclic garbage collector runs many times during it, and now and then a full
collection walks every object the process holds: with torch and transformers imported some 400,000
objects, 0.2 s on two cores, a fifth of a 70B model's estimate spent on objects that were alive
before the trace and will be after it. So while a trace or a replay runs, the objects that existed
before it are frozen (``gc.freeze``, which moves them out of the collected generations in constant
time, and ``gc.unfreeze`` back into the oldest one): collections walk only what the trace made, and a
garbage cycle among the older objects waits until it ends. Nothing the trace records depends on it:
a tensor is freed when its last reference goes, and the trace's own cycles are collected as before.

A process that froze objects itself (a server after preloading its models, a test suite) is left as
it is, as is one that turned the collector off: unfreezing would thaw its objects too.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["older_objects_frozen"]

F = TypeVar("F", bound=Callable[..., Any])


def older_objects_frozen(fn: F) -> F:
    """``fn`` runs with the objects that existed before the call frozen (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if gc.get_freeze_count() or not gc.isenabled():  # the process's own freeze, or ours further out
            return fn(*args, **kwargs)
        gc.freeze()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.unfreeze()

    return wrapper  # type: ignore[return-value]
