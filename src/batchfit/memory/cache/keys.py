"""The trace cache's keys: a digest of everything a traced step depends on, or ``Uncacheable``.

Code is described by its bytecode, constants, closures and the user's helpers it calls (library code
by its version), values by their contents, and a model by its structure; see NOTE [ What a trace
depends on ] below for the list. A model given as a factory is described by the factory itself (its
code, the code of the classes and helpers it calls, and its arguments: a preset's knobs, a hub model's
config), without building it; a model given as an instance, or a factory closing over something
indescribable, is built on the meta device (on fake tensors if meta refuses) and described by its
structure. A factory whose model depends on what it reads from files is keyed by its code only: set
``BATCHFIT_CACHE=0`` if such a file changes between runs. Storing what the keys name is ``memory/cache/__init__.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import os
import pickle
import platform
import sys
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import _version

if TYPE_CHECKING:
    from ...workload import Workload

# NOTE [ What a trace depends on ]
# A trace is a function of: the model (its modules' classes and the code of their methods, every
# parameter's and buffer's shape, dtype and trainability, the simple attributes that steer a forward,
# such as a dropout rate or a head count), the batch function, the loss and the optimizer (their code,
# and the values their closures, ``functools.partial`` arguments and the module-level names they read
# hold: a width set from argv or in a notebook cell is a new key when it changes), the batch size, the
# precision, the checkpointed classes, the accumulation count, the zero-grad mode, the parallel layout
# and its tensor-parallel plan, the device's kernel model (cuBLAS workspaces, CPU thread count and
# machine for CPU kernels), whether deep models are traced cut and written at full depth
# (``memory/synthesis/depth.py``), and the versions of batchfit, torch and transformers. All of it goes into the
# key (the versions, fixed for a process, into the name of its file on disk: ``installed``); anything
# that cannot be described (an object with no stable description) makes the workload uncacheable
# rather than risk a stale answer.

_FORMAT = 6
"""Bumped whenever ``MemoryTrace``'s layout or what a trace records changes."""
_SIMPLE = (int, float, bool, str, bytes, type(None), complex)


class Uncacheable(Exception):
    """Part of a workload has no stable description (its trace is computed every time)."""


# -- describing code and values ------------------------------------------------------------------
def _code_digest(code: types.CodeType, seen: set[int]) -> list[Any]:
    parts: list[Any] = [code.co_code, code.co_names, code.co_varnames, code.co_freevars]
    for const in code.co_consts:
        parts.append(_code_digest(const, seen) if isinstance(const, types.CodeType) else _describe(const, seen))
    return parts


def _is_library(obj: Any) -> bool:
    """Code from torch, the standard library or site-packages: keyed by its version, not its bytes."""
    module = getattr(obj, "__module__", None) or ""
    root = module.split(".")[0]
    if root in sys.stdlib_module_names or root in ("torch", "builtins", "functools", "typing"):
        return True
    file = getattr(sys.modules.get(module), "__file__", None) or ""
    return "site-packages" in file or "dist-packages" in file


def _is_own(obj: Any) -> bool:
    """batchfit's own code: its source is in every key already (``_own_source``), so a function of it is
    described by its name and the values it closes over or reads, not by its bytecode and callees."""
    module = getattr(obj, "__module__", None) or ""
    return module == "batchfit" or module.startswith("batchfit.")


def _file_digest(module_name: str | None) -> str:
    """The digest of a user module's source file (any edit to it is a new key; "" for none)."""
    module = sys.modules.get(module_name or "")
    path = getattr(module, "__file__", None)
    if not path:
        return ""
    try:
        stat = os.stat(path)
    except OSError:
        return ""
    key = (path, stat.st_mtime_ns, stat.st_size)
    digest = _FILES.get(key)
    if digest is None:
        with open(path, "rb") as f:
            digest = _FILES[key] = hashlib.sha256(f.read()).hexdigest()
    return digest


_FILES: dict[tuple[str, int, int], str] = {}


def _is_library_module(module: types.ModuleType) -> bool:
    root = module.__name__.split(".")[0]
    file = getattr(module, "__file__", None) or ""
    return root in sys.stdlib_module_names or root == "torch" or "site-packages" in file or not file


def _function(fn: types.FunctionType, seen: set[int]) -> list[Any]:
    parts: list[Any] = ["fn", fn.__module__, fn.__qualname__]
    if _is_library(fn):
        return parts
    own = _is_own(fn)
    if not own:
        parts.append(_file_digest(fn.__module__))
    parts.append(_code_digest(fn.__code__, seen))  # two lambdas of one function share a name, not code
    parts.append(_describe(fn.__defaults__, seen))
    parts.append(_describe(fn.__kwdefaults__, seen))
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            parts.append("<empty>")
            continue
        parts.append(_watched(lambda c=cell: c.cell_contents, contents, _describe(contents, seen)))
    # The module-level names it reads: the user's helpers and classes by their code, values (a width
    # read from argv or set in a notebook cell) by their contents; library code by its version.
    for name in _global_names(fn.__code__):
        if name not in fn.__globals__:
            continue  # a builtin
        value = fn.__globals__[name]
        if isinstance(value, types.ModuleType) or (callable(value) and (_is_library(value) or own)):
            continue  # own code reading its own functions and classes: in _own_source already
        read = functools.partial(fn.__globals__.get, name, _GONE)
        parts.append((name, _watched(read, value, _global_value(value, seen))))
    return parts


_GONE = object()
_WATCH: list[tuple[Callable[[], Any], Any, Any]] | None = None
"""While a workload's digest is computed: every variable it read (a global, a closure's cell), so that
the digest kept for the workload object is used again only while they hold what they held."""


def _watched(read: Callable[[], Any], value: Any, description: Any) -> Any:
    """``description``, with ``read`` remembered for the digest's memo: the variable's value by identity,
    and a mutable one (a config dict, a dataclass) by its description as well."""
    import torch

    if _WATCH is not None:
        immutable = isinstance(value, (*_SIMPLE, types.FunctionType, type, torch.nn.Module, functools.partial))
        _WATCH.append((read, value, None if immutable else description))
    return description


def _unchanged(watch: tuple[tuple[Callable[[], Any], Any, Any], ...]) -> bool:
    for read, value, description in watch:
        try:
            now = read()
            if now is not value or (description is not None and _describe(now) != description):
                return False
        except (ValueError, Uncacheable):  # a cell emptied; a value that no longer has a description
            return False
    return True


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` and the code nested in it (lambdas, comprehensions) load; attribute
    names (``self.weight``) are not globals and do not count."""
    import dis

    names: set[str] = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str):
            names.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


def _global_value(value: Any, seen: set[int]) -> Any:
    """A global's description; a model instance by its structure (what a batch function reading its
    config depends on), anything indescribable (a tensor, an open file) makes the workload uncacheable."""
    import torch

    if isinstance(value, torch.nn.Module):
        return describe_model(value)
    return _describe(value, seen)


def _class(cls: type, seen: set[int]) -> list[Any]:
    parts: list[Any] = ["cls", cls.__module__, cls.__qualname__]
    if _is_library(cls):
        return parts
    parts.append(_file_digest(cls.__module__))
    for klass in cls.__mro__:
        if _is_library(klass):
            continue
        for name, value in sorted(vars(klass).items()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if _is_own(klass) and not isinstance(value, _SIMPLE):
                continue  # own methods: in _own_source; class-level values still count
            if isinstance(value, types.FunctionType):
                parts.append((klass.__qualname__, name, _function(value, seen)))
            elif isinstance(value, property) and value.fget is not None:
                parts.append((klass.__qualname__, name, _function(value.fget, seen)))
            elif isinstance(value, _SIMPLE):
                parts.append((klass.__qualname__, name, value))
    return parts


def _describe(obj: Any, seen: set[int] | None = None) -> Any:
    """A nested, picklable description of ``obj`` that changes whenever its behaviour could.

    Raises:
        Uncacheable: an object with no stable description (an arbitrary instance, a tensor).
    """
    seen = set() if seen is None else seen
    if isinstance(obj, _SIMPLE):
        return obj
    if obj is getattr(dataclasses, "_HAS_DEFAULT_FACTORY", None):  # a dataclass __init__'s default_factory marker
        return "<default factory>"
    key = id(obj)
    if key in seen:  # recursion (a function calling itself, mutually recursive helpers)
        return ("<seen>", getattr(obj, "__qualname__", type(obj).__name__))
    seen.add(key)
    try:
        if isinstance(obj, (list, tuple)):
            return (type(obj).__name__, [_describe(v, seen) for v in obj])
        if isinstance(obj, (set, frozenset)):
            return ("set", sorted(repr(_describe(v, seen)) for v in obj))
        if isinstance(obj, dict):
            return ("dict", sorted((repr(k), _describe(v, seen)) for k, v in obj.items()))
        if isinstance(obj, functools.partial):
            return ("partial", _describe(obj.func, seen), _describe(obj.args, seen), _describe(obj.keywords, seen))
        if isinstance(obj, types.FunctionType):
            return _function(obj, seen)
        if isinstance(obj, types.MethodType):
            return ("method", _describe(obj.__func__, seen), _describe(obj.__self__, seen))
        if isinstance(obj, type):
            return _class(obj, seen)
        if isinstance(obj, types.ModuleType):  # a user's module: its source (a library's: its version)
            return ("module", obj.__name__, "" if _is_library_module(obj) else _file_digest(obj.__name__))
        if isinstance(obj, types.BuiltinFunctionType):
            return ("builtin", getattr(obj, "__module__", None), getattr(obj, "__qualname__", obj.__name__))
        return _instance(obj, seen)
    finally:
        seen.discard(key)


def _instance(obj: Any, seen: set[int]) -> Any:
    import enum

    import torch

    if isinstance(obj, (torch.dtype, torch.device, torch.memory_format, torch.layout, enum.Enum)):
        return ("value", type(obj).__name__, str(obj))
    if hasattr(obj, "to_json_string") and callable(obj.to_json_string):  # a transformers config
        return ("config", type(obj).__qualname__, obj.to_json_string(use_diff=False))
    if inspect.isclass(type(obj)) and hasattr(obj, "__dataclass_fields__"):
        fields = {name: getattr(obj, name) for name in obj.__dataclass_fields__}
        return ("dataclass", _class(type(obj), seen), _describe(fields, seen))
    if callable(obj) and not isinstance(obj, torch.nn.Module):
        state = getattr(obj, "__dict__", None)
        if state is not None:
            return ("callable", _class(type(obj), seen), _describe(dict(state), seen))
    raise Uncacheable(f"no stable description for a {type(obj).__qualname__}")


# -- the model -------------------------------------------------------------------------------------
def describe_model(model: Any) -> Any:
    """The structure a trace depends on: classes (and their code), shapes, dtypes, simple attributes."""
    import torch

    seen_classes: dict[type, Any] = {}
    rows = []
    for name, module in model.named_modules():
        cls = type(module)
        if cls not in seen_classes:
            seen_classes[cls] = _class(cls, set())
        tensors = [
            (k, tuple(t.shape), str(t.dtype), bool(t.requires_grad), tuple(t.stride()))
            for k, t in [*module._parameters.items(), *module._buffers.items()]
            if t is not None
        ]
        simple = sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, _SIMPLE))
        rows.append((name, cls.__module__, cls.__qualname__, tensors, simple))
    ties = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    shared = sorted(tuple(names) for names in ties.values() if len(names) > 1)
    classes = sorted((c.__module__, c.__qualname__, repr(d)) for c, d in seen_classes.items())
    return ("model", rows, shared, classes, str(torch.get_default_dtype()))


def _digest(obj: Any) -> str:
    return hashlib.sha256(pickle.dumps(obj, protocol=4)).hexdigest()


_PACKAGE = Path(__file__).resolve().parents[2]
"""``src/batchfit``: this file is ``memory/cache/keys.py`` inside it."""


def own_files() -> list[Path]:
    """Every source file of the batchfit package (the whole package, not only ``memory/cache/``)."""
    return sorted(_PACKAGE.rglob("*.py"))


@functools.cache
def _own_source() -> str:
    """A digest of batchfit's own source files: a changed estimator never reuses an old trace."""
    h = hashlib.sha256()
    for path in own_files():
        h.update(str(path.relative_to(_PACKAGE)).encode())
        with contextlib.suppress(OSError):
            h.update(path.read_bytes())
    return h.hexdigest()


def _settings() -> tuple[str, ...]:
    """How traces are made in this process (the key's part that can change while it runs: depth synthesis
    on or off), and the trace format."""
    from ..synthesis.stacks import synthesis_enabled

    return (f"format {_FORMAT}", f"depth synthesis {'on' if synthesis_enabled() else 'off'}")


def installed() -> tuple[str, ...]:
    """The versions of what traces are made with (batchfit's own source among them): fixed for a process,
    so only the names of the files on disk need them (``TraceCache``), and a process that keeps its traces
    in memory does not read them."""
    import torch

    versions = [_version.__version__, _own_source(),  # read when called: a new version is a new key
                torch.__version__, platform.python_version()]
    versions += [f"{name} {_installed_version(name)}" for name in ("transformers", "peft", "bitsandbytes", "torchao")]
    return tuple(versions)


@functools.cache
def _installed_version(name: str) -> str:
    """A package's installed version, read without importing it: whether a plan had imported transformers
    yet must not change the keys of the traces it stores ("-": not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def workload_digest(workload: Workload, param_dtype: Any) -> str:
    """The digest of everything about ``workload`` a trace depends on (cached per workload object).

    Raises:
        Uncacheable: some part has no stable description.
    """
    global _WATCH
    key = (id(workload), str(param_dtype))
    memo = _WORKLOAD_MEMO.get(key)
    if memo is not None and memo[0]() is workload and _unchanged(memo[2]):
        return memo[1]
    outer, _WATCH = _WATCH, []
    try:
        try:  # the factory's code and arguments: no model to build
            model_part = ("factory", _describe(workload.model), str(param_dtype))
        except Uncacheable:  # an instance, or a factory closing over something indescribable
            from ..trace.fake_step import model_structure

            model_part = describe_model(model_structure(workload, param_dtype))
        parts = (
            model_part,
            _describe(workload.batch),
            _describe(workload.loss),
            _describe(workload.optimizer),
            bool(workload.set_grads_to_none),
            _describe(getattr(workload, "items", None)),
            _describe(getattr(workload, "tp_plan", None)),
            _describe(getattr(workload, "parallel", None)),
        )
        watch = tuple(_WATCH)
    finally:
        _WATCH = outer
    digest = _digest(parts)
    try:
        _WORKLOAD_MEMO[key] = (weakref.ref(workload), digest, watch)
    except TypeError:  # not weak-referenceable: recompute next time
        pass
    return digest


_WORKLOAD_MEMO: dict[tuple[int, str], tuple[Callable[[], Any], str, tuple[Any, ...]]] = {}


def trace_key(workload: Workload, batch_size: int, device: Any, policy: Any, classes: tuple[type, ...]) -> str:
    """The cache key of one trace (see NOTE [ What a trace depends on ]).

    Raises:
        Uncacheable: the workload cannot be described.
    """
    import torch

    kernel: tuple[Any, ...]
    if device.exact:  # CPU kernels are measured on this machine, at this thread count
        kernel = ("cpu", platform.machine(), platform.processor(), torch.get_num_threads(),
                  torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "")  # fmt: skip
    else:
        from ..kernels.cudnn import CudnnFlags  # cuDNN engines (and their workspaces) follow these flags

        kernel = ("cuda", device.cublas_workspace_bytes, device.cublas_handles, device.compute_capability,
                  _describe(device.conv_workspace), _describe(device.conv_workspace_benchmark),
                  device.cudnn_benchmark, _describe(CudnnFlags.current()))  # fmt: skip
    parts = (
        _settings(),
        workload_digest(workload, policy.param_dtype),
        batch_size,
        policy.precision.value,
        [_describe(c) for c in classes],
        int(getattr(workload, "accumulation_steps", 1)),
        kernel,
    )
    return _digest(parts)
