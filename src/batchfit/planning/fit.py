"""The largest micro-batch that fits: two traces draw the line, the allocator model searches it,
two more traces verify. No crash, and on a modelled device the answer is exact:
``estimate(b).device_total_bytes <= capacity < estimate(b + 1).device_total_bytes``.

Other tools find a batch size by crashing: doubling then bisecting (about ``2 log2 N`` real steps) or
shrinking by 10% after every OOM. Here memory is known as a function of the batch size
(``memory/scaling.py``), so the search costs replays of the allocator model, not steps. The search
itself is ``planning/search.py``; this module picks the device, the budget and the means of verification,
and reports the result.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpointing import checkpoint_classes
from ..errors import ConfigError
from ..gpu.catalog import Device, get_device
from ..gpu.simulated import SimulatedDevice
from ..memory.estimate import Estimate, _as_workload, with_accumulation
from ..memory.scaling import TraceLine
from ..memory.trace import MemoryTrace
from ..precision import PrecisionPolicy, policy_for
from .search import _MAX_BATCH, FitAttempt, _Search, _search_max

__all__ = ["FitAttempt", "FitResult", "fit"]


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
        from ..cache import CACHE

        dev = get_device(device)
        blocks = checkpoint_classes(checkpointing, workload.checkpoint_blocks)
        settings = (precision, blocks, margin, expandable_segments, shard_over, verify, max_batch_size,
                    workload.accumulation_steps)  # fmt: skip
        policy = policy_for(precision, bf16_supported=dev.bf16, device_name=dev.name)
        return CACHE.device_fact(
            "fit", workload, dev, policy.param_dtype,
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
        from ..gpu._cuda import cuda_device

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
        from ..gpu._cuda import cuda_step_fits

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
    from ..memory.steps import build_for_steps, run_workload_steps

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
