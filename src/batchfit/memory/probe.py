"""CPU kernel scratch: memory a CPU kernel allocates and frees inside one op, measured per signature.

NOTE [ Why measure CPU scratch instead of modelling it ]
Fake tensors see op outputs only. Real CPU kernels also allocate inside the op, through the same
CPU allocator the profiler reports: oneDNN convolution scratchpads and weight reorders, the
per-thread buffers of the CPU flash-attention kernel and of ``native_layer_norm_backward``
(``2 x threads x N`` partial sums), the 8-byte tensor a Python scalar argument is wrapped in, and the
copy TensorIterator makes of a CPU input whose dtype differs from the op's common dtype. Their sizes
depend on the ISA oneDNN picks, on ``torch.get_num_threads()`` and on the kernel's blocking, so a
closed form per kernel would be right on one machine only. Instead, for each distinct op signature
(op, shapes, strides, dtypes, non-tensor arguments, thread count) the kernel is run once for real on
zero-filled inputs under the CPU profiler, and ``peak - net`` of the allocator's running sum inside
the op is the scratch to add after the op's outputs. This is exact for kernels whose scratch depends
on shapes only; a kernel whose scratch depends on values (rare: sort-based kernels) is measured on
zeros.

Limitations:
    Costs one real execution of each distinct op signature (about one layer of a model's step), so
    it is used for ``device="cpu"`` only; CUDA kernels are modelled in ``memory/cuda.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

import torch
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from .measure import cpu_memory_profile
from .trace import real_execution

_SKIP_NAMESPACES = {"profiler"}
_MARK = "batchfit_probe_"


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset())
    if isinstance(x, torch.Generator):
        return ("G",)
    return x


def _real(spec: Any) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        _, shape, stride, dtype, offset = spec
        need = offset + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) + 1 if all(shape) else 0
        base = torch.zeros(max(need, 0), dtype=dtype)
        return base.as_strided(shape, stride, offset) if need else torch.empty_strided(shape, stride, dtype=dtype)
    if isinstance(spec, tuple) and spec == ("G",):
        return torch.Generator().manual_seed(0)
    return spec


class CpuScratchProbe:
    """Collects op signatures during a trace, then measures each one in one profiler run.

    Two facts come back per signature: the scratch (``peak - net`` of the allocator's running sum
    inside the op) and the real size of each new output storage, which corrects the rare meta kernel
    that disagrees with the CPU kernel (``native_batch_norm`` on bf16 input returns fp32 statistics on
    the CPU, bf16 ones from its meta kernel).
    """

    def __init__(self) -> None:
        self._requests: dict[Any, tuple[Any, Any, Any]] = {}
        self._scratch: list[tuple[int, Any]] = []  # (scratch sid, key)
        self._outputs: list[tuple[list[int | None], Any]] = []  # (new output sids, key)
        self.scratch_bytes: dict[Any, int] = {}
        self.output_bytes: dict[Any, list[int]] = {}
        self.failed: dict[Any, str] = {}

    def after_op(self, tracer: Any, func: Any, args: tuple, kwargs: dict, out_sids: list[int | None]) -> None:
        """The tracer's hook: a pending transient scratch (and output check) per non-view op."""
        if getattr(func, "namespace", "aten") in _SKIP_NAMESPACES or getattr(func, "is_view", False):
            return
        flat, treespec = tree_flatten((args, kwargs))
        # Factory ops without a dtype argument (randn, empty) take the default dtype, which bf16-true
        # training changes; it is part of the signature and restored when the op is replayed.
        specs = [_spec(x) for x in flat] + [("default_dtype", torch.get_default_dtype())]
        try:
            key = (str(func), tuple(specs), torch.get_num_threads())
            hash(key)
        except TypeError:  # an unhashable argument: describe it by its repr
            key = (str(func), repr(specs), torch.get_num_threads())
        if key not in self._requests and key not in self.scratch_bytes:
            self._requests[key] = (func, specs, treespec)
        self._scratch.append((tracer.add_scratch(0, f"cpu scratch of {func}", transient=True), key))
        if any(sid is not None for sid in out_sids):
            self._outputs.append((out_sids, key))

    def finish(self, trace: Any) -> None:
        """Measure the pending signatures and write scratch and real output sizes into ``trace``."""
        self.measure()
        for sid, key in self._scratch:
            trace.nbytes[sid] = self.scratch_bytes.get(key, 0)
        for sids, key in self._outputs:
            real = self.output_bytes.get(key)
            if real is None or len(real) != len(sids):
                continue
            for sid, nbytes in zip(sids, real):
                if sid is not None and nbytes > 0:
                    trace.nbytes[sid] = nbytes
        self._scratch.clear()
        self._outputs.clear()

    def measure(self) -> None:
        """Run every pending signature once for real, inside one profiler session."""
        todo = list(self._requests.items())
        self._requests.clear()
        if not todo:
            return
        marks: list[tuple[Any, str]] = []
        with real_execution(), torch.no_grad():
            with cpu_memory_profile() as prof:
                for i, (key, (func, specs, treespec)) in enumerate(todo):
                    *arg_specs, (_, dtype) = specs
                    args, kwargs = tree_unflatten([_real(s) for s in arg_specs], treespec)
                    saved_dtype = torch.get_default_dtype()
                    torch.set_default_dtype(dtype)
                    label = f"{_MARK}{i}"
                    out = None
                    try:
                        with record_function(label):
                            out = func(*args, **kwargs)
                    except Exception as exc:  # a kernel that refuses zeros: count no scratch
                        self.failed[key] = f"{type(exc).__name__}: {exc}"[:200]
                    finally:
                        torch.set_default_dtype(saved_dtype)
                    if key not in self.failed:
                        self.output_bytes[key] = [
                            t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                        ]
                    marks.append((key, label))
                    del out, args, kwargs
        self.scratch_bytes.update(_scratch_by_label(prof, marks))
        for key, _ in todo:
            self.scratch_bytes.setdefault(key, 0)


def _scratch_by_label(prof: Any, marks: Iterable[tuple[Any, str]]) -> dict[Any, int]:
    events = list(prof.profiler.kineto_results.events())
    windows = {}
    for e in events:
        name = e.name()
        if name.startswith(_MARK):
            windows[name] = (e.start_ns(), e.end_ns())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
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
