"""Storage tracking: one dispatch mode that sees every storage a training step allocates and frees.

The same tracker serves two masters. On fake tensors it records a ``MemoryTrace`` (the estimator);
on real tensors it feeds a live allocator model that raises ``torch.OutOfMemoryError`` where a GPU of
a given capacity would (the simulated device). Both need the same three facts per storage: when it
was born, how many bytes it holds, and when it died.

NOTE [ Storage identity ]
A tensor's bytes belong to its untyped storage; views share it. Each op output's storage is
registered once, keyed by the identity of its Python storage object (which PyTorch keeps unique per
StorageImpl), and a ``weakref.finalize`` on that object records the free. Weak references never
extend a lifetime, so tracking does not change the memory it measures.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .categories import Category, stronger

_PRIM_DEVICE = torch.ops.prim.device.default

AllocHook = Callable[[int, int], None]
"""``(storage_id, nbytes)``: may raise ``torch.OutOfMemoryError`` to refuse the allocation."""
FreeHook = Callable[[int], None]


class StorageTracker(TorchDispatchMode):
    """Registers every new storage produced by an op; reports births and deaths to hooks.

    Args:
        on_alloc: called with ``(storage_id, nbytes)`` for each new storage, after the op ran.
        on_free: called with ``storage_id`` when the storage is garbage.
        after_op: called with ``(func, args, kwargs, outputs, first_new_id)`` after each op, where
            ``outputs`` are the op's output tensors flattened (for kernel models that add scratch an op
            allocates and frees internally, or correct an output's size).

    Limitations:
        Sees op outputs only: memory a kernel allocates and frees inside itself is invisible here and
        is modelled separately (see ``memory/probe.py`` for the CPU and ``memory/cuda.py`` for CUDA).
    """

    def __init__(
        self,
        on_alloc: AllocHook,
        on_free: FreeHook,
        after_op: Callable[[Any, tuple, dict, list, int], None] | None = None,
    ) -> None:
        super().__init__()
        self._on_alloc = on_alloc
        self._on_free = on_free
        self._after_op = after_op
        self._ids: dict[int, int] = {}  # id(python storage) -> storage id
        self._next_id = 0
        self.live_bytes: dict[int, int] = {}
        self.current_func: Any = None
        """The op whose outputs are being registered (None outside ops)."""

    # -- registration -------------------------------------------------------------------------
    def storage_id(self, t: torch.Tensor) -> int | None:
        """The id of ``t``'s storage if it is tracked, else None."""
        return self._ids.get(id(t.untyped_storage()))

    def register(self, t: torch.Tensor) -> int | None:
        """Track ``t``'s storage (idempotent); returns its id, or None for empty storages."""
        st = t.untyped_storage()
        key = id(st)
        sid = self._ids.get(key)
        if sid is not None:
            return sid
        nbytes = st.nbytes()
        if nbytes == 0:  # no allocation: allocators hand out a null pointer for 0 bytes
            return None
        sid = self._next_id
        self._next_id += 1
        self._ids[key] = sid
        self.live_bytes[sid] = nbytes
        weakref.finalize(st, self._freed, key, sid)
        self._on_alloc(sid, nbytes)
        return sid

    def _freed(self, key: int, sid: int) -> None:
        if self._ids.get(key) == sid:
            del self._ids[key]
        if self.live_bytes.pop(sid, None) is not None:
            self._on_free(sid)

    # -- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _PRIM_DEVICE:  # a metadata query (about two thirds of all dispatches): no storage
            return out
        first_new = self._next_id
        self.current_func = func
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outputs:
            self.register(t)
        if self._after_op is not None:
            self._after_op(func, args, kwargs, outputs, first_new)
        self.current_func = None
        return out


class RoleBook:
    """The strongest role each storage has played (see ``categories.PRIORITY``)."""

    def __init__(self) -> None:
        self.role: dict[int, Category] = {}

    def born(self, sid: int, role: Category) -> None:
        self.role[sid] = role

    def mark(self, sid: int | None, role: Category) -> None:
        if sid is None or sid not in self.role:
            return
        self.role[sid] = stronger(self.role[sid], role)
