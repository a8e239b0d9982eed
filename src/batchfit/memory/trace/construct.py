"""Building a workload's model on fake tensors, whatever its constructor does.

NOTE [ Constructors that fake tensors refuse ]
A model is built under ``FakeTensorMode`` so that a 7B model costs nothing. Real constructors do
things fake parameters do not allow by default, and each is made to work here, only while building:

- ``module.to(dtype)`` / ``.to(device)`` / ``.cuda()``: ``nn.Module._apply`` always *swaps* a fake
  parameter in place (``torch.utils.swap_tensors``), which fails because the fake mode holds a weak
  reference to it ("_apply(): Couldn't swap Linear.weight"). Parameter-efficient fine-tuning libraries
  do exactly this (peft moves every adapter to its base layer's device and dtype). While building,
  fake parameters and buffers are instead *replaced* by their converted copies (attributes kept, and
  a parameter shared by several modules replaced by one shared copy, so ties survive). Device moves
  are dropped: the trace runs on fake CPU tensors and models the target device separately.
- ``torch.compile``: a compiled module (or one compiled in place with ``module.compile()``) is
  traced as its eager module and the estimate says so; compiled regions are run eagerly.
- ``copy.deepcopy`` of a fake tensor (peft's ``modules_to_save`` copies the module it saves,
  ``nn.TransformerEncoder`` clones its layer): ``Tensor.__deepcopy__`` deep-copies a subclass's
  ``__dict__``, and a fake tensor's holds its ``FakeTensorMode``, so each copy cloned the whole mode,
  C++-backed state included; freeing both later corrupted the heap (the process died at a garbage
  collection or at exit, in about half the runs of a LoRA BERT with ``modules_to_save``). While
  building, a deep copy of a fake is a fresh fake of the same layout in the active mode instead.
- Lazy modules (``nn.LazyLinear``): their parameters exist only after a first forward, so one is
  run on a batch of one item before the optimizer is made, as a user's own loop must.
- Value reads while building (stochastic-depth rates from ``linspace(...).tolist()``): answered by
  ``memory/values.ValueMode``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from ...batching import map_tensors
from ...errors import BatchfitError, ConfigError
from .compat import library_compat
from .values import DEFAULT_LIMIT, FakeValueMode, ValueMode, active_value_mode, adopt, forget, real_of

if TYPE_CHECKING:
    from ...workload import Workload

_ORIGINAL_APPLY = nn.Module._apply
_ORIGINAL_TO = nn.Module.to


class _Swaps:
    """Converted copies of fake tensors made during one construction: old id -> (old, new)."""

    def __init__(self) -> None:
        self.done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def convert(self, t: torch.Tensor, fn: Any, parameter: bool) -> torch.Tensor:
        with torch.no_grad():
            applied = fn(t)
        if applied is t:
            return t
        seen = self.done.get(id(t))
        if seen is not None:
            new = seen[1]
            if new.dtype == applied.dtype and new.shape == applied.shape:
                return new
        if parameter:
            new = nn.Parameter(applied, requires_grad=t.requires_grad)
            new.__dict__.update({k: v for k, v in t.__dict__.items() if k not in new.__dict__})
        else:
            new = applied
        self.done[id(t)] = (t, new)
        return new


_active: list[_Swaps] = []


def _fake_safe_apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    fake_params = {k: p for k, p in self._parameters.items() if isinstance(p, FakeTensor)}
    fake_buffers = {k: b for k, b in self._buffers.items() if isinstance(b, FakeTensor)}
    if not _active or not (fake_params or fake_buffers):
        return _ORIGINAL_APPLY(self, fn, recurse)
    if recurse:
        for child in self.children():
            child._apply(fn)
    swaps = _active[-1]
    # Real tensors (rare in a fake build) take torch's own path; fakes are replaced, not swapped.
    for k in fake_params:
        self._parameters[k] = None
    for k in fake_buffers:
        self._buffers[k] = None
    _ORIGINAL_APPLY(self, fn, recurse=False)
    for k, p in fake_params.items():
        self._parameters[k] = swaps.convert(p, fn, parameter=True)  # type: ignore[assignment]
    for k, b in fake_buffers.items():
        self._buffers[k] = swaps.convert(b, fn, parameter=False)
    return self


def _to_without_device(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if dtype is None and memory_format is None:
        return self
    return _ORIGINAL_TO(self, dtype=dtype) if memory_format is None else _ORIGINAL_TO(
        self, dtype=dtype, memory_format=memory_format
    )


def _same_module(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    return self


def _real_placeholder(original_new: Any) -> Any:
    """``Uninitialized*.__new__`` with its 0-element placeholder made real: a fake one cannot be
    re-wrapped as the lazy subclass ("already associated to a python object of type FakeTensor")."""

    def new(cls: Any, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return original_new(cls, *args, **kwargs)

    return new


_FAKE_OWN = frozenset({"fake_mode", "fake_device", "constant", "real_tensor", "_is_param"})
"""Attributes a fake tensor (or fake parameter) carries for itself: made anew, never copied."""


def _deepcopy_fake(t: FakeTensor, memo: dict[int, Any]) -> torch.Tensor:
    """A deep copy of ``t``: a fresh fake of its layout in the active mode (see the NOTE above)."""
    if id(t) in memo:
        return memo[id(t)]
    with torch.no_grad():
        fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    real = real_of(t)
    if real is not None:
        with _disable_current_modes():
            real = real.clone()
        adopt(fresh, real)
    else:
        forget(fresh)
    new = nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fresh
    if not isinstance(t, nn.Parameter) and t.requires_grad:
        new.requires_grad_()
    memo[id(t)] = new
    for key, value in t.__dict__.items():
        if key not in _FAKE_OWN and not key.endswith(("_memo", "_memo_vc")) and key not in new.__dict__:
            setattr(new, key, copy.deepcopy(value, memo))
    return new


class _FakeDeepcopy(TorchFunctionMode):
    """``copy.deepcopy`` of a fake tensor through ``_deepcopy_fake`` (every other call unchanged)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.Tensor.__deepcopy__ and args and isinstance(args[0], FakeTensor):
            return _deepcopy_fake(args[0], args[1] if len(args) > 1 else {})
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_construction(fakes: bool = True) -> Iterator[None]:
    """While active, constructors that move or cast fake parameters work (see the NOTE above); ``fakes``
    False for a build on the ``meta`` device, whose tensors deep-copy as they are."""
    from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

    saved = {name: getattr(nn.Module, name) for name in ("_apply", "to", "cuda", "xpu", "mps", "npu")
             if hasattr(nn.Module, name)}  # fmt: skip
    lazy_new = {cls: cls.__dict__["__new__"] for cls in (UninitializedParameter, UninitializedBuffer)}
    _active.append(_Swaps())
    nn.Module._apply = _fake_safe_apply  # type: ignore[method-assign]
    nn.Module.to = _to_without_device  # type: ignore[method-assign]
    for name in ("cuda", "xpu", "mps", "npu"):
        if name in saved:
            setattr(nn.Module, name, _same_module)
    for cls, new in lazy_new.items():
        cls.__new__ = staticmethod(_real_placeholder(new.__func__ if isinstance(new, staticmethod) else new))
    try:
        with warnings.catch_warnings(), _FakeDeepcopy() if fakes else contextlib.nullcontext():
            # copy.deepcopy of a fake module reads data_ptr() (Tensor.__deepcopy__): harmless here
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        _active.pop()
        for name, fn in saved.items():
            setattr(nn.Module, name, fn)
        for cls, new in lazy_new.items():
            cls.__new__ = new


@contextlib.contextmanager
def eager_compiled_regions() -> Iterator[None]:
    """Run ``torch.compile``d functions eagerly (the trace is of eager mode; fake tensors cannot compile).

    Only when dynamo is already loaded: a function compiled before the trace imported it; if nothing
    did, nothing is compiled, and importing dynamo (seconds) would only slow the trace down.
    """
    dynamo_config = sys.modules.get("torch._dynamo.config")
    if dynamo_config is None:
        yield
        return
    saved = dynamo_config.disable
    dynamo_config.disable = True
    try:
        yield
    finally:
        dynamo_config.disable = saved


@contextlib.contextmanager
def buildable_under_fake_mode() -> Iterator[None]:
    """Let a model be built under a fake mode batchfit did not set up (a caller's ``FakeTensorMode``).

    Inside batchfit's own session (``fake_session``) this does nothing; under a bare fake mode it adds
    what the session gives construction: value reads answered (``ValueMode``) and fake-safe ``.to()``.
    On real tensors it does nothing either.
    """
    if not isinstance(torch.empty(0), FakeTensor) or active_value_mode() is not None:
        yield
        return
    with ValueMode(), fake_construction():
        yield


@contextlib.contextmanager
def fake_session() -> Iterator[Any]:
    """Fake tensors with value shadows, library compatibility and eager compiled regions; yields the
    ``ValueMode`` (whose notes say what the trace had to assume)."""
    mode = FakeValueMode()
    # The shadows' random draws come from a forked generator (NOTE [ Reading values during a fake trace ]).
    with library_compat(), eager_compiled_regions(), torch.random.fork_rng(devices=[]), _quiet_meta_failures(), \
            _no_nested_fast_path(), _torchscript_unoptimised(), mode:  # fmt: skip
        yield mode.values


@contextlib.contextmanager
def _torchscript_unoptimised() -> Iterator[None]:
    """TorchScript functions run through their executor's plain plan, the same on every call.

    The profiling executor (on by default) runs a scripted function's first call through a profiling
    plan and later ones through a plan optimised from that profile (``torch.jit.optimized_execution``;
    ``torch/csrc/jit/runtime/profiling_graph_executor_impl.cpp``), and the two free their temporaries in
    different orders: a trace would depend on how often the process had called the function before, and
    a stack's first block (a scripted function's first call) would not be traced as the others are
    (transformers' DeBERTa-v2 scaled its attention with scripted functions). A function whose optimised
    plan an earlier real run already made keeps it, on every call as well.
    """
    get = getattr(torch._C, "_get_graph_executor_optimize", None)
    set_to = getattr(torch._C, "_set_graph_executor_optimize", None)
    if get is None or set_to is None:
        yield
        return
    with temporarily(get, set_to, False):
        yield


@contextlib.contextmanager
def _no_nested_fast_path() -> Iterator[None]:
    """Attention's inference fast path off: a frozen ``nn.TransformerEncoder`` in eval mode under no_grad
    packs its padded batch into a nested tensor (``_nested_tensor_from_mask``), which fake tensors
    cannot make; the padded path it falls back to holds at least as much (an upper bound)."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    with temporarily(mha.get_fastpath_enabled, mha.set_fastpath_enabled, False):
        yield


@contextlib.contextmanager
def temporarily(get: Callable[[], Any], set_to: Callable[[Any], Any], value: Any) -> Iterator[None]:
    """A process-wide torch setting at ``value`` for the block, then back to what it was."""
    saved = get()
    set_to(value)
    try:
        yield
    finally:
        set_to(saved)


def _drop_meta_failure(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def _quiet_meta_failures() -> Iterator[None]:
    """Without torch's log of a failing meta kernel (a traceback on stderr): the exception reaches the
    trace, which turns it into one line naming the module and op."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.addFilter(_drop_meta_failure)
    try:
        yield
    finally:
        log.removeFilter(_drop_meta_failure)


def uncompiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """``model`` with every ``torch.compile`` wrapper removed, and whether there was one."""
    found = False
    orig = getattr(model, "_orig_mod", None)
    while isinstance(orig, nn.Module) and type(model).__name__ == "OptimizedModule":
        model, orig, found = orig, getattr(orig, "_orig_mod", None), True
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            inner = getattr(child, "_orig_mod", None)
            if type(child).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
                setattr(parent, name, inner)
                found = True
        if getattr(parent, "_compiled_call_impl", None) is not None:
            parent._compiled_call_impl = None
            found = True
    return model, found


def _fake_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fake of ``t``'s layout; small CPU tensors keep their real value as the fake's shadow."""
    fake = torch.empty_strided(t.shape, t.stride(), dtype=dtype)
    if t.device.type == "cpu" and t.dtype == dtype and t.numel() <= DEFAULT_LIMIT and not isinstance(t, FakeTensor):
        with _disable_current_modes():
            real = t.detach()
        adopt(fake, real)
    else:
        forget(fake)
    return fake


def _fake_copy(real: nn.Module, param_dtype: torch.dtype | None) -> nn.Module:
    """A copy of ``real`` with fake parameters and buffers, through ``deepcopy``'s memo (ties kept)."""
    memo: dict[int, Any] = {}
    for p in real.parameters():
        dtype = param_dtype if (param_dtype is not None and p.is_floating_point()) else p.dtype
        memo[id(p)] = nn.Parameter(_fake_like(p, dtype), requires_grad=p.requires_grad)
    for b in real.buffers():
        memo[id(b)] = _fake_like(b, b.dtype)
    return copy.deepcopy(real, memo)


def build_fake_model(workload: Workload, param_dtype: torch.dtype | None) -> tuple[nn.Module, list[str]]:
    """The workload's model with fake parameters, and notes on what was done to trace it.

    Called with the fake mode (and ``ValueMode``) active.

    A factory is called under the fake mode (its parameters are born fake). A module instance is
    copied with every parameter and buffer replaced by a fake of the same shape (``param_dtype`` for
    floating ones when given), so no real bytes are copied.

    Raises:
        ConfigError: the factory raised, or returned something that is not a module.
    """
    notes: list[str] = []
    given = workload.model
    if isinstance(given, nn.Module):
        given, compiled = uncompiled(given)
        try:
            model = _fake_copy(given, param_dtype)
        except Exception as e:
            raise ConfigError(
                f"could not copy the workload's model onto fake tensors ({type(e).__name__}: {e}); "
                "pass a factory (model=lambda: MyNet(...)) instead of an instance"
            ) from e
    else:
        try:
            with fake_construction():
                model = workload.build_model()
        except BatchfitError:
            raise
        except Exception as e:
            raise ConfigError(
                f"the workload's model factory raised {type(e).__name__}: {_first_line(e)}; "
                "it runs on fake tensors here, so it must build the model without reading weights from disk"
            ) from e
        model, compiled = uncompiled(model)
    own_fakes(model)
    if compiled:
        notes.append("the model is torch.compile'd: estimated as eager mode (compiled kernels may fuse away "
                     "some activations; the eager estimate is an upper bound for them)")
    return model, notes


def own_fakes(model: nn.Module) -> int:
    """Re-create parameters and buffers that belong to another fake mode in the active one; how many.

    ``copy.deepcopy`` of a fake module (``nn.TransformerEncoder`` clones its layer that way) makes
    fakes of a *new* fake mode. The active mode treats them as foreign and converts them again at
    every use, so a view of such a weight gets a storage of its own and the trace would count the
    weight once more for every use. Shared tensors stay shared; attributes are kept.
    """
    mode = torch.empty(0).fake_mode if isinstance(torch.empty(0), FakeTensor) else None
    if mode is None:
        return 0
    made: dict[int, torch.Tensor] = {}

    def own(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if not isinstance(t, FakeTensor) or t.fake_mode is mode:
            return t
        new = made.get(id(t))
        if new is None:
            fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            if parameter:
                new = nn.Parameter(fresh, requires_grad=t.requires_grad)
                new.__dict__.update({k: v for k, v in t.__dict__.items() if k not in new.__dict__})
            else:
                new = fresh
            made[id(t)] = new
        return new

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = own(p, True)  # type: ignore[assignment]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = own(b, False)
    return len(made)


def materialize_lazy(model: nn.Module, workload: Workload, move: Any = None) -> bool:
    """Run one no-grad forward on a batch of one item if the model has lazy (uninitialised) parameters.

    A loop must do the same before it makes its optimizer (torch.nn.modules.lazy's note); ``move``
    places the batch on the model's device.
    """
    from torch.nn.parameter import UninitializedTensorMixin, is_lazy

    lazy = [p for p in [*model.parameters(), *model.buffers()] if is_lazy(p)]
    if not lazy:
        return False
    batch = workload.batch(1)
    if move is not None:
        batch = map_tensors(batch, move)
    original = UninitializedTensorMixin.materialize
    if isinstance(torch.empty(0), FakeTensor):  # a fake build: the placeholders are real, see _real_placeholder
        UninitializedTensorMixin.materialize = _fake_materializer(model)  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            workload.loss(model, batch)
    finally:
        UninitializedTensorMixin.materialize = original  # type: ignore[method-assign]
    return True


def _fake_materializer(model: nn.Module) -> Any:
    """``materialize`` that puts a fake parameter (or buffer) in its owners' place.

    A real placeholder cannot take fake data (``param.data = fake`` refuses the mix), so every module
    holding the lazy tensor gets a new fake one instead; the lazy module reads it back by attribute.
    """
    owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            owners.setdefault(id(p), []).append((module, name, True))
        for name, b in module._buffers.items():
            owners.setdefault(id(b), []).append((module, name, False))

    def materialize(self: Any, shape: Any, device: Any = None, dtype: Any = None) -> None:
        fake = torch.empty(shape, dtype=dtype or self.dtype)
        param = nn.Parameter(fake, requires_grad=self.requires_grad)
        for module, name, parameter in owners.get(id(self), []):
            if parameter:
                module._parameters[name] = param
            else:
                module._buffers[name] = fake

    return materialize


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
