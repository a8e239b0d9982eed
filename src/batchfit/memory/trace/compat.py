"""Libraries that branch on "am I being traced?" and would take another path on fake tensors.

NOTE [ Data-dependent branches seen through fake tensors ]
Fake tensors have no values, so code that asks a question about values must either refuse or guess.
transformers guesses conservatively: ``is_tracing(t)`` is true for any fake tensor, and then it
assumes an attention mask may hold padding and position ids may describe packed sequences, and
materialises a B x 1 x T x T mask that a real run with an all-ones mask and ordinary positions never
builds (SDPA runs with ``is_causal=True`` instead). A fake tensor whose value the trace knows
(``memory/trace/values.py``: small tensors such as masks and position ids are computed for real beside
their fakes) is not "tracing" for this question: transformers reads the value and takes the branch
the real run takes. For position ids without a known value, ``find_packed_sequence_indices`` is
answered "not packed", as for the ids transformers builds itself; training on packed sequences with
explicit position ids would materialise the mask for real, a case then estimated a little low.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from . import overrides
from .values import adopt, real_of


@contextlib.contextmanager
def counted_rng_states(register: Callable[[Any], Any]) -> Iterator[None]:
    """Count the RNG-state tensors activation checkpointing keeps for backward.

    ``torch.utils.checkpoint`` saves ``torch.get_rng_state()`` (a 5,056-byte CPU tensor) per
    checkpointed block to replay dropout identically in the recomputation; it is made by the
    generator directly, never by an op, so the dispatch-level tracker would not see it.
    """
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        register(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _grouped_mm_meta(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten::_grouped_mm``'s output, for any float dtype (the shapes of ``_meta_registrations.py``'s
    ``_create_grouped_mm_output_tensor``; the CPU layout, contiguous)."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]  # (groups, m, n)
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]  # (tokens, n)
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return mat_a.new_empty(size, dtype=out_dtype or mat_a.dtype)


@contextlib.contextmanager
def fake_kernel_fixes() -> Iterator[None]:
    """Meta kernels stricter than the CPU kernels they stand for, relaxed for the trace.

    ``aten::_grouped_mm`` (mixture-of-experts layers in transformers run their experts through it):
    its meta kernel accepts bf16 only (the restriction of early CUDA kernels), while the CPU kernel,
    and CUDA's on recent torch, take fp32 and fp16 too; a fp32 MoE model would fail to trace.
    """
    import torch._meta_registrations as meta_registrations

    if hasattr(torch.ops.aten, "_grouped_mm"):
        strict = getattr(meta_registrations, "meta_grouped_mm", _grouped_mm_meta)  # torch's own, outside traces
        overrides.register("relaxed meta", "_grouped_mm", "Meta", _grouped_mm_meta, strict)
    with overrides.enabled("relaxed meta"):
        yield


_LRU_WRAPPERS: tuple[int, list[Any], list[Any]] = (-1, [], [])


def _lru_wrappers() -> tuple[list[Any], list[Any]]:
    """The ``functools.lru_cache`` wrappers of code that works with tensors, and those of modelling code
    (modules that define an ``nn.Module``), found once per set of imported modules.

    Read from the modules' namespaces (module-level functions, class methods, and the caches a decorator
    keeps in its closure), each module once: that is where code keeps a cache that outlives a call, and
    it sees what a process that called ``gc.freeze()`` (a server preloading its models, a test suite)
    hides from the collector. Read are the packages that can hand a model a tensor: those that define
    a layer or import torch (``_tensor_packages``); torch's, the standard library's and batchfit's own
    caches are left alone (they hold dtypes, ops and shapes), as are those of packages torch does not
    reach (sympy's, numpy's). A scan of every object the collector tracks found the same caches and
    cost a model's estimate a tenth of a second.
    """
    global _LRU_WRAPPERS
    if _LRU_WRAPPERS[0] != len(sys.modules):
        every: dict[int, Any] = {}
        layers: dict[int, Any] = {}
        packages = _tensor_packages()
        for name, module in list(sys.modules.items()):
            if name.partition(".")[0] not in packages and name != "__main__":
                continue
            caches, defines_layers = _module_caches(name, module)
            for w in caches:
                every[id(w)] = w
                if defines_layers:
                    layers[id(w)] = w
        _LRU_WRAPPERS = (len(sys.modules), list(every.values()), list(layers.values()))
    return _LRU_WRAPPERS[1], _LRU_WRAPPERS[2]


def _tensor_packages() -> set[str]:
    """Top-level packages with a module that binds ``torch`` or defines an ``nn.Module`` subclass."""
    found = set()
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top in found or _left_alone(top):  # a package is read whole or not at all: one module decides
            continue
        try:
            if "torch" in vars(module):
                found.add(top)
        except TypeError:  # a module object without a namespace
            continue
    classes = [torch.nn.Module]
    while classes:
        for sub in type.__subclasses__(classes.pop()):
            found.add(str(getattr(sub, "__module__", "")).partition(".")[0])
            classes.append(sub)
    return {p for p in found if not _left_alone(p)}


def _module_caches(name: str, module: Any) -> tuple[list[Any], bool]:
    """A module's caches and whether it defines layers, read once (a namespace is complete once
    imported; ``__main__``, still being written, is read each time); only modules of
    ``_tensor_packages`` and ``__main__`` are asked for."""
    found = _MODULE_CACHES.get(name)
    if found is None:
        found = _read_module(module)
        if name != "__main__":
            _MODULE_CACHES[name] = found
    return found


def _left_alone(top: str) -> bool:
    return top in ("torch", "batchfit") or top in sys.stdlib_module_names


def _caches_imported_since(count: int) -> list[Any]:
    """The caches of the modules imported after the first ``count`` (read from their namespaces: a
    trace that imports modules needs no second pass over the others), of packages that can hold a
    tensor (``_tensor_packages``, read again: a module the trace imported may be the first to bind
    ``torch``)."""
    new = list(sys.modules.items())[count:]
    packages = _tensor_packages() if new else set()
    found = []
    for name, module in new:
        if name.partition(".")[0] in packages or name == "__main__":
            found += _module_caches(name, module)[0]
    return found


_MODULE_CACHES: dict[str, tuple[list[Any], bool]] = {}


def _read_module(module: Any) -> tuple[list[Any], bool]:
    """The ``lru_cache`` wrappers of a module's functions and of its classes' methods, including those a
    decorator keeps in its closure (transformers' ``compile_compatible_method_lru_cache``), and whether
    it defines a layer (an ``nn.Module``); one pass over its namespace."""
    try:
        name = module.__name__
        caches: list[Any] = []
        layers = False
        for value in list(vars(module).values()):
            if isinstance(value, type):
                if value.__module__ != name:
                    continue
                layers = layers or issubclass(value, torch.nn.Module)
                for member in list(vars(value).values()):
                    _add_caches(member, caches)
            elif getattr(value, "__module__", None) == name:
                _add_caches(value, caches)
        return caches, layers
    except Exception:  # an attribute that raises when read (a proxy): no cache or layer of ours to find there
        return [], False


def _add_caches(member: Any, caches: list[Any]) -> None:
    kind = type(member)
    if kind is staticmethod or kind is classmethod:
        member = member.__func__
        kind = type(member)
    if kind is _LRU_WRAPPER:
        caches.append(member)
    elif kind is _FUNCTION:
        for cell in member.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if type(content) is _LRU_WRAPPER:
                caches.append(content)


_LRU_WRAPPER = functools._lru_cache_wrapper
_FUNCTION = type(_read_module)


@contextlib.contextmanager
def fakes_kept_out_of_caches() -> Iterator[None]:
    """Trace and real run each compute what a model caches, as a fresh process would.

    Models cache tensors in module-level ``lru_cache``s (transformers' BEiT caches its relative
    position index by window size). A cache filled during the trace holds *fake* tensors, which the
    user's next real step would be handed; a cache filled by an earlier real run would hand the
    trace a real tensor it never allocates, so the estimate would depend on what ran before it in
    the process. The caches of modelling code (modules that define layers) are cleared before the
    trace, and every cache that stored something new during it is cleared afterwards, so both runs
    compute their own (the real run as it would in a fresh process: the first step, the larger).
    """
    every, of_layers = _lru_wrappers()
    for w in of_layers:
        w.cache_clear()
    before = {id(w): w.cache_info().misses for w in (*every, *of_layers)}
    imported = len(sys.modules)
    try:
        yield
    finally:
        # Caches of modules the trace imported (transformers imports lazily) count from zero.
        for w in (*every, *of_layers, *_caches_imported_since(imported)):
            if w.cache_info().misses != before.get(id(w), 0):
                w.cache_clear()


def _real_long(t: torch.Tensor, fallback: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The real value of a small CPU int64 tensor of the trace (``fallback()`` when it is unknown)."""
    if not isinstance(t, FakeTensor):
        return t
    value = real_of(t)
    if value is None:
        with _disable_current_modes():
            value = fallback()
    return value


def _pad_packed(data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: Any,
                total_length: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``aten::_pad_packed_sequence`` op for op as ``PackedSequence.cpp`` runs it, with the batch
    sizes read in Python (the C++ composite reads them, and writes the lengths, through raw pointers)."""
    sizes = _real_long(batch_sizes, lambda: torch.ones(batch_sizes.shape, dtype=torch.int64)).tolist()
    max_batch, real_steps = sizes[0], len(sizes)
    steps = max(total_length, real_steps) if total_length > 0 else real_steps
    output = torch.full((steps, max_batch, *data.shape[1:]), padding_value, dtype=data.dtype)
    lengths = [0] * max_batch
    offset, prev_batch, prev_i = 0, max_batch, 0
    for i in range(real_steps + 1):
        batch = sizes[i] if i != real_steps else 0
        if batch != prev_batch:
            n = prev_batch * (i - prev_i)
            block = data[offset : offset + n].view(i - prev_i, prev_batch, *data.shape[1:])
            output[prev_i:i, :prev_batch].copy_(block)
            offset, prev_i = offset + n, i
        for j in range(batch, prev_batch):
            lengths[j] = i
        prev_batch = batch
    if batch_first:
        output = output.transpose(0, 1)
    with _disable_current_modes():
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
    return output, lengths_t


def _pack_padded_backward(grad: torch.Tensor, input_size: Any, batch_sizes: list[int],
                          batch_first: bool) -> torch.Tensor:  # fmt: skip
    """``aten::_pack_padded_sequence_backward`` as ``PackedSequence.cpp`` runs it, sizes known in Python."""
    size = list(input_size)
    if batch_first:
        size[0], size[1] = size[1], size[0]
    grad_input = torch.zeros(size, dtype=grad.dtype)
    offset = 0
    for i, b in enumerate(batch_sizes):
        grad_input[i][:b].copy_(grad[offset : offset + b])
        offset += b
    return grad_input.transpose(0, 1) if batch_first else grad_input


class _Pack(torch.autograd.Function):
    """``_pack_padded_sequence`` on real lengths, with its backward in Python: the C++ backward reads
    the batch sizes it saved through a raw pointer, and under a trace those would be fake."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> Any:
        vf_pack = torch._C._VariableFunctions._pack_padded_sequence
        data, batch_sizes = vf_pack(input, lengths, batch_first)
        if isinstance(batch_sizes, FakeTensor):
            with _disable_current_modes():
                dummy = torch.zeros(int(lengths.max()), lengths.numel(), 1)  # (t, b, 1): only its shape matters
                real = vf_pack(dummy, lengths, False)[1]
            adopt(batch_sizes, real)
            batch_sizes = real
        ctx.input_size = tuple(input.shape)
        ctx.batch_sizes = batch_sizes.tolist()
        ctx.batch_first = batch_first
        ctx.mark_non_differentiable(batch_sizes)
        return data, batch_sizes

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:
        return _pack_padded_backward(grad, ctx.input_size, ctx.batch_sizes, ctx.batch_first), None, None


@contextlib.contextmanager
def packed_sequences() -> Iterator[None]:
    """Run the packed-sequence kernels on real lengths and batch sizes.

    ``_pack_padded_sequence``, ``_pad_packed_sequence``, the first's backward and the packed RNN
    kernels read ``lengths`` / ``batch_sizes`` (small CPU int64 tensors) through raw pointers, below
    the dispatcher, so fake ones fail ("data is not allocated") where no mode can answer. The lengths'
    value is usually known to the trace (``memory/trace/values.py``; unknown lengths are taken as
    full-length sequences, the most memory); the batch sizes are made by the real kernel from a
    one-feature dummy and become the value of the fake ones. What the C++ composites do through raw
    pointers runs as its Python equivalent, op for op, so autograd sees the same ops.
    """
    vf = torch._VF

    def pack(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> Any:
        full = input.shape[1] if batch_first else input.shape[0]
        lengths = _real_long(lengths, lambda: torch.full(tuple(lengths.shape), full, dtype=torch.int64))
        return _Pack.apply(input, lengths, batch_first)

    vf._pack_padded_sequence = pack
    vf._pad_packed_sequence = _pad_packed
    try:
        yield
    finally:
        del vf._pack_padded_sequence, vf._pad_packed_sequence


@contextlib.contextmanager
def library_compat() -> Iterator[None]:
    """Patch the known library branches for the duration of a trace (each with its restore)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_kernel_fixes())
        stack.enter_context(fakes_kept_out_of_caches())
        stack.enter_context(packed_sequences())
        masking = sys.modules.get("transformers.masking_utils")
        original = getattr(masking, "find_packed_sequence_indices", None)
        if masking is not None and original is not None:

            def find_packed_sequence_indices(position_ids: Any) -> Any:
                if isinstance(position_ids, FakeTensor) and real_of(position_ids) is None:
                    return None
                return original(position_ids)

            masking.find_packed_sequence_indices = find_packed_sequence_indices
            stack.callback(setattr, masking, "find_packed_sequence_indices", original)
        utils = sys.modules.get("transformers.utils.import_utils")
        is_fake = getattr(utils, "is_fake_tensor", None)
        if utils is not None and is_fake is not None:

            def is_fake_tensor(x: Any) -> bool:
                return bool(is_fake(x)) and real_of(x) is None

            utils.is_fake_tensor = is_fake_tensor
            stack.callback(setattr, utils, "is_fake_tensor", is_fake)
        yield


class _SavedNumbers(TorchFunctionMode):
    """Counts the Python numbers autograd keeps for backward as 0-d tensors (CPU targets).

    ``x * 0.5`` wraps 0.5 into an 8-byte tensor before dispatch (no dispatch mode sees it), and
    autograd saves it without calling saved-tensor hooks (wrapped numbers are exempt); the real step
    holds it until backward. After each torch function given a Python number, the ``_saved_*``
    tensors of its outputs' autograd nodes that are not fake are such numbers: they are registered.
    """

    def __init__(self, register: Callable[[Any], Any], own_pack: Callable[[Any], Any]) -> None:
        super().__init__()
        self._register = register
        self._own_pack = own_pack

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not torch.is_grad_enabled() or not any(
            isinstance(a, (int, float)) and not isinstance(a, bool) for a in (*args, *kwargs.values())
        ):
            return out
        # Reading ``_saved_*`` unpacks a saved tensor through its hooks; under other saved-tensor hooks
        # (activation checkpointing's, in a checkpointed block's forward and in its recomputation) that
        # would recompute or hold tensors. Wrapped numbers are never hooked, so there only the fields
        # whose raw saved tensor has no unpack hook are read (a torch that cannot say: none are).
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        own = top is None or top[0] == self._own_pack
        for t in out if isinstance(out, (tuple, list)) else (out,):
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if node is None:
                continue
            for name in dir(node):
                if not name.startswith("_saved_") or not (own or _unhooked(node, name)):
                    continue
                value = getattr(node, name, None)
                if isinstance(value, torch.Tensor) and value.dim() == 0 and not isinstance(value, FakeTensor):
                    self._register(value)
        return out


def _unhooked(node: Any, name: str) -> bool:
    """Whether autograd ``node``'s saved field ``name`` (``_saved_x``) was saved without hooks."""
    raw = getattr(node, "_raw" + name, None)
    return raw is not None and hasattr(raw, "unpack_hook") and raw.unpack_hook is None


@contextlib.contextmanager
def counted_saved_numbers(register: Callable[[Any], Any], own_pack: Callable[[Any], Any]) -> Iterator[None]:
    """While active, Python numbers saved for backward are counted (see ``_SavedNumbers``), in
    checkpointing's recomputations too (``_recomputations_seen_by``)."""
    mode = _SavedNumbers(register, own_pack)
    with _recomputations_seen_by(mode), mode:
        yield


def _under_mode(mode: TorchFunctionMode, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` with torch-function ``mode`` active (entered again unless it already is)."""
    from torch.overrides import _get_current_function_mode_stack

    if any(m is mode for m in _get_current_function_mode_stack()):
        return call(*args)
    with mode:
        return call(*args)


@contextlib.contextmanager
def _recomputations_seen_by(mode: TorchFunctionMode) -> Iterator[None]:
    """Activation checkpointing recomputes a block inside backward, where the autograd engine does not
    carry torch-function modes (dispatch modes it does): the numbers that recomputation saves would go
    uncounted, though the real step holds them while the recomputed block's graph lives. Both of
    ``torch.utils.checkpoint``'s recomputations are run with ``mode`` entered again: the non-reentrant
    frame's ``recompute_fn`` and the reentrant ``CheckpointFunction.backward``. A torch without them
    is left as it is (those numbers, 8 bytes each, then go uncounted on CPU targets)."""
    from torch.utils import checkpoint as ck

    frame_cls = getattr(ck, "_CheckpointFrame", None)
    function_cls = getattr(ck, "CheckpointFunction", None)
    with contextlib.ExitStack() as stack:
        if frame_cls is not None:
            init = frame_cls.__init__

            def frame_init(self: Any, recompute_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
                init(self, functools.partial(_under_mode, mode, recompute_fn), *args, **kwargs)

            frame_cls.__init__ = frame_init
            stack.callback(setattr, frame_cls, "__init__", init)
        if function_cls is not None and isinstance(function_cls.__dict__.get("backward"), staticmethod):
            backward = function_cls.__dict__["backward"]

            def function_backward(ctx: Any, *args: Any) -> Any:
                return _under_mode(mode, backward.__func__, ctx, *args)

            function_cls.backward = staticmethod(function_backward)
            stack.callback(setattr, function_cls, "backward", backward)
        yield
