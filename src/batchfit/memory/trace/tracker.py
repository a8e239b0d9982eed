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
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from ...errors import TraceError
from ..categories import Category, stronger

_PRIM_DEVICE = torch.ops.prim.device.default
_ADD = torch.ops.aten.add.Tensor


# NOTE [ Waiting on a collective returns its tensor ]
# ``_c10d_functional.wait_tensor`` waits for the collective that writes its argument and returns that
# same tensor (``Functional.cpp``: ``wait_tensor`` returns ``tensor``), but its fake kernel returns a new
# one (``empty_like``), which a trace would count as one more collective-sized buffer alive until the
# argument dies. The op is run (the fake work is waited for and unregistered) and its argument
# returned, as the real op does.
def _alias_ops() -> frozenset:
    functional = getattr(torch.ops, "_c10d_functional", None)
    wait = getattr(functional, "wait_tensor", None) if functional is not None else None
    return frozenset({wait.default}) if wait is not None else frozenset()


_RETURNS_ARGUMENT = _alias_ops()


# NOTE [ Gradient accumulation inside the autograd engine ]
# When two gradients meet at one tensor (a residual connection, a tensor used twice), the autograd
# engine adds them (``torch/csrc/autograd/input_buffer.cpp``, ``accumulate``): in place,
# ``old.add_(new)``, when it holds the last reference to a dense ``old``, but out of place,
# ``old + new``, whenever ``can_accumulate_inplace`` sees a tensor subclass, which is what every fake
# tensor is, and every tensor while a dispatch mode is active (``isTensorSubclassLike``). A tracked
# step would so allocate one more gradient-sized buffer per accumulation than the real step does.
# The tracker recognises the engine's ``add`` (dispatched while a node runs, grad mode off, ``old``
# born in an earlier node and ``new`` in this one, the reference counts of a tensor held only by the
# engine's buffer) and runs it in place, as the engine would have. The reference counts seen at
# dispatch depend on how torch hands tensors to Python; they are measured once per process on a
# graph whose accumulation is known to be in place (``_accumulation_counts``).
_COUNTS: list[tuple[int, int] | None] = []

# NOTE [ Composite kernels that go out of place for subclasses ]
# The same reason makes ATen's composite backward formulas allocate more under a dispatch mode: they
# fill a fresh zeros tensor in place (``result.scatter_add_(...)`` in ``gather_backward``,
# ``_index_put_impl_`` in ``index_backward``) unless ``areAnyTensorSubclassLike`` is true, when they
# call the out-of-place op instead (``TensorSubclassLikeUtils.h``; ``FunctionsManual.cpp``). An
# out-of-place op of this family whose ``self`` is a zeros-made tensor referenced only by its
# caller is run in place, as the real kernel runs it.
_FILL_OPS = ("scatter_add", "scatter", "index_put", "index_add", "index_copy", "index_fill", "masked_scatter",
             "masked_fill", "put")  # fmt: skip
_ZERO_FACTORIES = frozenset(
    op.default
    for op in (torch.ops.aten.zeros, torch.ops.aten.new_zeros, torch.ops.aten.zeros_like,
               torch.ops.aten.new_empty, torch.ops.aten.empty_like, torch.ops.aten.new_full)  # fmt: skip
)


def _in_place_twins() -> dict[Any, Any]:
    twins = {}
    for name in _FILL_OPS:
        packet, inplace = getattr(torch.ops.aten, name, None), getattr(torch.ops.aten, name + "_", None)
        if packet is None or inplace is None:
            continue
        for overload in packet.overloads():
            twin = getattr(inplace, overload, None)
            if twin is not None:
                twins[getattr(packet, overload)] = twin
    return twins


_TWINS = _in_place_twins()


def _accumulation_counts() -> tuple[int, int] | None:
    """``(tensor use count, storage use count)`` of an in-place-eligible ``old`` as a mode sees it."""
    if _COUNTS:
        return _COUNTS[0]
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    seen: list[tuple[int, int]] = []

    class _Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is _ADD and torch._C._current_autograd_node() is not None:
                seen.append(_use_counts(args[0]))
            return func(*args, **(kwargs or {}))

    with _disable_current_modes(), FakeTensorMode():
        x = torch.empty(8, requires_grad=True)
        y = x * 2.0
        loss = (y.sin() * y.cos()).sum()  # y's two gradients meet: the real engine adds in place
        with _Probe():
            loss.backward()
    _COUNTS.append(seen[0] if len(seen) == 1 else None)
    return _COUNTS[0]


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory exactly once in some dimension order (c10's rule)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _use_counts(t: torch.Tensor) -> tuple[int, int]:
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)

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
        is modelled separately (``memory/kernels/cpu_probe.py`` for the CPU, ``memory/kernels/cuda.py`` for CUDA).
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
        self.current_out: Any = None
        """The op's output as it returned it, while ``after_op`` runs."""
        self.on_error: Callable[[Any], None] | None = None
        """Called with the op when an op raises (before the exception unwinds the module stack)."""
        self.fix_outputs: Callable[[Any, tuple, dict, Any], Any] | None = None
        """``(func, args, kwargs, out) -> out``: may replace an op's fresh outputs before they are
        registered (a kernel model whose real kernel lays them out differently from the meta kernel)."""
        self.allocation_order: Callable[[Any, list], list] | None = None
        """``(func, outputs) -> outputs``: an op's outputs in the order its real kernel allocates them, which
        is the order they are registered in (a kernel model whose real kernel allocates them in another)."""
        self._refs: dict[int, Any] = {}  # storage id -> weak reference to its storage
        self.current_node: Any = None
        """The autograd node running when the storage being registered was made (None in forward)."""
        self._born_in: dict[int, int] = {}  # storage id -> the token (``node_token``) of the node that made it
        self._node: Any = None  # the node wrapper the latest token stands for, held (NOTE [ Autograd node tokens ])
        self._tokens = 0
        self._zeros: set[int] = set()  # storage ids made by a zeros-like factory
        self._accumulation = _accumulation_counts()

    # -- registration -------------------------------------------------------------------------
    def storage_id(self, t: torch.Tensor) -> int | None:
        """The id of ``t``'s storage if it is tracked, else None (a DTensor's: its local tensor's)."""
        return self._ids.get(id(local_tensor(t).untyped_storage()))

    def register(self, t: torch.Tensor) -> int | None:
        """Track ``t``'s storage (idempotent); returns its id, or None for empty storages.

        A tensor subclass that wraps others (a ``DTensor`` and its local shard) holds no memory of its
        own: its inner tensors are registered instead (see NOTE [ Wrapper tensors ]).
        """
        inner = inner_tensors(t)
        if inner is not None:
            sids = [self.register(x) for x in inner]
            return next((sid for sid in sids if sid is not None), None)
        try:
            st = t.untyped_storage()
        except NotImplementedError:
            if t.layout == torch.strided:
                raise
            raise sparse_tensor_error() from None
        key = id(st)
        sid = self._ids.get(key)
        if sid is not None:
            return sid
        nbytes = st.nbytes()
        if nbytes == 0:  # no allocation: allocators hand out a null pointer for 0 bytes
            return None
        return self._born(st, nbytes)

    def _born(self, st: Any, nbytes: int) -> int:
        """A new storage id for ``st``'s ``nbytes``, reported to ``on_alloc``."""
        key = id(st)
        sid = self._next_id
        self._next_id += 1
        self._ids[key] = sid
        self.live_bytes[sid] = nbytes
        node = self.current_node = torch._C._current_autograd_node()
        if node is not None:
            self._born_in[sid] = self.node_token(node)
        # A weak reference with a callback (cheaper than weakref.finalize, which also keeps a global
        # registry); the reference itself is kept here until its storage dies.
        self._refs[sid] = weakref.ref(st, partial(self._freed, key, sid))
        self._on_alloc(sid, nbytes)
        return sid

    # NOTE [ Autograd node tokens ]
    # Which autograd node made a storage decides whether an ``add`` is the engine accumulating gradients
    # (``_engine_accumulation``) and whether ``AccumulateGrad`` copied a gradient. ``_current_autograd_node()``
    # hands out a Python wrapper of the running C++ node, alive only while something references it: the
    # wrapper's ``id`` is a memory address, which a later node's wrapper may take once an earlier one is
    # freed. Compared by ``id``, a storage of an earlier node could pass for one of the running node, at
    # random from process to process, and the engine's in-place addition be traced out of place in some
    # blocks and not in others (a depth cut that then found two middle blocks unequal). So each node
    # gets a number instead, counted up whenever the running node's wrapper is another object than the
    # one before; that wrapper is held until the next node runs, so that its own calls keep returning it.
    def node_token(self, node: Any) -> int | None:
        """A number for the running autograd node ``node`` (a ``_current_autograd_node()``), the same for every
        call while it runs and never another node's (NOTE [ Autograd node tokens ]); None for None."""
        if node is None:
            return None
        if node is not self._node:
            self._node = node
            self._tokens += 1
        return self._tokens

    def resized(self, storage: Any, nbytes: int) -> None:
        """``storage`` (tracked or not) now holds ``nbytes``: its old bytes are freed and new ones allocated.

        ``UntypedStorage.resize_`` keeps the storage object and swaps its memory (the CPU allocator
        allocates the new block, copies, then frees the old one: ``resize_bytes_cpu``), which is how
        FSDP2 frees a unit's unsharded parameters after use and brings them back for the next
        all-gather (``free_storage`` / ``alloc_storage`` in ``torch/distributed/fsdp/_fully_shard``).
        """
        key = id(storage)
        old = self._ids.get(key)
        if old is not None and self.live_bytes.get(old) == nbytes:
            return
        self.current_func = "UntypedStorage.resize_"
        if nbytes > 0:
            self._born(storage, nbytes)
        elif old is not None:
            del self._ids[key]
        self.current_func = None
        if old is not None:
            self._refs.pop(old, None)
            self._born_in.pop(old, None)
            self._zeros.discard(old)
            if self.live_bytes.pop(old, None) is not None:
                self._on_free(old)

    def _freed(self, key: int, sid: int, _ref: Any = None) -> None:
        self._refs.pop(sid, None)
        if self._ids.get(key) == sid:
            del self._ids[key]
        self._born_in.pop(sid, None)
        self._zeros.discard(sid)
        if self.live_bytes.pop(sid, None) is not None:
            self._on_free(sid)

    def _composite_fill(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The in-place twin of ``func`` if a composite kernel would have filled ``self`` in place."""
        if self._accumulation is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        sid = self.storage_id(args[0])
        if sid is None or sid not in self._zeros or _use_counts(args[0]) != self._accumulation:
            return None
        return _TWINS[func](*args, **kwargs)

    def _engine_accumulation(self, args: tuple) -> torch.Tensor | None:
        """``old.add_(new)`` if this ``add`` is the engine accumulating in place (see the NOTE)."""
        node = torch._C._current_autograd_node()
        if node is None or torch.is_grad_enabled() or self._accumulation is None or len(args) != 2:
            return None
        old, new = args
        if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
            return None
        if inner_tensors(old) is not None:  # DTensor gradients: the engine adds subclasses out of place
            return None
        if old.shape != new.shape or old.dtype != new.dtype or _use_counts(old) != self._accumulation:
            return None
        old_sid, new_sid = self.storage_id(old), self.storage_id(new)
        token = self.node_token(node)
        if old_sid is None or new_sid is None or self._born_in.get(new_sid) != token:
            return None
        if self._born_in.get(old_sid) in (None, token) or not is_non_overlapping_and_dense(old):
            return None
        return old.add_(new)

    # -- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is _PRIM_DEVICE:  # a metadata query (about two thirds of all dispatches): no storage
            return func(*args, **kwargs)
        return self.observe(func, args, kwargs, _call)

    def observe(self, func: Any, args: tuple, kwargs: dict, call: Callable[[Any, tuple, dict], Any]) -> Any:
        """Run ``call(func, args, kwargs)`` and register the storages it made (also used by the value mode,
        which wraps every op in this when it carries the tracker; see ``memory/trace/values.py``)."""
        if func is _ADD and not kwargs:
            accumulated = self._engine_accumulation(args)
            if accumulated is not None:
                return accumulated
        elif func in _RETURNS_ARGUMENT:
            call(func, args, kwargs)
            return args[0]
        elif func in _TWINS:
            filled = self._composite_fill(func, args, kwargs)
            if filled is not None:
                return filled
        try:
            out = call(func, args, kwargs)
        except Exception:
            if self.on_error is not None:
                self.on_error(func)
            raise
        if self.fix_outputs is not None:
            out = self.fix_outputs(func, args, kwargs, out)
        first_new = self._next_id
        self.current_func = func
        if isinstance(out, torch.Tensor):
            outputs = [out]
        elif isinstance(out, (tuple, list)):
            outputs = [t for t in out if isinstance(t, torch.Tensor)]
        else:
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.allocation_order is not None:
            outputs = self.allocation_order(func, outputs)
        for t in outputs:
            self.register(t)
        if func in _ZERO_FACTORIES and len(outputs) == 1:
            sid = self.storage_id(outputs[0])
            if sid is not None and sid >= first_new:
                self._zeros.add(sid)
        if self._after_op is not None:
            self.current_out = out
            self._after_op(func, args, kwargs, outputs, first_new)
            self.current_out = None
        self.current_func = None
        return out


# NOTE [ Wrapper tensors ]
# A ``DTensor`` (tensor and sequence parallelism, FSDP2's sharded parameters) is a wrapper subclass:
# the Python object has the *global* shape and no memory of its own, and one plain tensor inside
# (``_local_tensor``, ``__tensor_flatten__``) holds this rank's bytes. A dispatch mode sees an op on
# DTensors first; the fake mode declines it (``NotImplemented``), DTensor's own dispatch then runs the
# op on the local tensors, and those local ops come back through the mode like any other op. So the
# storages a rank allocates are the local tensors', and wherever a hook hands the tracker a DTensor (a
# parameter, its gradient, an optimizer state, a tensor saved for backward) the local tensor is what
# is counted.
_WRAPPERS: dict[type, bool] = {}
"""Whether each tensor type seen is a wrapper subclass (asked once per type: this is on every op's path)."""


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors a wrapper subclass holds (None: ``t`` holds its own storage)."""
    wraps = _WRAPPERS.get(type(t))
    if wraps is None:
        wraps = _WRAPPERS[type(t)] = is_traceable_wrapper_subclass(t)
    if not wraps:
        return None
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return [x for x in (getattr(t, n) for n in names) if isinstance(x, torch.Tensor)]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the first tensor a wrapper subclass holds (a DTensor's local shard)."""
    inner = inner_tensors(t)
    while inner:
        t = inner[0]
        inner = inner_tensors(t)
    return t


def sparse_tensor_error() -> TraceError:
    """The one error for a step with sparse tensors: the sizes of their parts are data (``nnz``)."""
    return TraceError(
        "the step makes a sparse tensor (an nn.Embedding or nn.EmbeddingBag with sparse=True, say), whose "
        "memory depends on the values of its indices, which fake tensors do not have; estimate with "
        "sparse=False (and an optimizer for dense gradients, Adam for SparseAdam): its dense gradient is an "
        "upper bound of the sparse one"
    )


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


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
