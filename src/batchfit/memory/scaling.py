"""Predicting the trace at any batch size from two traces: the line every storage's size lies on.

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

from .trace import MemoryTrace


class TraceLine:
    """Two aligned traces and the affine size of each storage between them.

    Raises:
        ValueError: the traces do not have the same sequence of events and ops (the step's code
            depends on the batch size), so no line can be drawn.
    """

    def __init__(self, low: MemoryTrace, b_low: int, high: MemoryTrace, b_high: int) -> None:
        if b_high <= b_low:
            raise ValueError("need two traces at increasing batch sizes")
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
        self.high = high
        self.low = low
        self.b_low, self.b_high = b_low, b_high
        span = b_high - b_low
        self._base: dict[int, int] = {}
        self._slope: dict[int, tuple[int, int]] = {}  # sid -> (numerator, span)
        self.affine = True
        for s_low, s_high in zip(order_low, order_high):
            n_low, n_high = low.nbytes[s_low], high.nbytes[s_high]
            self._base[s_high] = n_low
            self._slope[s_high] = (n_high - n_low, span)

    def nbytes_at(self, b: int) -> dict[int, int]:
        """Every storage's size at batch size ``b`` (rounded up where a size is not affine)."""
        out = {}
        db = b - self.b_low
        for sid, base in self._base.items():
            num, span = self._slope[sid]
            q, r = divmod(num * db, span)
            out[sid] = max(0, base + q + (1 if r else 0))
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
            notes=h.notes, flops=self.flops_at(b), rows=h.rows, paged=h.paged,
        )  # fmt: skip


def _alloc_order(trace: MemoryTrace) -> list[int]:
    return [e for e in trace.events if e >= 0]
