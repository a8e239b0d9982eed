"""The longest sequence that fits at a given batch: ``fit(workload, device, maximize="seq_len", batch_size=B)``.

The answer ``L`` is exact as the batch's is: ``estimate`` at ``L`` tokens fits the budget and at
``L + seq_multiple`` it does not (or ``L`` is the longest sequence the model takes: ``capped``).

NOTE [ Searching the sequence length ]
The workload is rebuilt at each length it is traced at (``Workload.at_seq_len``). The longest length
the model takes is traced first: when it fits, that is the answer, in one trace. Otherwise two more
lengths (a half and a quarter of it) are traced, and the three traces give every storage's size as a
polynomial of the length (``memory/synthesis/scaling.py``, NOTE [ Memory over the sequence length ]): affine
where attention keeps no ``T x T`` tensor (CUDA's flash kernels), quadratic where it does. The longest
length that curve predicts to fit is found by bisection over replays of the allocator model, and the
guess and its neighbour are traced: five traces when the prediction is right, as it is whenever every
size is a polynomial of the length. Otherwise the curve is redrawn through traces near the answer and
guessed again; once a guess does not halve the bracket, the search gallops away from the last guess
(a size that is nearly a polynomial, such as a strided convolution's rounded output length, leaves
the answer a few tokens off it) and never past the bracket's middle, so it costs ``O(log)`` traces
however wrong the curve was. A step whose code changes with the length (a kernel chosen by size, a
branch on the length) aligns only with some of the traces: the curve is drawn through those that run
the ops of the step at an end of the bracket, and where the bracket's two ends run different ops the
search bisects (the answer is then likely where the step changes). A model without a known limit is
traced at its own length, twice and four times it, and the curve extrapolated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..batching import check_batch_size
from ..errors import BatchfitError, ConfigError
from ..gpu.catalog import Device
from ..memory.estimate import Estimate, with_accumulation
from ..memory.synthesis.scaling import TraceCurve, same_step
from ..memory.trace.fake_step import MemoryTrace
from ..runtime.simulated import SimulatedDevice
from ..workload import Setup, Workload
from .budget import fit_setting, real_step
from .search import _MAX_BATCH, FitAttempt, FitResult, _does_not_fit, _largest_predicted, _Search, _settle

__all__ = ["check_seq_request", "fit_seq_len"]


def check_seq_request(
    workload: Workload, maximize: str, batch_size: int | None, seq_multiple: int, max_batch_size: int | None
) -> bool:
    """Whether ``fit`` is asked for the longest sequence (True) or the largest batch (False).

    Raises:
        ConfigError: one line naming the fix: an unknown ``maximize``, a sequence search without a batch
            or on a workload with no sequence, or options that belong to the other search.
    """
    target = str(maximize).strip().lower().replace("-", "_")
    if target == "batch_size":
        if batch_size is not None:
            raise ConfigError(
                "a batch size is given only with --maximize seq-len (maximize='seq_len'); without it fit finds "
                "the largest batch itself"
            )
        if seq_multiple != 1:
            raise ConfigError("--seq-multiple applies to --maximize seq-len (maximize='seq_len')")
        return False
    if target != "seq_len":
        raise ConfigError(f"maximize must be batch_size or seq_len (--maximize batch-size|seq-len), got {maximize!r}")
    if batch_size is None:
        raise ConfigError("the longest sequence is fitted at a batch you choose: pass --batch-size B (batch_size=B)")
    check_batch_size(batch_size, "--batch-size")
    check_batch_size(seq_multiple, "--seq-multiple")
    if max_batch_size is not None:
        raise ConfigError("max_batch_size applies to maximize='batch_size'; a sequence is fitted at batch_size")
    if workload.at_seq_len is None:
        raise ConfigError(
            f"{workload.name} has no sequence length to vary; --maximize seq-len needs a model with a sequence (gpt, "
            "an hf-* language preset, a hub language or speech model) or a Workload(at_seq_len=<function building "
            "it at n tokens>)"
        )
    limit = workload.max_seq_len
    if limit is not None and seq_multiple > limit:
        raise ConfigError(
            f"--seq-multiple {seq_multiple} is longer than the model's {limit} positions; pass a smaller one"
        )
    return True


class _SeqSearch(_Search):
    """A search whose point ``k`` is the step at ``batch_size`` with sequences of ``k * multiple`` tokens."""

    def __init__(self, workload: Workload, *args: Any, batch_size: int, multiple: int, **kwargs: Any) -> None:
        super().__init__(workload, *args, **kwargs)
        self.batch_size, self.multiple = batch_size, multiple
        self.unit = str(workload.config.get("seq_unit", "tokens"))
        self.curve: _InUnits | None = None
        self._rebuilt: dict[int, Workload] = {}

    def workload_at(self, k: int) -> Workload:
        """The workload rebuilt at ``k * multiple`` tokens (checked: a ``Workload``, or one clear error)."""
        if k not in self._rebuilt:
            length, base = k * self.multiple, self.workload
            try:
                rebuilt = base.at_seq_len(length)
            except BatchfitError:
                raise
            except Exception as e:
                raise ConfigError(f"{base.name}: at_seq_len({length}) raised {type(e).__name__}: {e}") from e
            if not isinstance(rebuilt, Workload):
                raise ConfigError(
                    f"{base.name}: at_seq_len({length}) returned {type(rebuilt).__name__}; it must return the "
                    "Workload at that length"
                )
            self._rebuilt[k] = with_accumulation(rebuilt, base.accumulation_steps)
        return self._rebuilt[k]

    def batch_size_at(self, k: int) -> int:
        return self.batch_size

    def step_at(self, k: int) -> tuple[Workload, int, str]:
        b = self.batch_size
        return self.workload_at(k), b, f"{b} item{'s' if b != 1 else ''} of {k * self.multiple} {self.unit}"

    def attempt(self, k: int, total: int | None, fits: bool, kind: str) -> FitAttempt:
        return FitAttempt(self.batch_size, total, fits, kind, seq_len=k * self.multiple)


class _InUnits:
    """A ``TraceCurve`` over lengths read at search points (``k`` multiples)."""

    def __init__(self, curve: TraceCurve, multiple: int) -> None:
        self.curve, self.multiple = curve, multiple

    def at(self, k: int) -> MemoryTrace:
        return self.curve.at(k * self.multiple)


def fit_seq_len(
    workload: Workload,
    device: str | Device | SimulatedDevice,
    batch_size: int,
    seq_multiple: int,
    setup: Setup,
    margin: float,
    shard_over: int,
    verify: bool,
    progress: Callable[[str], None] | None,
    known_error: bool = True,
) -> FitResult:
    """The longest sequence of ``workload`` that fits at ``batch_size`` (``fit``'s arguments, checked by
    ``check_seq_request``); see NOTE [ Searching the sequence length ]."""
    dev, budget, policy, classes = fit_setting(workload, device, margin, setup)
    step = real_step(device, budget, policy, classes)  # real steps verify the curve's guess, not traces
    search = _SeqSearch(
        workload, dev, policy, classes, budget, expandable_segments=setup.expandable_segments,
        reserved_only=isinstance(device, SimulatedDevice), shard_over=shard_over,
        batch_size=batch_size, multiple=seq_multiple, keep_known_error=known_error and step is None,
    )  # fmt: skip
    search.progress = progress
    top = None if workload.max_seq_len is None else workload.max_seq_len // seq_multiple
    own = workload.config.get("seq_len") or workload.tokens_per_item
    own = own if isinstance(own, int) and own > 0 else seq_multiple
    longest = _longest_traced(search, top, max(1, own // seq_multiple), trust_curve=step is not None or not verify)
    if step is not None:  # the guess settled by real steps on the device
        runs: dict[int, bool] = {}

        def runs_at(k: int) -> bool:
            if k not in runs:
                runs[k] = (top is None or k <= top) and search.real(k, step)
            return runs[k]

        longest = _settle(max(longest, 1), runs_at)
        longest = longest if longest > 1 or runs_at(1) else 0
    if longest == 0:
        shortest = search.traced(1)
        remedies = (f"a smaller --batch-size than {batch_size}",) if batch_size > 1 else ()
        unit = search.unit[:-1] if seq_multiple == 1 and search.unit.endswith("s") else search.unit
        at = f"batch size {batch_size} with sequences of {seq_multiple} {unit}"
        raise _does_not_fit(search.workload_at(1), dev, shortest, budget, at=at, remedies=remedies)
    est = search.estimates.get(longest) or _predicted(search, longest)
    return search.result(
        est, max_batch_size=batch_size, traces={k * seq_multiple: trace for k, trace in search.traces.items()},
        capped=longest == top, max_seq_len=longest * seq_multiple, seq_multiple=seq_multiple, seq_unit=search.unit,
    )  # fmt: skip


def _predicted(search: _SeqSearch, k: int) -> Estimate:
    """The estimate at ``k`` when real steps verified it: the curve's prediction rather than another trace."""
    if search.curve is None:
        return search.traced(k)
    return search._estimate(search.curve.at(k), k, search.workload_at(k))


def _longest_traced(search: _SeqSearch, top: int | None, own: int, *, trust_curve: bool = False) -> int:
    """The largest ``k`` (at most ``top``) whose trace fits; 0 when not even ``k = 1`` fits.

    Each round traces the curve's guess inside the bracket (the longest traced step that fits, the
    shortest above it that does not) and the guess's neighbour, so a right guess closes the bracket;
    once a round does not halve it, the curve is not trusted and the rest is bisection (``O(log)`` traces).
    With ``trust_curve`` the first guess is the answer (two traces fewer, none of them verifying it).
    """
    if top is not None and search.fits(search.traced(top)):
        return top
    high = top if top is not None else 4 * own
    for k in sorted({max(1, high // 4), max(1, high // 2), high}):
        search.traced(k)
    curving, step, guess = True, 1, 0  # the curve, until a round of it fails to halve the bracket
    while True:
        lo, hi = _bracket(search)
        if hi is not None and hi - lo <= 1:
            return lo
        if not curving:
            search.traced(_next_probe(search, lo, hi, top, guess, step))
            step *= 2
            continue
        guess = _curve_guess(search, lo, hi, top)
        if trust_curve and search.curve is not None:
            return guess
        guess = max(guess, lo + 1)  # the curve says lo is the longest: trace the step after it to confirm
        neighbour = guess + 1 if search.fits(search.traced(guess)) else guess - 1
        if lo < neighbour and (hi is None or neighbour < hi):
            search.traced(neighbour)
        new_lo, new_hi = _bracket(search)
        curving = new_hi is not None and (hi is None or 2 * (new_hi - new_lo) <= hi - lo)


def _next_probe(search: _SeqSearch, lo: int, hi: int | None, top: int | None, guess: int, step: int) -> int:
    """Where to trace once the curve is not trusted: galloping away from its last guess (a size that is
    not quite a polynomial, a convolution's rounded output length, leaves the answer near it) but never
    past the bracket's middle, so the search is ``O(log)`` either way; plain bisection when the bracket's
    ends run different ops (the answer is then likely where the step changes, which no curve sees)."""
    if hi is None:  # nothing above fails yet: gallop up
        return _doubled(search, lo, top, step)
    mid = (lo + hi) // 2
    if not lo or not same_step(search.traces[lo], search.traces[hi]):
        return mid
    if guess <= lo:
        return min(lo + step, mid)
    return max(hi - step, mid) if guess >= hi else mid
def _doubled(search: _SeqSearch, lo: int, top: int | None, step: int | None = None) -> int:
    """``lo + step`` (``2 lo`` without a step), at most ``top``; memory that never stops fitting is an error."""
    k = 2 * max(lo, 1) if step is None else lo + step
    k = k if top is None else min(k, top)
    if k >= _MAX_BATCH:
        raise _no_growth(search)
    return k


def _no_growth(search: _SeqSearch) -> ConfigError:
    return ConfigError(
        f"{search.workload.name}: memory does not grow with the sequence length; check that at_seq_len(n) builds "
        "batches of n tokens"
    )


def _bracket(search: _SeqSearch) -> tuple[int, int | None]:
    """The longest traced ``k`` that fits (0: none) and the shortest traced above it that does not (None: none)."""
    lo = max((k for k, est in search.estimates.items() if search.fits(est)), default=0)
    hi = min((k for k, est in search.estimates.items() if k > lo and not search.fits(est)), default=None)
    return lo, hi


def _curve_guess(search: _SeqSearch, lo: int, hi: int | None, top: int | None) -> int:
    """The longest ``k`` in the bracket predicted to fit (``lo`` when none above it is), by the curve through
    the traces of the bracket's step (up to three near it: a step whose code changes with the length is
    aligned with only some); without two such traces, the bracket's middle (or twice ``lo``)."""
    cap = hi - 1 if hi is not None else (top if top is not None else _MAX_BATCH)
    points = _aligned_near(search, lo, hi)
    if len(points) < 2:  # nothing to draw: bisect (or double, with no failing step yet)
        return (lo + hi) // 2 if hi is not None else _doubled(search, lo, top)
    curve = TraceCurve([(k * search.multiple, search.traces[k]) for k in points])
    search.curve = _InUnits(curve, search.multiple)
    guess = _largest_predicted(search, search.curve, lo, cap)
    if guess >= _MAX_BATCH - 1:
        raise _no_growth(search)
    return guess


def _aligned_near(search: _SeqSearch, lo: int, hi: int | None) -> list[int]:
    """Up to three traced points whose steps run the same ops as the trace at an end of the bracket (the
    end with more such traces; the failing end on a tie), nearest the bracket first, and spread: a guess
    and its neighbour are one apart, and a curve through both would magnify any size that is not a
    polynomial of the length (a convolution's output length rounds down) into its slope."""
    ends = [k for k in (hi, lo) if k]
    groups = [[k for k in search.traces if k == end or same_step(search.traces[k], search.traces[end])] for end in ends]
    group = max(groups, key=len, default=[])
    if not group:
        return []
    inside, gap = lo if hi is None else (lo + hi) / 2, max(1, (max(group) - min(group)) // 16)
    chosen: list[int] = []
    for k in sorted(group, key=lambda k: abs(k - inside)):
        if all(abs(k - c) >= gap for c in chosen):
            chosen.append(k)
    return chosen[:3]
