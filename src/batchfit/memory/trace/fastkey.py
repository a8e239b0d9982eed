"""The fake-tensor dispatch cache's key, computed faster: the same key, from a memo of tensor layouts.

NOTE [ Why the cache key is worth computing faster ]
``FakeTensorMode`` caches each op's output metadata by a key made of the op and its arguments' metadata
(``_cache_key``); a training step of identical layers hits that cache on almost every op. Computing the
key is then most of what a fake op costs: for each tensor argument ``extract_tensor_metadata`` builds a
seventeen-field dataclass (``suggest_memory_format``, contiguity, sparsity checks) and flattens it with
``dataclasses.fields`` and a recursive walk: about 40% of a traced step's time (the 7B step of
``benchmarks/trace_speed.py`` took 10.4 s with torch's key and 5.9 s with this one, on the same machine).

A tensor's part of the key depends only on a handful of attributes the C++ tensor answers at once
(dtype, sizes, strides, device, storage offset and bytes, flags). ``flatten_args`` keys a memo by those
and stores torch's own flattening of the first tensor seen with them, so the key is built by torch's
code and reused for every later tensor with the same layout. Containers and plain values are encoded
as ``_prep_args_for_hash`` encodes them (their type, then their value or length); anything else
(symbolic sizes, constants, sparse layouts, tensors of another mode, callables) falls back to torch's
own method for the whole argument list. ``fast_keys_match`` checks once per process, on a sample of
arguments, that the two encodings agree on the installed torch, and the fast path is used only then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

try:  # torch's dispatch-cache internals (a torch without them keeps its own method: see fast_keys_match)
    from torch._subclasses.fake_tensor import TensorMetadata, extract_tensor_metadata
except ImportError:  # pragma: no cover - older torch
    TensorMetadata = extract_tensor_metadata = None  # type: ignore[assignment,misc]
from torch.utils._python_dispatch import _disable_current_modes

_TENSOR_FIELDS = (
    "dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
    "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
    "dense_dim", "sparse_dim",
)  # fmt: skip
"""``TensorMetadata``'s fields the memo's key accounts for (a torch with others gets no fast path)."""
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_MEMO_LIMIT = 1 << 16
_MEMO: dict[tuple, tuple] = {}
"""A layout's part of the key (torch's own flattening), by the attributes it is a function of."""


class _Unusual(Exception):
    """An argument only torch's own method encodes."""


def flatten_args(mode: FakeTensorMode, result: list, args: Any, state: Any) -> bool:
    """Append ``args``' part of ``mode``'s cache key to ``result``, as ``_prep_args_for_hash`` would;
    False (``result`` untouched) when an argument needs torch's own method."""
    out: list = []
    try:
        _container(mode, out, args, state)
    except _Unusual:
        return False
    result.extend(out)
    return True


def _container(mode: FakeTensorMode, out: list, args: Any, state: Any) -> None:
    if isinstance(args, dict):
        out += (type(args), f"length_{len(args)}")
        _items(mode, out, args.keys(), state)
        _items(mode, out, args.values(), state)
        return
    if isinstance(args, (list, tuple)):
        out += (type(args), f"length_{len(args)}")
    _items(mode, out, args, state)


def _items(mode: FakeTensorMode, out: list, items: Iterable[Any], state: Any) -> None:
    for arg in items:
        kind = type(arg)
        if kind in _PLAIN:
            out += (kind, arg)
        elif kind is FakeTensor:
            out += _tensor(mode, arg, state)
        elif kind is tuple or kind is list or kind is torch.Size or kind is dict:
            _container(mode, out, arg, state)
        else:
            raise _Unusual


def _tensor(mode: FakeTensorMode, t: FakeTensor, state: Any) -> tuple:
    if t.fake_mode is not mode or t.constant is not None or t.layout is not torch.strided:
        raise _Unusual
    if t._has_symbolic_sizes_strides:
        raise _Unusual
    key = (
        t.dtype, t.shape, t.stride(), t.device, t.storage_offset(), t.untyped_storage().nbytes(), t.requires_grad,
        t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference(),
    )  # fmt: skip
    flat = _MEMO.get(key)
    if flat is None:
        parts: list = []
        extract_tensor_metadata(t)._flatten_into(parts, mode, state)
        if len(_MEMO) >= _MEMO_LIMIT:
            _MEMO.clear()
        flat = _MEMO[key] = tuple(parts)
    return flat


_MATCHES: bool | None = None


def fast_keys_match() -> bool:
    """Whether ``flatten_args`` gives torch's own key on this torch (checked once per process)."""
    global _MATCHES
    if _MATCHES is None:
        try:
            _MATCHES = _check()
        except Exception:  # noqa: BLE001 - any surprise in torch's internals: keep torch's own method
            _MATCHES = False
    return _MATCHES


def _check() -> bool:
    from torch._subclasses._fake_tensor_utils import _CacheKeyState

    if TensorMetadata is None:
        return False
    names = tuple(f.name for f in dataclasses.fields(TensorMetadata))
    if names != _TENSOR_FIELDS:
        return False
    reference = FakeTensorMode()  # torch's own method, for both the sample and the memo's entries
    with _disable_current_modes():  # first called inside a traced op: its modes set aside
        # Fakes of meta tensors: the layouts a trace's fakes have, without running fake kernels for them.
        def fake(t: torch.Tensor) -> Any:
            return reference.fake_tensor_converter.from_meta_and_device(reference, t, torch.device("cpu"))

        x = torch.empty(2, 3, 4, 5, device="meta")
        leaf = torch.empty(3, device="meta", requires_grad=True)
        samples: list[Any] = [
            (fake(x), 2, 1.5, True, None, "mean", torch.float16, [3, 4], (fake(x.transpose(1, 2)), fake(x[1:])),
             torch.Size([6])),  # fmt: skip
            {"dim": [0, -1], "keepdim": False, "dtype": torch.bfloat16,
             "out": fake(x.to(memory_format=torch.channels_last))},  # fmt: skip
            (fake(x.new_empty((0,), dtype=torch.int64)), fake(leaf.view(3, 1)), torch.device("cpu")),
            (),
        ]
    for args in samples:
        theirs: list = []
        ours: list = []
        reference._prep_args_for_hash(theirs, args, _CacheKeyState(), [])
        _MEMO.clear()
        if not flatten_args(reference, ours, args, _CacheKeyState()) or ours != theirs:
            return False
    _MEMO.clear()
    return True


def prep_args_for_hash(base: Callable[..., None]) -> Callable[..., None]:
    """A ``_prep_args_for_hash`` method: ``flatten_args`` where it applies, else ``base``."""

    def method(self: FakeTensorMode, result: list, args: Any, state: Any, id_hashed_objects: list) -> None:
        if not (fast_keys_match() and flatten_args(self, result, args, state)):
            base(self, result, args, state, id_hashed_objects)

    return method
