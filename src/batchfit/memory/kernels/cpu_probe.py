"""CPU kernels run for real beside the trace: their scratch, and outputs laid out as the real kernel does.

NOTE [ Why measure CPU scratch instead of modelling it ]
Fake tensors see op outputs only. Real CPU kernels also allocate inside the op, through the same
CPU allocator the profiler reports: oneDNN convolution scratchpads and weight reorders, the
per-thread buffers of the CPU flash-attention kernel and of ``native_layer_norm_backward``
(``2 x threads x N`` partial sums), the 8-byte tensor a Python scalar argument is wrapped in, and the
copy TensorIterator makes of a CPU input whose dtype differs from the op's common dtype. Their sizes
depend on the ISA oneDNN picks, on ``torch.get_num_threads()`` and on the kernel's blocking, so a
closed form per kernel would be right on one machine only. Instead, the first time the trace meets an
op signature (op, shapes, strides, dtypes, non-tensor arguments, thread count) the kernel is run once
for real under the CPU profiler (one profiler session spans the trace), and ``peak - net`` of the
allocator's running sum inside the op is the scratch to add after the op's outputs.

NOTE [ Meta kernels that disagree with CPU kernels ]
The same real run shows the outputs the CPU kernel really makes. A meta kernel is sometimes wrong
about them: ``native_batch_norm`` on bf16 input returns fp32 statistics on the CPU, bf16 ones from its
meta kernel; ``native_layer_norm_backward`` on a transposed input returns a contiguous gradient on the
CPU and a gradient strided like the input from its meta kernel, after which a ``view`` in backward
must copy on fake tensors but not on real ones. A fresh output whose dtype or strides differ from
the real kernel's is replaced, before anything sees it, by a fake laid out as the real one.

NOTE [ Replaying kernels safely ]
Inputs are zeros, except where zeros would be wrong: a small tensor whose value the trace knows
(``memory/trace/values.py``: lengths, indices, masks) is replayed with that value, and an opaque byte
tensor an earlier op produced (the oneDNN RNN ``workspace`` that ``mkldnn_rnn_layer_backward``
reads as pointers and offsets; not a byte buffer made by a factory such as ``zeros``, which 8-bit optimizer
states are) is replayed with the real bytes the producer's own replay made. An op
whose opaque input has no real counterpart is not replayed (its scratch is counted as zero and the
trace says so): a kernel fed a zero-filled workspace can take the process down.

Limitations:
    Costs one real execution of each distinct op signature (about one layer of a model's step), so
    it is used for ``device="cpu"`` only; CUDA kernels are modelled in ``memory/kernels/cuda.py``. A kernel
    whose scratch depends on values the trace does not know is measured on zeros.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..measure import cpu_memory_profile
from ..trace.fake_step import real_execution
from ..trace.tracer import CPU_SCRATCH
from ..trace.tracker import sparse_tensor_error
from ..trace.values import adopt, real_of
from .gloo import COLLECTIVE_NAMESPACES, staging_bytes

_SKIP_NAMESPACES = {"profiler", *COLLECTIVE_NAMESPACES}
"""Not replayed: the profiler's markers, and collectives (a replay outside the step would leave a work
unwaited; what the CPU's backend, gloo, allocates inside one is ``memory/kernels/gloo.py``'s)."""
_FACTORIES = tuple(f"aten.{name}." for name in ("zeros", "zeros_like", "new_zeros", "empty", "empty_like", "new_empty",
                                                 "full", "full_like", "new_full"))  # fmt: skip
"""Ops whose uint8 output is a buffer made to be filled (8-bit optimizer states), not a kernel's opaque
workspace: replayed with zeros like any other input."""
_MARK = "batchfit_probe_"


@dataclass(frozen=True)
class _Out:
    """What the real kernel made for one output."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise sparse_tensor_error()
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset())
    if isinstance(x, torch.Generator):
        return ("G",)
    return x


@contextlib.contextmanager
def _collector_held() -> Iterator[None]:
    """Python's cyclic garbage collector off while a replay is measured (restored after).

    NOTE [ No garbage collection inside a measured replay ]
    The collector runs when Python allocates, and it does so inside the measured window, when the
    replay's outputs are wrapped. A cycle it breaks there may hold a CPU tensor made under this profile
    (by an earlier op of the trace), and that free lowers the window's net: it would show as scratch
    of whichever op the collector happened to interrupt, so the trace would depend on what the process
    ran before it. Held off, the window holds the kernel's own events only.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _zeros(spec: Any) -> Any:
    _, shape, stride, dtype, offset = spec
    need = offset + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) + 1 if all(shape) else 0
    base = torch.zeros(max(need, 0), dtype=dtype)
    return base.as_strided(shape, stride, offset) if need else torch.empty_strided(shape, stride, dtype=dtype)


class CpuScratchProbe:
    """Runs each new op signature for real during the trace (see the NOTEs above)."""

    def __init__(self) -> None:
        self._index: dict[Any, int] = {}  # signature -> replay number
        self._real_outputs: dict[Any, list[_Out] | None] = {}  # signature -> outputs (None: not replayed)
        self._opaque: dict[int, torch.Tensor] = {}  # trace storage id -> real bytes of an opaque output
        self._scratch: list[tuple[int, Any]] = []  # (scratch sid, signature)
        self._outputs: list[tuple[list[int | None], Any]] = []  # (new output sids, signature)
        self._pending_opaque: dict[Any, list[torch.Tensor | None]] = {}
        self._prof: Any = None
        self._prof_cm: Any = None
        self.scratch_bytes: dict[Any, int] = {}
        self.output_bytes: dict[Any, list[int]] = {}
        self.failed: dict[Any, str] = {}
        """Signatures not measured, and why."""

    # -- lifecycle: one profiler session spans the trace ------------------------------------------
    def start(self) -> None:
        self._prof_cm = cpu_memory_profile()
        with real_execution():
            self._prof = self._prof_cm.__enter__()

    def stop(self) -> None:
        if self._prof_cm is not None:
            with real_execution():
                self._prof_cm.__exit__(None, None, None)
            self._prof_cm = None

    # -- during the trace ---------------------------------------------------------------------------
    def _key(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, list[Any], Any]:
        flat, treespec = tree_flatten((args, kwargs))
        # Factory ops without a dtype argument (randn, empty) take the default dtype, which bf16-true
        # training changes; it is part of the signature and restored when the op is replayed.
        specs = [_spec(x) for x in flat] + [("default_dtype", torch.get_default_dtype())]
        try:
            key = (str(func), tuple(specs), torch.get_num_threads(), torch.is_grad_enabled())
            hash(key)
        except TypeError:  # an unhashable argument: describe it by its repr
            key = (str(func), repr(specs), torch.get_num_threads(), torch.is_grad_enabled())
        return key, flat, treespec

    def fix_outputs(self, tracer: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Replay a new signature now; lay fresh fake outputs out as the real kernel did."""
        if getattr(func, "namespace", "aten") in _SKIP_NAMESPACES or getattr(func, "is_view", False):
            return out
        key, flat, treespec = self._key(func, args, kwargs)
        if key not in self._real_outputs:
            self._replay(tracer, key, func, flat, treespec)
        real = self._real_outputs.get(key)
        if real is None:
            return out
        fakes = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if len(fakes) != len(real):
            return out
        inputs = {id(a.untyped_storage()) for a in flat if isinstance(a, torch.Tensor)}
        swap: dict[int, torch.Tensor] = {}
        for fake, r in zip(fakes, real):
            if id(fake.untyped_storage()) in inputs:
                continue
            relaid = tuple(fake.shape) == r.shape and (tuple(fake.stride()) != r.stride or fake.dtype != r.dtype)
            # A buffer whose size only the kernel knows (an RNN workspace) comes out of its meta kernel empty.
            sized = fake.numel() == 0 and math.prod(r.shape) > 0 and fake.dtype == r.dtype
            if relaid or sized:
                new = torch.empty_strided(r.shape, r.stride, dtype=r.dtype)
                value = real_of(fake)
                if value is not None and value.dtype == r.dtype:
                    adopt(new, value)
                swap[id(fake)] = new
        if not swap:
            return out
        return tree_map(lambda t: swap.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)

    def _real_input(self, tracer: Any, x: Any) -> tuple[bool, Any]:
        """``(ok, value)``: the real value to replay ``x`` with (``ok`` False: no safe value exists)."""
        if not isinstance(x, torch.Tensor):
            return True, torch.Generator().manual_seed(0) if isinstance(x, torch.Generator) else x
        sid = tracer.storage_id(x)
        if sid is not None and sid in self._opaque:
            kept = self._opaque[sid]
            with real_execution():
                return True, torch.empty(0, dtype=x.dtype).set_(
                    kept.untyped_storage(), x.storage_offset(), x.shape, x.stride()
                )
        made_by = tracer.trace.op.get(sid, "") if sid is not None else ""
        if x.dtype == torch.uint8 and made_by.startswith("aten.") and not made_by.startswith(_FACTORIES):
            return False, None  # an opaque buffer an op made (a workspace): zeros could crash the kernel
        value = real_of(x)
        if value is not None:
            with real_execution():
                return True, value.clone()
        with real_execution():
            return True, _zeros(_spec(x))

    def _replay(self, tracer: Any, key: Any, func: Any, flat: list, treespec: Any) -> None:
        inputs = []
        for x in flat:
            ok, value = self._real_input(tracer, x)
            if not ok:
                self._real_outputs[key] = None
                self.failed[key] = "an opaque input (a kernel's workspace) has no real value to replay with"
                return
            inputs.append(value)
        index = self._index.setdefault(key, len(self._index))
        saved_dtype = torch.get_default_dtype()
        out = None
        # Under the trace's grad mode: some kernels keep what backward needs only when it is on (the
        # oneDNN RNN's workspace); the inputs never require grad, so no graph is recorded.
        with real_execution():
            torch.set_default_dtype(key[1][-1][1] if isinstance(key[1], tuple) else saved_dtype)
            args, kwargs = tree_unflatten(inputs, treespec)
            try:
                # Warm up first: oneDNN creates (and caches, per process) a primitive the first time it
                # meets a shape, allocating while it does; every later run of that shape, the user's
                # steps included, reuses it. The measured run is the warm one.
                func(*args, **kwargs)
                with _collector_held(), record_function(f"{_MARK}{index}"):
                    out = func(*args, **kwargs)
            except Exception as exc:  # a kernel that refuses synthetic inputs: count no scratch
                self.failed[key] = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                torch.set_default_dtype(saved_dtype)
        if key in self.failed:
            self._real_outputs[key] = None
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(t.layout != torch.strided for t in outs):
            raise sparse_tensor_error()
        self._real_outputs[key] = [
            _Out(tuple(t.shape), tuple(t.stride()), t.dtype, t.untyped_storage().nbytes()) for t in outs
        ]
        self.output_bytes[key] = [o.nbytes for o in self._real_outputs[key]]
        self._pending_opaque[key] = [t if t.dtype == torch.uint8 else None for t in outs]

    def after_op(self, tracer: Any, func: Any, args: tuple, kwargs: dict, out_sids: list[int | None]) -> None:
        """The tracer's hook: a pending transient scratch (and output check) per non-view op."""
        namespace = getattr(func, "namespace", "aten")
        if namespace in COLLECTIVE_NAMESPACES:
            staged = staging_bytes(func, args)
            if staged:
                tracer.add_scratch(staged, f"gloo staging of {func}", transient=True)
            return
        if namespace in _SKIP_NAMESPACES or getattr(func, "is_view", False):
            return
        key, _, _ = self._key(func, args, kwargs)
        self._scratch.append((tracer.add_scratch(0, f"{CPU_SCRATCH}{func}", transient=True), key))
        if any(sid is not None for sid in out_sids):
            self._outputs.append((out_sids, key))
        opaque = self._pending_opaque.get(key)
        if opaque and len(opaque) == len(out_sids):
            for sid, real in zip(out_sids, opaque):
                if sid is not None and real is not None:
                    self._opaque[sid] = real

    # -- after the trace ------------------------------------------------------------------------------
    def finish(self, trace: Any) -> None:
        """Write the measured scratch and the real output sizes into ``trace``."""
        self.stop()
        if self._prof is not None:
            marks = [(key, f"{_MARK}{i}") for key, i in self._index.items() if key not in self.failed]
            self.scratch_bytes.update(_scratch_by_label(self._prof, marks))
        for sid, key in self._scratch:
            trace.nbytes[sid] = self.scratch_bytes.get(key, 0)
        for sids, key in self._outputs:
            real = self.output_bytes.get(key)
            if real is None or len(real) != len(sids):
                continue
            for sid, nbytes in zip(sids, real):
                if sid is not None and nbytes > 0:
                    trace.nbytes[sid] = nbytes
        skipped = sorted({key[0] for key, why in self.failed.items() if why.startswith("an opaque")})
        for op in skipped:
            trace.notes.append(f"{op}: CPU scratch not measured (its workspace input cannot be replayed safely)")
        self._scratch.clear()
        self._outputs.clear()
        self._opaque.clear()
        self._pending_opaque.clear()
        self._prof = None


def _scratch_by_label(prof: Any, marks: Iterable[tuple[Any, str]]) -> dict[Any, int]:
    """``peak - net`` of the allocator's running sum inside each marked replay: the scratch its kernel freed."""
    events = list(prof.profiler.kineto_results.events())
    windows = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name().startswith(_MARK)}
    # Time order, ties in the profiler's order (an allocation and its free in one tick stay in that order).
    memory = sorted(((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"), key=lambda m: m[0])
    times = [t for t, _ in memory]
    out = {}
    for key, label in marks:
        if label not in windows:
            out[key] = 0
            continue
        start, end = windows[label]
        running = peak = 0
        for _, n in memory[bisect.bisect_left(times, start) : bisect.bisect_right(times, end)]:
            running += n
            peak = max(peak, running)
        out[key] = max(0, peak - running)
    return out
