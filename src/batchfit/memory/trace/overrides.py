"""Kernels batchfit adds to PyTorch's dispatcher for its traces, registered once per process.

A trace needs a few kernels of its own: a meta kernel more permissive than torch's
(``memory/trace/compat.py``), CUDA's autocast policy on the CPU (``memory/kernels/cuda.py``). Registering a Python
kernel and destroying it again around every trace churns the dispatcher's tables, which is neither
cheap nor safe across thousands of traces in one process. Each override is therefore registered the
first time it is needed and stays registered; it acts only while its switch is on (``enabled``), and
otherwise calls ``fallback``, which does what the dispatcher did without it.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

_LIBRARY: Any = None
_REGISTERED: set[tuple[str, str]] = set()
_ON: dict[str, int] = {}


def register(switch: str, qualified: str, dispatch_key: str, kernel: Callable, fallback: Callable) -> None:
    """Register ``kernel`` for ``aten::qualified`` at ``dispatch_key``, acting while ``switch`` is on.

    Idempotent: a second call for the same op and key does nothing.
    """
    global _LIBRARY
    if (qualified, dispatch_key) in _REGISTERED:
        return
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("aten", "IMPL")

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return (kernel if _ON.get(switch) else fallback)(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        _impl(_LIBRARY, qualified, dispatch, dispatch_key)
    _REGISTERED.add((qualified, dispatch_key))


def _impl(library: Any, qualified: str, kernel: Callable, dispatch_key: str) -> None:
    """``library.impl`` over a kernel torch itself registered from Python, on any torch.

    torch's own meta kernels are Python registrations (``_meta_registrations.py``), and a ``Library.impl``
    without an ``allow_override`` that defaults to True refuses a second Python registration for the same
    op and key ("there's already a kernel registered from python": every trace failed so on torch 2.11,
    which registers ``_grouped_mm``'s meta kernel from Python). The dispatcher itself overrides with a
    warning; only the Python bookkeeping (``torch.library._impls``) refused. ``fallback`` calls torch's
    kernel directly, so nothing is lost by taking its place.
    """
    if "allow_override" in inspect.signature(library.impl).parameters:
        library.impl(qualified, kernel, dispatch_key, allow_override=True)
        return
    impls = getattr(torch.library, "_impls", None)
    key = f"{library.ns}/{qualified.split('::')[-1]}/{dispatch_key}"
    if isinstance(impls, set):
        impls.discard(key)  # impl adds it back
    library.impl(qualified, kernel, dispatch_key)


def registered(qualified: str, dispatch_key: str) -> bool:
    """Whether batchfit registered a kernel for this op and key (so a probe of the dispatcher for the
    key tells nothing of torch's own kernels)."""
    return (qualified, dispatch_key) in _REGISTERED


@contextlib.contextmanager
def enabled(switch: str) -> Iterator[None]:
    """Within the block, the overrides registered under ``switch`` act (nested blocks are counted)."""
    _ON[switch] = _ON.get(switch, 0) + 1
    try:
        yield
    finally:
        _ON[switch] -= 1
