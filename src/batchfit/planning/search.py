"""The search for the largest batch size that fits, given a way to ask whether one does.

Two traces (at batch sizes 2 and 3) draw a line of memory over the batch size (``memory/synthesis/scaling.py``);
the largest batch the line predicts to fit is found by bisection over replays of the allocator model,
bracketed first by the allocated bytes alone, then settled by ``verify`` (a trace, a real step, or the
line itself) at the guess and its neighbour. When the step's code depends on the batch size and no
line can be drawn, it doubles and bisects on traces. ``batchfit.fit`` sets the search up; the state of
one search (``_Search``) is never carried between calls. A search point is a batch size here; the
sequence search (``planning/seqlen.py``) reuses ``_Search`` with its points standing for lengths at a
fixed batch (``step_at``), and both answer with the ``FitResult`` defined here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError, DoesNotFitError, TraceError
from ..gpu.catalog import Device
from ..memory.estimate import Estimate, finish_estimate, read_peak, trace_for_device
from ..memory.synthesis.scaling import TraceLine
from ..memory.synthesis.sharding import shard_trace
from ..memory.trace.fake_step import MemoryTrace
from ..precision import PrecisionPolicy
from ..units import format_bytes
from .known_error import known_error_for

if TYPE_CHECKING:
    from ..workload import Workload

_MAX_BATCH = 1 << 40


@dataclass(frozen=True)
class FitAttempt:
    """One step the fitter looked at: a batch size (and a sequence length when the sequence was searched)."""

    batch_size: int
    device_total_bytes: int | None
    fits: bool
    kind: str
    """``"trace"`` (a traced step), ``"real"`` (a real step on the device) or ``"predicted"``."""
    seq_len: int | None = None
    """The sequence length of the step (``fit(..., maximize="seq_len")``); None when the batch was searched."""
    checkpointed_blocks: int | None = None
    """The first this many blocks checkpointed (``checkpointing="auto"`` looking for the fewest the answer needs);
    None: as the fit's setup says."""


@dataclass(frozen=True)
class FitResult:
    """The largest micro-batch that fits (or the longest sequence at a given batch), and how it was found."""

    max_batch_size: int
    """The largest micro-batch; with ``max_seq_len``, the batch the sequence was fitted at."""
    trials: int
    """Traced or real steps run (predictions from the line are not counted: they run no step)."""
    estimate: Estimate
    """The estimate at ``max_batch_size`` (and ``max_seq_len``)."""
    device: str
    capacity_bytes: int
    """The budget compared against ``device_total_bytes`` (total memory, less the margin)."""
    precision: str
    checkpointing: bool
    attempts: tuple[FitAttempt, ...] = field(default=())
    line: TraceLine | None = field(default=None, compare=False, repr=False)
    """The line the search drew (None when it traced its way instead); not part of ``to_dict``."""
    traces: dict[int, MemoryTrace] = field(default_factory=dict, compare=False, repr=False)
    """The traces the search ran, by batch size (by sequence length with ``max_seq_len``; one rank's,
    before sharding); not part of ``to_dict``."""
    capped: bool = False
    """The search stopped at its limit: larger batches may fit too (with ``max_seq_len``: the longest
    sequence the model takes fits)."""
    max_seq_len: int | None = None
    """The longest sequence that fits at ``max_batch_size`` (``fit(..., maximize="seq_len")``), else None."""
    seq_multiple: int = 1
    """The sequence lengths searched were multiples of this."""
    seq_unit: str = "tokens"
    """What one step of the sequence is (``samples`` for waveforms)."""
    known_error: str | None = None
    """Why part of the budget was kept free: the model's family was measured to allocate more on a GPU than
    estimated (NOTE [ Keeping a measured error free ], ``planning/known_error.py``); None: nothing kept."""
    known_error_bytes: int = 0
    """The bytes kept free for it (already taken out of ``capacity_bytes``)."""
    expandable_max_batch_size: int | None = None
    """The largest micro-batch with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, predicted from the
    line, when it is larger: the caching allocator's fragmentation, not the live tensors, stops the next
    batch (None: it is not larger, or the search ran with expandable segments or real steps)."""
    checkpointed_blocks: int | None = None
    """With ``checkpointing="auto"``: the first this many of the model's blocks checkpointed, the fewest the
    answer needs (None: every block, or none with ``checkpointing`` False); ``estimate`` is that step's."""

    def trace_at(self, batch_size: int) -> MemoryTrace | None:
        """The trace at ``batch_size``: traced, else predicted from the line (None without either)."""
        if batch_size in self.traces:
            return self.traces[batch_size]
        return self.line.at(batch_size) if self.line is not None else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the estimate as a dict, attempts as a list)."""
        return {
            "max_batch_size": self.max_batch_size,
            "trials": self.trials,
            "device": self.device,
            "capacity_bytes": self.capacity_bytes,
            "precision": self.precision,
            "checkpointing": self.checkpointing,
            "estimate": self.estimate.to_dict(),
            "attempts": [a.__dict__ for a in self.attempts],
            "capped": self.capped,
            "maximize": "batch_size" if self.max_seq_len is None else "seq_len",
            "max_seq_len": self.max_seq_len,
            "seq_multiple": self.seq_multiple,
            "seq_unit": self.seq_unit,
            "known_error": self.known_error,
            "known_error_bytes": self.known_error_bytes,
            "expandable_max_batch_size": self.expandable_max_batch_size,
            "checkpointed_blocks": self.checkpointed_blocks,
        }


class Predictor(Protocol):
    """The trace predicted at a search point: a ``TraceLine`` over batch sizes, or a curve over lengths."""

    def at(self, b: int) -> MemoryTrace: ...


class _Search:
    """Search state of one ``fit`` call (kept local: nothing is carried between calls)."""

    def __init__(
        self,
        workload: Workload,
        device: Device,
        policy: PrecisionPolicy,
        classes: tuple[type, ...],
        budget: int,
        *,
        expandable_segments: bool = False,
        reserved_only: bool = False,
        shard_over: int = 1,
        keep_known_error: bool = False,
    ) -> None:
        self.workload, self.device, self.policy, self.classes = workload, device, policy, classes
        self.budget = budget
        # Decided from the first trace, before any answer is compared with the budget.
        self.keep_known_error = keep_known_error and not device.exact
        self.known_error: str | None = None
        self.known_error_bytes = 0
        self.expandable_segments = expandable_segments
        self.reserved_only = reserved_only  # a simulated device limits what the allocator reserves
        self.shard_over = shard_over
        self.traces: dict[int, MemoryTrace] = {}
        self.estimates: dict[int, Estimate] = {}
        self._predicted: dict[tuple[int, int], tuple[Predictor, Estimate]] = {}
        """Estimates of predicted traces, by the predictor's id and the search point (the predictor kept, so that
        its id is not reused): a bisection, the check of its answer and the reported estimate replay the
        allocator once per point."""
        self.attempts: list[FitAttempt] = []
        self.trials = 0
        self.line: TraceLine | None = None
        self.progress: Callable[[str], None] | None = None

    def result(self, estimate: Estimate, **answer: Any) -> FitResult:
        """The ``FitResult`` of this search: ``answer`` (the size found, ``capped``, ...) and what it took."""
        return FitResult(
            trials=self.trials,
            estimate=estimate,
            device=self.device.name,
            capacity_bytes=self.budget,
            precision=self.policy.precision.value,
            checkpointing=bool(self.classes),
            attempts=tuple(self.attempts),
            known_error=self.known_error,
            known_error_bytes=self.known_error_bytes,
            **answer,
        )

    def batch_size_at(self, b: int) -> int:
        """The batch size of a step at search point ``b`` (here the point is the batch size)."""
        return b

    def step_at(self, b: int) -> tuple[Workload, int, str]:
        """The workload and batch size of search point ``b``, and the step in words (for progress)."""
        return self.workload, b, f"{b} item{'s' if b != 1 else ''}"

    def attempt(self, b: int, total: int | None, fits: bool, kind: str) -> FitAttempt:
        """The record of one look at search point ``b``."""
        return FitAttempt(b, total, fits, kind)

    def traced(self, b: int) -> Estimate:
        if b not in self.estimates:
            workload, batch_size, words = self.step_at(b)
            progress, text = self.progress, f"tracing a step of {words}"
            announce = None if progress is None else lambda: progress(text)
            trace = trace_for_device(workload, batch_size, self.device, self.policy, self.classes, announce)
            if self.keep_known_error:
                self._keep_known_error_free(trace)
            self.traces[b] = trace
            self.estimates[b] = self._estimate(trace, b, workload)
            self.trials += 1
            est = self.estimates[b]
            self.attempts.append(self.attempt(b, est.device_total_bytes, self.fits(est), "trace"))
        return self.estimates[b]

    def _keep_known_error_free(self, trace: MemoryTrace) -> None:
        """Take the measured error of the step's family out of the budget, once (NOTE [ Keeping a measured
        error free ])."""
        self.keep_known_error = False
        known = known_error_for(trace)
        if known is not None:
            self.known_error_bytes = int(self.budget * known.fraction)
            self.known_error = known.describe(self.known_error_bytes)
            self.budget -= self.known_error_bytes

    def real(self, b: int, step_fits: Callable[[Workload, int], bool]) -> bool:
        """Whether a real step at search point ``b`` runs (``step_fits(workload, batch_size)``), recorded."""
        workload, batch_size, _ = self.step_at(b)
        self.trials += 1
        ok = step_fits(workload, batch_size)
        self.attempts.append(self.attempt(b, None, ok, "real"))
        return ok

    def _estimate(self, trace: MemoryTrace, b: int, workload: Workload | None = None) -> Estimate:
        """The estimate of ``trace`` at search point ``b`` (of the searched workload unless ``workload``)."""
        if self.shard_over > 1:
            trace = shard_trace(trace, self.shard_over)
        return finish_estimate(
            trace,
            self.workload if workload is None else workload,
            self.batch_size_at(b),
            self.device,
            self.policy,
            self.classes,
            self.expandable_segments,
            allocator_capacity=self.budget if self.reserved_only else self.budget - self.device.context_bytes,
        )

    def fits(self, est: Estimate) -> bool:
        used = est.peak_reserved_bytes if self.reserved_only else est.device_total_bytes
        return used <= self.budget

    def predicted_estimate(self, line: Predictor, b: int) -> Estimate:
        """The estimate of the trace ``line`` predicts at search point ``b`` (replayed once per point)."""
        key = (id(line), b)
        if key not in self._predicted:
            self._predicted[key] = (line, self._estimate(line.at(b), b))
        return self._predicted[key][1]

    def predicted_fits(self, line: Predictor, b: int) -> bool:
        return self.fits(self.predicted_estimate(line, b))

    def allocated_fits(self, line: Predictor, b: int) -> bool:
        """A necessary condition, without replaying the allocator: what live tensors hold (plus the
        context) fits. The allocator reserves at least that, so a b that fails here fails for real."""
        trace = line.at(b)
        if self.shard_over > 1:
            trace = shard_trace(trace, self.shard_over)
        held = read_peak(trace, rounded=not self.device.exact).peak_bytes
        return held + (0 if self.reserved_only else self.device.context_bytes) <= self.budget


def _largest_predicted(search: _Search, line: Predictor, known_fit: int, cap: int = _MAX_BATCH) -> int:
    """The largest b up to ``cap`` predicted to fit: bracketed by the cheap allocated-bytes bound, then
    settled with the allocator model (each replay costs a pass over the trace's events; a few near the
    answer). ``known_fit`` fits (0: nothing is known to, and 0 is the answer when nothing is predicted to)."""
    lo, hi = known_fit, max(2 * known_fit, known_fit + 1)
    while hi <= cap and hi < _MAX_BATCH and search.allocated_fits(line, hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if search.allocated_fits(line, mid) else (lo, mid)
    # lo is the most the allocated bytes allow; the reserved bytes may allow a little less.
    if lo == known_fit or search.predicted_fits(line, lo):
        return lo
    hi, step = lo, 1
    while hi - step > known_fit and not search.predicted_fits(line, hi - step):
        hi, step = hi - step, step * 2
    lo = max(known_fit, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if search.predicted_fits(line, mid) else (lo, mid)
    return lo


def _does_not_fit(
    workload: Workload, device: Device, est: Estimate, budget: int, one_fails: str = "", *, at: str = "",
    remedies: tuple[str, ...] = (),
) -> DoesNotFitError:  # fmt: skip
    """``est`` is the smallest step traced: batch size 1, or 2 when ``one_fails`` says why a step of one item
    cannot run; or the shortest sequence, which ``at`` names, with the ``remedies`` that come first."""
    low = "bf16" if device.bf16 else "fp16"  # only remedies this GPU supports
    remedies = (*remedies, *([] if est.precision in (low, "bf16-true") else [f"--precision {low}"]))
    if not est.checkpointing and workload.checkpoint_blocks:
        remedies += ("--checkpointing",)
    remedies += ("more GPUs with sharding (batchfit plan --gpus N)", "a larger GPU")
    why = f"; a step of one item cannot run: {one_fails}" if one_fails else ""
    return DoesNotFitError(
        f"{workload.name} does not fit on {device.name} even at {at or f'batch size {est.batch_size}'} with precision "
        f"{est.precision}{' and checkpointing' if est.checkpointing else ''}: it needs "
        f"{format_bytes(est.device_total_bytes)} of {format_bytes(budget)}{why}; try {', '.join(remedies[:-1])} "
        f"or {remedies[-1]}"
    )


def _smallest(search: _Search, larger: Estimate | None) -> Estimate:
    """The step of one item, traced. Some steps cannot run on one item (BatchNorm after a global pooling
    needs two values per channel): when a larger step ran but did not fit, the batch does not fit at all,
    which is what the caller is told (a plan then tries its next configuration)."""
    try:
        return search.traced(1)
    except TraceError as e:
        if larger is None:
            raise
        raise _does_not_fit(search.workload, search.device, larger, search.budget, one_fails=str(e)) from e


def _search_max(search: _Search, verify: Callable[[int], bool], cap: int = _MAX_BATCH) -> int:
    """The search proper; ``verify(b)`` answers "does b fit?" by the most trusted means available.

    With ``cap`` the answer is at most ``cap`` (a plan needs no micro-batch above a rank's share), and
    nothing above it is traced or run.
    """
    if cap <= 2:
        larger = None
        if cap == 2:
            larger = search.traced(2)
            if search.fits(larger):
                return 2
        first = _smallest(search, larger)
        if search.fits(first):
            return 1
        raise _does_not_fit(search.workload, search.device, first, search.budget)
    # The line is drawn through batch sizes 2 and 3, not 1 and 2: at batch size 1 broadcasting often
    # skips reductions in backward (an expanded buffer needs no sum), so its ops differ.
    if not search.fits(search.traced(2)):
        first = _smallest(search, search.traced(2))
        if not search.fits(first):
            raise _does_not_fit(search.workload, search.device, first, search.budget)
        return 1
    if not search.fits(search.traced(3)):
        return 2
    try:
        line: TraceLine | None = TraceLine(search.traces[2], 2, search.traces[3], 3)
    except ValueError:
        line = None
    search.line = line
    if line is not None:
        guess = _largest_predicted(search, line, 3, cap)  # a plan's share caps it: nothing above is replayed
        if guess >= _MAX_BATCH - 1:
            raise ConfigError(
                "memory does not grow with the batch size; check that the workload's batch function uses its "
                "batch_size argument"
            )
    else:  # the step's code depends on the batch size: no line, a search on traces alone
        guess = _on_traces(search, cap)
    return _settle(min(guess, cap), lambda b: b <= cap and verify(b))


def _on_traces(search: _Search, cap: int) -> int:
    """The largest batch up to ``cap`` whose traced step fits, when no line can be drawn (the step's ops differ
    between batch sizes: a loss computed in chunks whose count follows the batch, ...): 3 fits.

    Each probe is where the line through two traced totals meets the budget (regula falsi: the last two fitting
    batches while nothing above is known not to fit, else the bracket's ends), so a total that grows nearly in
    proportion to the batch is found in a probe or two beside the two traces at 2 and 3; the bracket is halved
    instead when a probe moved its end no nearer than halfway, and doubled while the totals do not grow.
    """

    def total(b: int) -> int:
        return search.traced(b).device_total_bytes

    below, lo, hi = 2, 3, None  # lo fits, and so does below < lo; hi (None: none known yet) does not
    halve = False
    while hi is None or hi - lo > 1:
        if lo >= cap:
            return cap
        a, b = (below, lo) if hi is None else (lo, hi)
        slope = (total(b) - total(a)) / (b - a)
        if halve and hi is not None:
            probe = (lo + hi) // 2
        elif slope > 0:
            probe = lo + int((search.budget - total(lo)) // slope)
        else:
            probe = 2 * lo
        probe = max(lo + 1, min(probe, cap if hi is None else hi - 1))
        span = None if hi is None else hi - lo
        if search.fits(search.traced(probe)):
            below, lo = lo, probe
        else:
            hi = probe
        halve = span is not None and hi - lo > span // 2  # the probe barely moved the bracket: halve it next
    return lo


def expandable_gain(search: _Search, best: int, cap: int = _MAX_BATCH) -> int | None:
    """The largest batch up to ``cap`` the line predicts to fit with expandable segments, when it is more
    than ``best``; None otherwise.

    Only fragmentation can stop ``best + 1`` when its live tensors fit (``allocated_fits``), and expandable
    segments map pages where the next block needs them instead of cutting cached segments: the remedy costs
    no speed (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``). Replays of the line's traces only.
    """
    import copy

    line = search.line
    if line is None or search.expandable_segments or best >= cap or not search.allocated_fits(line, best + 1):
        return None
    mapped = copy.copy(search)
    mapped.expandable_segments = True
    mapped._predicted = {}  # replayed with the other allocator
    found = _largest_predicted(mapped, line, best, cap)
    return found if found > best else None


def _settle(guess: int, verify: Callable[[int], bool]) -> int:
    """The largest b with ``verify(b)``, starting at the guess: two checks when the guess is right
    (the guess fits, one more does not), else a gallop away from it and a bisection, O(log error)."""
    if verify(guess):
        lo, step = guess, 1
        while lo + step < _MAX_BATCH and verify(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, step = guess, 1
        while hi - step >= 1 and not verify(hi - step):
            hi, step = hi - step, step * 2
        lo = max(1, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if verify(mid) else (lo, mid)
    return lo
