"""The largest micro-batch that fits: two traces draw the line, the allocator model searches it,
two more traces verify. No crash, and on a modelled device the answer is exact:
``estimate(b).device_total_bytes <= capacity < estimate(b + 1).device_total_bytes``.

Other tools find a batch size by crashing: doubling then bisecting (about ``2 log2 N`` real steps) or
shrinking by 10% after every OOM. Here memory is known as a function of the batch size
(``memory/scaling.py``), so the search costs replays of the allocator model, not steps.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpointing import checkpoint_classes
from .devices import Device, get_device
from .errors import ConfigError, DoesNotFitError
from .memory.estimate import (
    Estimate,
    _as_workload,
    finish_estimate,
    read_peak,
    trace_for_device,
    with_accumulation,
)
from .memory.scaling import TraceLine
from .memory.trace import MemoryTrace
from .precision import PrecisionPolicy, policy_for
from .simulated import SimulatedDevice
from .units import format_bytes

_MAX_BATCH = 1 << 40


@dataclass(frozen=True)
class FitAttempt:
    """One batch size the fitter looked at."""

    batch_size: int
    device_total_bytes: int | None
    fits: bool
    kind: str
    """``"trace"`` (a traced step), ``"real"`` (a real step on the device) or ``"predicted"``."""


@dataclass(frozen=True)
class FitResult:
    """The largest micro-batch that fits, and how it was found."""

    max_batch_size: int
    trials: int
    """Traced or real steps run (predictions from the line are not counted: they run no step)."""
    estimate: Estimate
    """The estimate at ``max_batch_size``."""
    device: str
    capacity_bytes: int
    """The budget compared against ``device_total_bytes`` (total memory, less the margin)."""
    precision: str
    checkpointing: bool
    attempts: tuple[FitAttempt, ...] = field(default=())
    line: TraceLine | None = field(default=None, compare=False, repr=False)
    """The line the search drew (None when it traced its way instead); not part of ``to_dict``."""
    traces: dict[int, MemoryTrace] = field(default_factory=dict, compare=False, repr=False)
    """The traces the search ran, by batch size (one rank's, before sharding); not part of ``to_dict``."""
    capped: bool = False
    """The search stopped at ``max_batch_size``: larger batches may fit too."""

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
        }


class _Search:
    """Search state of one ``fit`` call (kept local: nothing is carried between calls)."""

    def __init__(
        self,
        workload: Any,
        device: Device,
        policy: PrecisionPolicy,
        classes: tuple[type, ...],
        budget: int,
        *,
        expandable_segments: bool = False,
        reserved_only: bool = False,
        shard_over: int = 1,
    ) -> None:
        self.workload, self.device, self.policy, self.classes = workload, device, policy, classes
        self.budget = budget
        self.expandable_segments = expandable_segments
        self.reserved_only = reserved_only  # a simulated device limits what the allocator reserves
        self.shard_over = shard_over
        self.traces: dict[int, MemoryTrace] = {}
        self.estimates: dict[int, Estimate] = {}
        self.attempts: list[FitAttempt] = []
        self.trials = 0
        self.line: TraceLine | None = None
        self.progress: Callable[[str], None] | None = None

    def traced(self, b: int) -> Estimate:
        if b not in self.estimates:
            if self.progress is not None:
                self.progress(f"tracing a step of {b} item{'s' if b != 1 else ''}")
            trace = trace_for_device(self.workload, b, self.device, self.policy, self.classes)
            self.traces[b] = trace
            self.estimates[b] = self._estimate(trace, b)
            self.trials += 1
            est = self.estimates[b]
            self.attempts.append(FitAttempt(b, est.device_total_bytes, self.fits(est), "trace"))
        return self.estimates[b]

    def _estimate(self, trace: MemoryTrace, b: int) -> Estimate:
        if self.shard_over > 1:
            from .memory.sharding import shard_trace

            trace = shard_trace(trace, self.shard_over)
        return finish_estimate(
            trace,
            self.workload,
            b,
            self.device,
            self.policy,
            self.classes,
            self.expandable_segments,
            allocator_capacity=self.budget if self.reserved_only else self.budget - self.device.context_bytes,
        )

    def fits(self, est: Estimate) -> bool:
        used = est.peak_reserved_bytes if self.reserved_only else est.device_total_bytes
        return used <= self.budget

    def predicted_fits(self, line: TraceLine, b: int) -> bool:
        return self.fits(self._estimate(line.at(b), b))

    def allocated_fits(self, line: TraceLine, b: int) -> bool:
        """A necessary condition, without replaying the allocator: what live tensors hold (plus the
        context) fits. The allocator reserves at least that, so a b that fails here fails for real."""
        trace = line.at(b)
        if self.shard_over > 1:
            from .memory.sharding import shard_trace

            trace = shard_trace(trace, self.shard_over)
        held = read_peak(trace, rounded=not self.device.exact).peak_bytes
        return held + (0 if self.reserved_only else self.device.context_bytes) <= self.budget


def _largest_predicted(search: _Search, line: TraceLine, known_fit: int) -> int:
    """The largest b predicted to fit: bracketed by the cheap allocated-bytes bound, then settled with
    the allocator model (each replay costs a pass over the trace's events; a few near the answer)."""
    lo, hi = known_fit, known_fit * 2
    while hi < _MAX_BATCH and search.allocated_fits(line, hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if search.allocated_fits(line, mid) else (lo, mid)
    # lo is the most the allocated bytes allow; the reserved bytes may allow a little less.
    if search.predicted_fits(line, lo):
        return lo
    hi, step = lo, 1
    while hi - step > known_fit and not search.predicted_fits(line, hi - step):
        hi, step = hi - step, step * 2
    lo = max(known_fit, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if search.predicted_fits(line, mid) else (lo, mid)
    return lo


def _does_not_fit(workload: Any, device: Device, est: Estimate, budget: int) -> DoesNotFitError:
    low = "bf16" if device.bf16 else "fp16"  # only remedies this GPU supports
    remedies = [] if est.precision in (low, "bf16-true") else [f"--precision {low}"]
    if not est.checkpointing and workload.checkpoint_blocks:
        remedies.append("--checkpointing")
    remedies += ["more GPUs with sharding (batchfit plan --gpus N)", "a larger GPU"]
    return DoesNotFitError(
        f"{workload.name} does not fit on {device.name} even at batch size 1 with precision {est.precision}"
        f"{' and checkpointing' if est.checkpointing else ''}: it needs {format_bytes(est.device_total_bytes)} "
        f"of {format_bytes(budget)}; try {', '.join(remedies[:-1])} or {remedies[-1]}"
    )


def _search_max(search: _Search, verify: Callable[[int], bool], cap: int = _MAX_BATCH) -> int:
    """The search proper; ``verify(b)`` answers "does b fit?" by the most trusted means available.

    With ``cap`` the answer is at most ``cap`` (a plan needs no micro-batch above a rank's share), and
    nothing above it is traced or run.
    """
    if cap <= 2:
        for b in range(cap, 0, -1):
            if search.fits(search.traced(b)):
                return b
        raise _does_not_fit(search.workload, search.device, search.traced(1), search.budget)
    # The line is drawn through batch sizes 2 and 3, not 1 and 2: at batch size 1 broadcasting often
    # skips reductions in backward (an expanded buffer needs no sum), so its ops differ.
    if not search.fits(search.traced(2)):
        first = search.traced(1)
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
        guess = _largest_predicted(search, line, 3)
        if guess >= _MAX_BATCH - 1:
            raise ConfigError(
                "memory does not grow with the batch size; check that the workload's batch function uses its "
                "batch_size argument"
            )
    else:  # the step's code depends on the batch size: double, then bisect, on traces
        lo, hi = 3, 6
        while hi <= cap and hi < _MAX_BATCH and search.fits(search.traced(hi)):
            lo, hi = hi, hi * 2
        hi = min(hi, cap + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if search.fits(search.traced(mid)) else (lo, mid)
        guess = lo
    return _settle(min(guess, cap), lambda b: b <= cap and verify(b))


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


def fit(
    workload: Any,
    device: str | Device | SimulatedDevice,
    *,
    precision: str = "fp32",
    checkpointing: Any = None,
    margin: float = 0.0,
    expandable_segments: bool = False,
    shard_over: int = 1,
    verify: bool = True,
    accumulation_steps: int | None = None,
    max_batch_size: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> FitResult:
    """The largest micro-batch of ``workload`` that fits on ``device``.

    Args:
        workload: a ``Workload`` or a preset name.
        device: a catalog GPU or capacity (traced, exact against the allocator model), a
            ``SimulatedDevice`` (traced search, verified with real steps inside it), or ``"cuda"``
            (traced search, verified with real steps on the GPU).
        precision: ``fp32``, ``bf16``, ``fp16`` or ``bf16-true``.
        checkpointing: None, ``"blocks"`` or a list of module classes.
        margin: fraction of the device's memory to leave free (0.1 keeps 10% in reserve).
        expandable_segments: model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        shard_over: fit one rank of FSDP over this many GPUs (``memory/sharding.py``).
        verify: trace (or run) the answer and its successor to confirm it; False trusts the line
            drawn through two traces (two trials instead of four; used for a plan's alternatives).
        accumulation_steps: micro-batches per optimizer step (None: the workload's, 1 by default);
            above 1, the micro-batch must fit with the earlier micro-batches' gradients alive.
        max_batch_size: look no further than this (a plan needs no micro-batch above a rank's share);
            ``FitResult.capped`` then says the search stopped there.
        progress: called with a short description before each traced step (for a progress display).

    Raises:
        ConfigError: a device without a capacity (the cpu), or a margin outside [0, 1).
        DoesNotFitError: not even one item fits; the message names the remedies.

    Example:
        >>> import batchfit
        >>> r = batchfit.fit("mlp", "2GiB")
        >>> r.estimate.device_total_bytes <= r.capacity_bytes
        True
    """
    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"margin must be in [0, 1), got {margin}; e.g. 0.1 to keep 10% free")
    workload = with_accumulation(_as_workload(workload), accumulation_steps)
    if not isinstance(device, SimulatedDevice) and not (isinstance(device, str) and device.strip().lower() == "cuda"):
        # A modelled device: the answer is a function of the workload and these settings alone.
        from .cache import CACHE

        dev = get_device(device)
        from .memory.cudnn import CudnnFlags

        blocks = checkpoint_classes(checkpointing, workload.checkpoint_blocks)
        settings = ("fit", dev, CudnnFlags.current(), precision, blocks, margin, expandable_segments, shard_over,
                    verify, max_batch_size, workload.accumulation_steps)  # fmt: skip
        policy = policy_for(precision, bf16_supported=dev.bf16, device_name=dev.name)
        return CACHE.fact(
            "fit", workload, policy.param_dtype,
            lambda: _fit(workload, dev, precision, checkpointing, margin, expandable_segments, shard_over, verify,
                         max_batch_size, progress),
            extra=settings,
        )  # fmt: skip
    return _fit(workload, device, precision, checkpointing, margin, expandable_segments, shard_over, verify,
                max_batch_size, progress)  # fmt: skip


def _fit(
    workload: Any,
    device: str | Device | SimulatedDevice,
    precision: str,
    checkpointing: Any,
    margin: float,
    expandable_segments: bool,
    shard_over: int,
    verify: bool,
    max_batch_size: int | None,
    progress: Callable[[str], None] | None,
) -> FitResult:
    verify_real: Callable[[int], bool] | None = None
    if isinstance(device, SimulatedDevice):
        sim = device
        dev = sim.device
        budget = int(sim.capacity_bytes * (1 - margin))
    elif isinstance(device, str) and device.strip().lower() == "cuda":
        from ._cuda import cuda_device

        dev = cuda_device()
        budget = int(dev.total_bytes * (1 - margin))  # type: ignore[operator]
    else:
        dev = get_device(device)
        if dev.total_bytes is None:
            raise ConfigError(
                f"{dev.name} has no memory capacity to fit against; give a GPU (--device A100-40GB) or a capacity "
                "(--device 24GiB)"
            )
        budget = int(dev.total_bytes * (1 - margin))
    policy = policy_for(precision, bf16_supported=dev.bf16, device_name=dev.name)
    classes = checkpoint_classes(checkpointing, workload.checkpoint_blocks)
    search = _Search(
        workload,
        dev,
        policy,
        classes,
        budget,
        expandable_segments=expandable_segments,
        reserved_only=isinstance(device, SimulatedDevice),
        shard_over=shard_over,
    )
    search.progress = progress

    if isinstance(device, SimulatedDevice):

        def verify_real(b: int) -> bool:
            search.trials += 1
            ok = _simulated_step_fits(workload, b, budget, policy, classes)
            search.attempts.append(FitAttempt(b, None, ok, "real"))
            return ok

    elif isinstance(device, str) and device.strip().lower() == "cuda":
        from ._cuda import cuda_step_fits

        def verify_real(b: int) -> bool:
            search.trials += 1
            ok = cuda_step_fits(workload, b, policy, classes)
            search.attempts.append(FitAttempt(b, None, ok, "real"))
            return ok

    def verify_traced(b: int) -> bool:
        return search.fits(search.traced(b))

    def trust_line(b: int) -> bool:
        if search.line is None or b in search.estimates:
            return verify_traced(b)
        return search.predicted_fits(search.line, b)

    cap = _MAX_BATCH if max_batch_size is None else max(1, int(max_batch_size))
    best = _search_max(search, verify_real or (verify_traced if verify else trust_line), cap)
    est = search.estimates.get(best)
    if est is None:  # verified by real steps: report the line's prediction rather than trace again
        est = search._estimate(search.line.at(best), best) if search.line is not None else search.traced(best)
    return FitResult(
        max_batch_size=best,
        trials=search.trials,
        estimate=est,
        device=dev.name,
        capacity_bytes=budget,
        precision=policy.precision.value,
        checkpointing=bool(classes),
        attempts=tuple(search.attempts),
        line=search.line,
        traces=dict(search.traces),
        capped=best == cap,
    )


def _simulated_step_fits(
    workload: Any, batch_size: int, capacity: int, policy: PrecisionPolicy, classes: tuple[type, ...]
) -> bool:
    """Run two real steps at ``batch_size`` inside a fresh simulated device; False on its OOM."""
    from .memory.steps import build_for_steps, run_workload_steps

    # foreach: what torch picks for CUDA parameters, as the tracer does
    model, optimizer = build_for_steps(workload, policy.param_dtype, classes, foreach=True)
    sim = SimulatedDevice(capacity, policy=policy)

    try:
        with sim:
            sim.track(model)
            run_workload_steps(
                workload,
                model,
                optimizer,
                batch_size,
                param_dtype=policy.param_dtype,
                autocast=policy.autocast("cpu"),
            )
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, optimizer
        gc.collect()
