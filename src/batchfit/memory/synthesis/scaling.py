"""Predicting the trace at any batch size from two traces: the line every storage's size lies on;
and at any sequence length from three: the curve (``TraceCurve``, NOTE [ Memory over the sequence length ]).

NOTE [ Why two traces are enough ]
A training step's ops do not depend on the batch size, only their shapes do; every storage's size is
then an affine function of the batch size (weights and optimizer states: constant; activations,
logits, attention: proportional). Two traces at ``b1 < b2`` with the same sequence of events give
each storage's line, and so the whole trace at any ``b``. Fed through the allocator model, that
predicted trace gives reserved memory and OOM exactly as a real trace would, without tracing again;
the fitter uses it to search, and only traces for real to verify. Code that branches on the batch
size (a different sequence of events) is detected, and the fitter falls back to tracing.
"""

from __future__ import annotations

import math
from typing import Any

from ..trace.fake_step import MemoryTrace


class TraceLine:
    """Two aligned traces and the affine size of each storage between them.

    Raises:
        ValueError: the traces do not have the same sequence of events and ops (the step's code
            depends on the batch size), so no line can be drawn.
    """

    def __init__(self, low: MemoryTrace, b_low: int, high: MemoryTrace, b_high: int) -> None:
        if b_high <= b_low:
            raise ValueError("need two traces at increasing batch sizes")
        pairs = _aligned(low, high)
        self.high = high
        self.low = low
        self.b_low, self.b_high = b_low, b_high
        span = b_high - b_low
        self._base: dict[int, int] = {}
        self._slope: dict[int, tuple[int, int]] = {}  # sid -> (numerator, span)
        self.affine = True
        self._reductions: dict[int, tuple[tuple[int, ...], tuple[int, ...], Any, int]] = {}
        """sid -> the numbers of its reduction at the two batch sizes, the reduction and the part it sizes."""
        for s_low, s_high in pairs:
            n_low, n_high = low.nbytes[s_low], high.nbytes[s_high]
            self._base[s_high] = n_low
            self._slope[s_high] = (n_high - n_low, span)
            if s_high in high.reductions and s_low in low.reductions:
                (r_low, part), (r_high, _) = low.reductions[s_low], high.reductions[s_high]
                self._reductions[s_high] = (r_low.numbers(), r_high.numbers(), r_high, part)

    def nbytes_at(self, b: int) -> dict[int, int]:
        """Every storage's size at batch size ``b`` (rounded up where a size is not affine); a CUDA reduction's
        staging sized from its input's geometry at ``b``, each number of which is affine (NOTE [ CUDA
        reduction staging ])."""
        out = {}
        db = b - self.b_low
        for sid, base in self._base.items():
            num, span = self._slope[sid]
            q, r = divmod(num * db, span)
            out[sid] = max(0, base + q + (1 if r else 0))
        span = self.b_high - self.b_low
        for sid, (low, high, reduction, part) in self._reductions.items():
            numbers = [lo + -(-(hi - lo) * db // span) for lo, hi in zip(low, high, strict=True)]
            out[sid] = reduction.with_numbers(numbers).sizes()[part]
        return out

    def flops_at(self, b: int) -> dict[tuple[str, int], int]:
        """FLOPs by phase at batch size ``b`` (on the same line as the sizes)."""
        out = {}
        span, db = self.b_high - self.b_low, b - self.b_low
        for key, high in self.high.flops.items():
            low = self.low.flops.get(key, 0)
            out[key] = max(0, low + -(-(high - low) * db // span))
        return out

    def at(self, b: int) -> MemoryTrace:
        """The predicted trace at batch size ``b``."""
        h = self.high
        return MemoryTrace(
            events=h.events, nbytes=self.nbytes_at(b), role=h.role, module=h.module, phases=h.phases, op=h.op,
            notes=h.notes, flops=self.flops_at(b), rows=h.rows, paged=h.paged, reductions=h.reductions,
        )  # fmt: skip


class TraceCurve:
    """Several aligned traces at different sequence lengths, and the polynomial size of each storage.

    NOTE [ Memory over the sequence length ]
    A storage's size is a product of dimensions, so over the sequence length ``T`` (batch fixed) it is
    a polynomial: weights and optimizer states constant, hidden states and logits ``~T``, an attention
    matrix that a kernel materialises ``~T^2`` (the math path of ``scaled_dot_product_attention``, an
    explicit softmax); CUDA's flash / memory-efficient kernels keep no ``T x T`` tensor, and the step is
    then affine in ``T``. Three traces give every storage's quadratic (Lagrange's interpolation, in
    exact integers), hence the whole trace at any ``T``, which the allocator model replays as it replays
    a ``TraceLine``'s. A size that is not polynomial (a kernel padding to a block, a workspace chosen by
    size) is predicted close, not exactly: the fitter verifies its answer with traces.

    Args:
        points: ``(length, trace)`` pairs at distinct lengths; ``len(points) - 1`` is the degree.

    Raises:
        ValueError: fewer than two points, a repeated length, or traces whose events or ops differ
            (the step's code depends on the length).
    """

    def __init__(self, points: list[tuple[int, MemoryTrace]]) -> None:
        xs = [x for x, _ in points]
        if len(xs) < 2 or len(set(xs)) != len(xs):
            raise ValueError("need two or more traces at distinct lengths")
        self.xs = xs
        self.reference = points[-1][1]
        self._sizes: dict[int, list[int]] = {}  # the reference's sid -> its size at each length
        numbers: dict[int, list[tuple[int, ...]]] = {}  # a reduction's sid -> its numbers at each length
        for _, trace in points:
            for sid, sid_ref in _aligned(trace, self.reference):
                self._sizes.setdefault(sid_ref, []).append(trace.nbytes[sid])
                if sid in trace.reductions and sid_ref in self.reference.reductions:
                    numbers.setdefault(sid_ref, []).append(trace.reductions[sid][0].numbers())
        self._numbers = {(sid, k): [ns[k] for ns in per_point] for sid, per_point in numbers.items()
                         if len(per_point) == len(xs) for k in range(len(per_point[0]))}  # fmt: skip
        self._flops = {key: [trace.flops.get(key, 0) for _, trace in points] for key in self.reference.flops}
        self._dens = [math.prod(xi - xj for xj in xs if xj != xi) for xi in xs]
        self._den = math.lcm(*(abs(d) for d in self._dens))

    def _weights(self, x: int) -> list[int]:
        """Lagrange's basis at ``x`` over the common denominator: ``size(x) = sum(w_i * y_i) / _den``."""
        xs = self.xs
        return [math.prod(x - xj for xj in xs if xj != xi) * (self._den // d) for xi, d in zip(xs, self._dens)]

    def _interpolate(self, values: dict, x: int) -> dict:
        weights, den = self._weights(x), self._den
        return {key: max(0, -(-sum(w * y for w, y in zip(weights, ys)) // den)) for key, ys in values.items()}

    def nbytes_at(self, x: int) -> dict[int, int]:
        """Every storage's size at length ``x`` (rounded up where a size falls between bytes); a CUDA
        reduction's staging sized from its input's geometry at ``x``."""
        out = self._interpolate(self._sizes, x)
        numbers = self._interpolate(self._numbers, x)
        for sid, (reduction, part) in self.reference.reductions.items():
            own = [numbers.get((sid, k)) for k in range(len(reduction.numbers()))]
            if sid in out and None not in own:
                out[sid] = reduction.with_numbers(own).sizes()[part]
        return out

    def at(self, x: int) -> MemoryTrace:
        """The predicted trace at length ``x`` (the last point's events, modules and ops)."""
        r = self.reference
        return MemoryTrace(
            events=r.events, nbytes=self.nbytes_at(x), role=r.role, module=r.module, phases=r.phases, op=r.op,
            notes=r.notes, flops=self._interpolate(self._flops, x), rows=r.rows, reductions=r.reductions,
        )  # fmt: skip


def same_step(a: MemoryTrace, b: MemoryTrace) -> bool:
    """Whether two traces run the same ops in the same order (sizes aside): a line or curve joins them."""
    try:
        _aligned(a, b)
    except ValueError:
        return False
    return True


def _aligned(low: MemoryTrace, high: MemoryTrace) -> list[tuple[int, int]]:
    """The storages of two traces of the same step paired in allocation order.

    Raises:
        ValueError: the traces differ in their sequence of events, the storages each run of frees
            releases, or the ops that allocated them.
    """
    order_low = _alloc_order(low)
    order_high = _alloc_order(high)
    if len(low.events) != len(high.events) or len(order_low) != len(order_high):
        raise ValueError("the two traces have different events")
    index_low = {sid: k for k, sid in enumerate(order_low)}
    index_high = {sid: k for k, sid in enumerate(order_high)}
    # Storages freed together (one Python statement dropping a tuple, say) may die in either order;
    # within a run of consecutive frees only the set matters to the allocator, so compare sets.
    run_low: list[int] = []
    run_high: list[int] = []
    for e_low, e_high in zip([*low.events, 0], [*high.events, 0]):
        if (e_low >= 0) != (e_high >= 0):
            raise ValueError("the two traces allocate and free in a different order")
        if e_low < 0:
            run_low.append(index_low[~e_low])
            run_high.append(index_high[~e_high])
            continue
        if sorted(run_low) != sorted(run_high):
            raise ValueError("the two traces free different storages")
        run_low.clear()
        run_high.clear()
    for s_low, s_high in zip(order_low, order_high):
        if low.op.get(s_low) != high.op.get(s_high):
            raise ValueError("the two traces run different ops")
    return list(zip(order_low, order_high))


def _alloc_order(trace: MemoryTrace) -> list[int]:
    return [e for e in trace.events if e >= 0]
