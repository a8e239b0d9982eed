"""Values on fake tensors: the small tensors a step reads, computed for real beside their fakes.

NOTE [ Reading values during a fake trace ]
Fake tensors have shapes, not values, yet real models read values while they are built and trained:
``[x.item() for x in torch.linspace(0, rate, depth)]`` for stochastic-depth rates (ConvNeXt, Swin),
``if not mask.any(): break`` in ``trunc_normal_``'s rejection loop, ``lengths.tolist()`` for packed
sequences, ``x[mask]`` and ``nonzero()`` whose output shape depends on the data, ``int(n_tokens)`` for a
loss's normaliser. ``FakeTensorMode`` raises on all of these.

``ValueMode`` sits just above the fake mode and keeps a *real shadow* of every fake storage whose value
can be known cheaply: an op whose tensor inputs all have shadows (or are real) and whose outputs are
small (``limit`` elements) and do not require grad is run a second time on the real shadows (matrix
products never are: ``_PRODUCTS``), and the results become the shadows of its outputs (views share
their base's shadow, in-place ops update it).
Factory ops (``arange``, ``linspace``, ``randint``, ``tensor(...)``) start the chains. Parameters and
activations are never shadowed (they require grad, or are too large): their values are neither
needed nor affordable. A mutation that cannot be computed drops the shadows it writes to, so a shadow
is never stale.

A read of a value that has no shadow continues along one branch, and says so in a note naming the
module: a boolean reads False (``while mask.any()`` loops end, ``if torch.isnan(x).any()`` guards pass),
a number reads 1, and an op whose output size depends on unknown data assumes every element is
selected (``nonzero``, ``masked_select``, boolean indexing: the largest size, so memory is not
under-estimated). Random draws for shadows use a forked RNG, so tracing leaves the user's RNG alone;
a branch on a random draw (LayerDrop) follows that one draw.

Limitations:
    A branch taken on an unknown value may not be the branch the real step takes; the estimate lists
    every such read (``Estimate.notes``) so the user can judge it.

NOTE [ Values computed when read ]
Most shadows are never read: a rotary table's ``cos`` and ``sin`` (half a million elements each, every
forward) feed only products. So a pure op on known values is not run when it is dispatched: its
outputs' shadows are ``_Deferred``, holding the op and the shadows and layouts of its inputs, and the
op runs on them the first time one of its outputs' values is read (``real_of``), with the default dtype
it was dispatched under. Its value is the one it would have had then, because a shadow is only ever
replaced, never written, except by an in-place op run on the shadows; before one runs, the deferred ops
that read a shadow it writes into are run (``_run_readers``; this assumes a real storage shadows one fake
storage, as it does unless a fake kernel made a new storage where the real op returns a view, which no op
is known to do). Ops that draw random numbers are run when dispatched, so the draws keep their order;
so is everything under CPU autocast. A view of a shadowed storage needs no op at all: it is a window on
the same shadow.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .fastkey import prep_args_for_hash

_REAL = "_batchfit_real"
"""Attribute of a fake storage holding the real storage of its shadow."""

_aten = torch.ops.aten
_SCALAR_READS = frozenset({_aten._local_scalar_dense.default, _aten.item.default})
_PRIM_DEVICE = torch.ops.prim.device.default
DEFAULT_LIMIT = 1 << 20
"""Largest output (elements) computed for real: a token batch's ids and masks (B x T up to a million,
and the float attention masks transformers builds from them and inspects) are shadowed."""
_PRODUCTS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "bmm", "addmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)
)
"""Matrix products and convolutions: never computed for real. What a step reads is index and mask
logic (comparisons, sums, cumulative sums), not products; a product of known inputs (rotary
frequencies times positions) would cost real compute for a value nothing reads."""


@dataclass(frozen=True)
class ValueNote:
    """One read of a value the trace could not know, and what was assumed."""

    module: str
    op: str
    assumed: str

    def __str__(self) -> str:
        return f"{self.module}: {self.op} read a value of the step's data; assumed {self.assumed}"


def real_of(t: Any) -> torch.Tensor | None:
    """The real value of ``t``: itself if real, its shadow if fake and known, else None."""
    if not isinstance(t, torch.Tensor):
        return None
    if not isinstance(t, FakeTensor):
        return t
    return _viewed(getattr(t.untyped_storage(), _REAL, None), t.dtype, t.storage_offset(), t.shape, t.stride())


def _viewed(shadow: Any, dtype: torch.dtype, offset: int, shape: Any, stride: Any) -> torch.Tensor | None:
    """The real tensor of a layout on ``shadow`` (a real storage, a ``_Deferred`` run now, or None)."""
    if type(shadow) is _Deferred:
        shadow = shadow.resolve()
    if shadow is None or shadow.device.type == "meta":  # a shadow made under torch.device("meta") holds no value
        return None
    with _disable_current_modes():
        return torch.empty(0, dtype=dtype).set_(shadow, offset, shape, stride)


def forget(t: Any) -> None:
    """Drop the shadow of ``t``'s storage (its value is no longer known)."""
    if isinstance(t, FakeTensor):
        st = t.untyped_storage()
        if getattr(st, _REAL, None) is not None:
            setattr(st, _REAL, None)


def adopt(fake: torch.Tensor, real: torch.Tensor) -> None:
    """Make ``real`` the value of ``fake`` (same layout, or copied into ``fake``'s layout)."""
    if not isinstance(fake, FakeTensor) or isinstance(real, FakeTensor) or fake.shape != real.shape:
        return
    st = fake.untyped_storage()
    real_st = real.untyped_storage()
    if getattr(st, _REAL, None) is real_st:
        return
    setattr(st, _REAL, _laid_out(real, fake.dtype, st.nbytes(), fake.storage_offset(), fake.shape, fake.stride()))


def _laid_out(real: torch.Tensor, dtype: torch.dtype, nbytes: int, offset: int, shape: Any, stride: Any) -> Any:
    """``real``'s storage if it has the given layout (a fake's), else a new one of ``nbytes`` holding
    ``real`` laid out so."""
    real_st = real.untyped_storage()
    same = real.stride() == stride and real.storage_offset() == offset and real.dtype == dtype
    if same and real_st.nbytes() == nbytes:
        return real_st
    with _disable_current_modes():
        base = torch.empty(0, dtype=dtype).set_(torch.UntypedStorage(nbytes), offset, shape, stride)
        base.copy_(real)
    return base.untyped_storage()


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The tensors an op writes to (its ``Tensor(a!)`` arguments, lists included)."""
    out = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out


class _Run:
    """An op on known values, run the first time one of its outputs' values is read (see
    NOTE [ Values computed when read ])."""

    __slots__ = ("func", "flat", "spec", "dtype", "n_outputs", "outputs", "__weakref__")

    def __init__(self, func: Any, flat: list[Any], spec: Any, n_outputs: int) -> None:
        self.func = func
        self.flat = flat  # the op's arguments, each tensor as the (shadow, layout) of its value
        self.spec = spec
        self.dtype = torch.get_default_dtype()  # the default dtype it was dispatched under
        self.n_outputs = n_outputs
        self.outputs: list[torch.Tensor] | None = None

    def run(self) -> list[torch.Tensor] | None:
        if self.flat is None:
            return self.outputs
        flat, self.flat = self.flat, None
        real_flat = []
        for a in flat:
            if type(a) is _Input:
                a = a.value()
                if a is None:
                    return None
            real_flat.append(a)
        args, kwargs = tree_unflatten(real_flat, self.spec)
        try:
            with _disable_current_modes(), torch.no_grad(), _default_dtype(self.dtype):
                out = self.func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a value we cannot compute is just unknown
            return None
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.outputs = outputs if len(outputs) == self.n_outputs else None
        return self.outputs


class _Input:
    """A tensor argument of a deferred op: its storage's shadow (a real storage or a ``_Deferred``) and
    its layout, captured when the op was dispatched (an in-place op runs the deferred ops that read a
    shadow before it writes into it)."""

    __slots__ = ("shadow", "offset", "shape", "stride", "dtype")

    def __init__(self, shadow: Any, t: torch.Tensor) -> None:
        self.shadow = shadow
        self.offset = t.storage_offset()
        self.shape = t.shape
        self.stride = t.stride()
        self.dtype = t.dtype

    def value(self) -> torch.Tensor | None:
        return _viewed(self.shadow, self.dtype, self.offset, self.shape, self.stride)


class _Deferred:
    """The shadow of a fake storage whose value is the ``index``-th output of a ``_Run`` not run yet."""

    __slots__ = ("run", "index", "offset", "shape", "stride", "dtype", "nbytes", "storage")

    def __init__(self, run: _Run, index: int, fake: torch.Tensor) -> None:
        self.run = run
        self.index = index
        self.offset = fake.storage_offset()
        self.shape = fake.shape
        self.stride = fake.stride()
        self.dtype = fake.dtype
        self.nbytes = fake.untyped_storage().nbytes()
        self.storage: Any = self  # the real storage once resolved (None: the value could not be computed)

    def resolve(self) -> Any:
        """The real storage of the value (None when it cannot be computed)."""
        if self.storage is self:
            outs = self.run.run()
            real = outs[self.index] if outs is not None else None
            if real is None or real.shape != self.shape:
                self.storage = None
            else:
                self.storage = _laid_out(real, self.dtype, self.nbytes, self.offset, self.shape, self.stride)
        return self.storage


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``steps.default_dtype`` for a deferred op (steps imports construct, which imports this module)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


_KINDS: dict[Any, tuple[bool, bool, bool]] = {}


def _kind(func: Any) -> tuple[bool, bool, bool]:
    """``(mutates an argument, returns an alias of an argument, draws random numbers)`` of an op, from
    its schema and tags (cached)."""
    kind = _KINDS.get(func)
    if kind is None:
        schema = func._schema
        aliasing = any(r.alias_info is not None for r in schema.returns)
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        kind = _KINDS[func] = (schema.is_mutable, aliasing, seeded)
    return kind


class ValueMode(TorchDispatchMode):
    """Keeps real shadows of small fake tensors and answers value reads (see the NOTE above).

    Args:
        where: names the module running now, for notes (the tracer's module stack).
        limit: largest output, in elements, computed for real.
    """

    def __init__(self, where: Callable[[], str] | None = None, limit: int = DEFAULT_LIMIT) -> None:
        super().__init__()
        self.where = where or (lambda: "model construction")
        self.limit = limit
        self.notes: dict[ValueNote, int] = {}
        """Each assumption made, with how many times it was made."""
        self.observer: Any = None
        """A storage tracker wrapping every op (see NOTE [ One mode for fakes, values and tracking ])."""
        self.below: Callable[[Any, tuple, dict], Any] = _call
        """Runs an op on the layer below (the fake kernels)."""
        self._rng: contextlib.ExitStack | None = None
        self._readers: dict[int, weakref.WeakSet[_Run]] = {}
        """Deferred ops not run yet, by the ``id`` of each shadow they read."""

    # -- context: the shadows' random draws come from a forked generator --------------------------
    def __enter__(self) -> ValueMode:
        self._rng = contextlib.ExitStack()
        self._rng.enter_context(torch.random.fork_rng(devices=[]))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._rng is not None:
                self._rng.close()
                self._rng = None

    def note(self, op: Any, assumed: str) -> None:
        key = ValueNote(self.where(), str(op), assumed)
        self.notes[key] = self.notes.get(key, 0) + 1

    # -- dispatch --------------------------------------------------------------------------------
    # NOTE [ One mode for fakes, values and tracking ]
    # Every Python dispatch mode costs each op a round trip through the dispatcher (about two thirds
    # of all dispatches are ``prim.device`` queries, which pay it too). While a step is traced, the
    # storage tracker is not a mode of its own: it sets itself as this mode's ``observer`` and wraps
    # each op here (``observe(func, args, kwargs, call)``). And inside batchfit's own session this mode
    # is not a layer either: ``FakeValueMode`` is the fake mode itself, running ``handle`` before the
    # fake kernels, so a traced op crosses one Python mode, as it would under a bare ``FakeTensorMode``.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is _PRIM_DEVICE:
            return func(*args, **kwargs)
        return self.handle(func, args, kwargs)

    def handle(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """One op: registered by the observer when one is attached, with its values propagated."""
        observer = self.observer
        if observer is not None:
            return observer.observe(func, args, kwargs, self._dispatch)
        return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _SCALAR_READS:
            return self._read(func, args[0])
        try:
            out = self.below(func, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return self._data_dependent(func, args, kwargs)
        self._propagate(func, args, kwargs, out)
        return out

    def _real_call(self, func: Any, args: tuple, kwargs: dict, zeros_for_floats: bool = False) -> Any:
        """``func`` on the inputs' real values, or None when one is unknown or the op fails.

        With ``zeros_for_floats``, unknown floating-point inputs are read as zeros: for an op whose
        output *sizes* depend only on its integer inputs (``ctc_loss``'s target lengths), the sizes
        come out right even though the values do not.
        """
        flat, spec = tree_flatten((args, kwargs))
        real_flat = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                r = real_of(a)
                if r is None:
                    if not (zeros_for_floats and (a.is_floating_point() or a.is_complex())):
                        return None
                    with _disable_current_modes():
                        r = torch.zeros(a.shape, dtype=a.dtype)
                real_flat.append(r)
            else:
                real_flat.append(a)
        rargs, rkwargs = tree_unflatten(real_flat, spec)
        if self._readers and _kind(func)[0]:
            self._run_readers(func, args, kwargs)
        try:
            with _disable_current_modes(), torch.no_grad():
                return (func(*rargs, **rkwargs),)
        except Exception:  # noqa: BLE001 - a value we cannot compute is just unknown
            return None

    def _propagate(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            outs: list[torch.Tensor] = [out]
        elif isinstance(out, (tuple, list)):
            outs = [t for t in out if isinstance(t, torch.Tensor)]
        else:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        limit = self.limit
        if (
            outs
            and func not in _PRODUCTS
            and all(t.numel() <= limit and not t.requires_grad for t in outs)
            and getattr(func, "namespace", "aten") != "profiler"
        ):
            deferred = self._deferred(func, args, kwargs, outs)
            if deferred:
                return
            result = None if deferred is None else self._real_call(func, args, kwargs)
            if result is not None:
                real_outs = [t for t in tree_flatten(result[0])[0] if isinstance(t, torch.Tensor)]
                if len(real_outs) == len(outs):
                    for fake, real in zip(outs, real_outs):
                        adopt(fake, real)
                    return
        mutable, aliasing, _ = _kind(func)
        if mutable:
            written = _written(func, args, kwargs)
            # An in-place op that returns nothing (the optimizers' ``_foreach_add_`` on their step
            # counters): computed on the shadows, which it updates in place, when every input is known.
            if not outs and written and all(t.numel() <= limit for t in written):
                if self._real_call(func, args, kwargs) is not None:
                    return
            for t in written:
                forget(t)
        if aliasing:  # a view of a shadowed input that was not computed: its storage's value is unknown
            for t in outs:
                forget(t)

    def _deferred(self, func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> bool | None:
        """Whether ``outs``' values are known without running ``func`` now: a view of a shadowed storage,
        or a pure op on known values, deferred until they are read (NOTE [ Values computed when read ]).

        None where a pure op reads a fake whose value is unknown: running it on real values cannot work
        either (``_real_call`` would find the same unknown input), so the caller does not try: most ops of
        a step are of this kind, and each would have its arguments flattened a second time to find out."""
        mutable, aliasing, seeded = _kind(func)
        if mutable:
            return False
        if aliasing:
            return all(getattr(t.untyped_storage(), _REAL, None) is not None for t in outs)
        if seeded or torch.is_autocast_enabled("cpu"):
            return False
        flat, spec = tree_flatten((args, kwargs))
        for i, a in enumerate(flat):
            if isinstance(a, torch.Tensor):
                if type(a) is not FakeTensor:
                    return False
                shadow = getattr(a.untyped_storage(), _REAL, None)
                if shadow is None or (type(shadow) is _Deferred and shadow.storage is None):
                    return None
                flat[i] = _Input(shadow, a)
        run = _Run(func, flat, spec, len(outs))
        for a in flat:
            if type(a) is _Input:
                readers = self._readers.get(id(a.shadow))
                if readers is None:
                    readers = self._readers[id(a.shadow)] = weakref.WeakSet()
                readers.add(run)
        for i, t in enumerate(outs):
            setattr(t.untyped_storage(), _REAL, _Deferred(run, i, t))
        return True

    def _run_readers(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Run the deferred ops that read a shadow ``func`` is about to write into, while it holds the
        value they were given."""
        for t in _written(func, args, kwargs):
            if isinstance(t, FakeTensor):
                readers = self._readers.pop(id(getattr(t.untyped_storage(), _REAL, None)), None)
                for run in list(readers or ()):
                    run.run()

    def _read(self, func: Any, t: torch.Tensor) -> Any:
        real = real_of(t)
        if real is not None:
            with _disable_current_modes():
                return real.item()
        if t.dtype == torch.bool:
            self.note(func, "False")
            return False
        self.note(func, "1")
        return 1 if not (t.is_floating_point() or t.is_complex()) else 1.0

    def _data_dependent(self, func: Any, args: tuple, kwargs: dict) -> Any:
        result = self._real_call(func, args, kwargs)
        if result is not None:
            return self._fake_like(result[0], values=True)
        sized = self._real_call(func, args, kwargs, zeros_for_floats=True)
        if sized is not None and not isinstance(sized[0], (bool, int, float)):
            return self._fake_like(sized[0], values=False)
        return self._assume(func, args, kwargs)

    def _fake_like(self, real: Any, values: bool) -> Any:
        """Fakes shaped like the real outputs of a data-dependent op (with them as values if ``values``)."""

        def one(r: Any) -> Any:
            if not isinstance(r, torch.Tensor):
                return r
            fake = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype)
            if values:
                adopt(fake, r)
            else:
                forget(fake)
            return fake

        return tree_map(one, real)

    def _assume(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A data-dependent op on unknown data: every element selected (the largest output)."""
        name = func._schema.name
        x = args[0] if args else None
        if name == "aten::nonzero" and isinstance(x, torch.Tensor):
            self.note(func, f"all {x.numel()} elements nonzero")
            return torch.empty((x.numel(), x.dim()), dtype=torch.long)
        if name == "aten::masked_select" and isinstance(x, torch.Tensor):
            shape = torch.broadcast_shapes(x.shape, args[1].shape)
            self.note(func, "every element selected")
            return torch.empty((math.prod(shape),), dtype=x.dtype)
        if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
            indices: list[Any] = []
            for index in args[1]:
                indices.extend(self._as_long_indices(index, func))
            return func(args[0], indices, *args[2:], **kwargs)
        if name == "aten::bincount" and isinstance(x, torch.Tensor):
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            if minlength and weights is None:  # a router's tokens per expert: bincount(choices, minlength=experts)
                self.note(func, f"{x.numel()} values spread evenly over {minlength} bins")
                n = x.numel()
                with _disable_current_modes():
                    counts = torch.full((minlength,), n // minlength, dtype=torch.long)
                    counts[: n % minlength] += 1
                return self._fake_like(counts, values=True)
        if name.startswith("aten::unique") or name == "aten::_unique2" or name == "aten::_unique":
            self.note(func, "every element distinct")
            n = x.numel() if x is not None else 0
            outs = [torch.empty((n,), dtype=x.dtype)]
            returns = func._schema.returns
            for _ in returns[1:]:
                outs.append(torch.empty((n,), dtype=torch.long))
            return tuple(outs) if len(returns) > 1 else outs[0]
        returns = func._schema.returns
        if len(returns) == 1 and str(returns[0].type) == "bool":
            self.note(func, "False")
            return False
        if len(returns) == 1 and str(returns[0].type) in ("int", "float", "Scalar"):
            self.note(func, "1")
            return 1
        raise DynamicOutputShapeException(func)

    def _as_long_indices(self, index: Any, func: Any) -> list[Any]:
        """A boolean mask of k dims as the k long indices of its nonzeros (all of them, assumed)."""
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            self.note(func, f"every element of a boolean mask of {index.numel()} selected")
            return list(torch.empty((index.dim(), index.numel()), dtype=torch.long).unbind(0))
        return [index]


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_DEVICE_OF = getattr(fake_tensor, "_DISPATCH_META_HANDLERS", {}).get(_PRIM_DEVICE)
"""The fake mode's own answer to a device query (None in a torch without it: the fake mode is asked)."""


class FakeValueMode(FakeTensorMode):
    """``FakeTensorMode`` that is also the ``ValueMode`` (``values``): one Python layer per op.

    See NOTE [ One mode for fakes, values and tracking ]. An op dispatched to this mode runs through
    ``values.handle`` (value shadows, the tracker's registration), which reaches the fake kernels
    through ``_fake_kernels``. What the handlers make while an op is handled (a shadow's fake, a
    kernel model's workspace, the engine's in-place accumulation) is made with this mode active and
    goes straight to the fake kernels, as it would under a separate mode above the fake mode.
    """

    def __init__(self, where: Callable[[], str] | None = None) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.values = ValueMode(where)
        self.values.below = self._fake_kernels
        self._handling = False
        self._types: Any = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is _PRIM_DEVICE and _DEVICE_OF is not None:  # what the fake mode answers, without its wrappers
            return _DEVICE_OF(args)
        if func is _PRIM_DEVICE or self._handling:
            return FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs)
        # The dispatcher took this mode off the stack for this call; the handlers run with it back on
        # (set directly: ``with self`` costs as much again as the rest of this layer).
        self._handling, self._types = True, types
        torch._C._set_dispatch_mode(self)
        try:
            return self.values.handle(func, args, kwargs or {})
        finally:
            torch._C._unset_dispatch_mode(_FAKE_KEY)
            self._handling = False

    if hasattr(FakeTensorMode, "_prep_args_for_hash"):  # the dispatch cache's key (memory/trace/fastkey.py)
        _prep_args_for_hash = prep_args_for_hash(FakeTensorMode._prep_args_for_hash)

    def _fake_kernels(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # The fake mode's own dispatch expects to run with itself off the stack, as the dispatcher
        # calls it; the handlers around this call run with it on.
        torch._C._unset_dispatch_mode(_FAKE_KEY)
        try:
            return FakeTensorMode.__torch_dispatch__(self, func, self._types, args, kwargs)
        finally:
            torch._C._set_dispatch_mode(self)


def active_value_mode() -> ValueMode | None:
    """The ``ValueMode`` in effect: batchfit's fake mode's, else one on the dispatch stack, else None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    fake = torch._C._get_dispatch_mode(_FAKE_KEY)
    if isinstance(fake, FakeValueMode):
        return fake.values
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, ValueMode):
            return mode
    return None
