"""One configuration of a plan, fitted: its largest micro-batch, its memory and its predicted time.

``batchfit.plan`` asks, for each rung of the ladder (``planning/ladder.py``), what micro-batch fits at most
a rank's share of the global batch, and turns the answer into a ``PlanOption`` carrying its predicted
time per global batch (``batchfit.planning.cost``), by which the alternatives are ranked. The cheap lower bound
that skips a configuration without tracing, and the estimate of one rank at a given micro-batch, live
here as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..batching import make_splits
from ..errors import DoesNotFitError, TraceError
from ..gpu.catalog import Device
from ..memory.cache import CACHE
from ..memory.estimate import allocator_tie_order, cached_trace, finish_estimate, with_accumulation
from ..memory.states import state_bytes
from ..memory.synthesis.scaling import TraceLine
from ..memory.synthesis.sharding import shard_trace
from ..memory.trace.tracer import MemoryTrace
from ..workload import Workload
from .cost import predict_step_time
from .estimate import fit_estimate_at
from .fit import FitResult, fit
from .known_error import errors_key
from .ladder import Rung, more_split_first


@dataclass(frozen=True)
class PlanOption:
    """One configuration a plan considered, and what it allows."""

    precision: str
    checkpointing: bool
    sharded: bool
    max_micro_batch_size: int
    """The largest micro-batch the search looked at that fits (at most a rank's share); 0 when not even
    one item fits."""
    micro_batch_size: int
    accumulation_steps: int
    device_total_bytes: int | None
    """At ``micro_batch_size`` (None when it does not fit)."""
    headroom_bytes: int | None
    remedies: tuple[str, ...]
    """What this configuration changes from plain fp32 data parallelism, cheapest first."""
    predicted_step_s: float | None = None
    """Predicted seconds per optimizer step (one global batch), see ``batchfit.planning.cost``."""
    changes_numerics: bool = False
    """Weights and optimizer states in bf16: a change to the training maths, not only to its memory."""
    tensor_parallel: int = 1
    """GPUs of one tensor-parallel group (1: none); the micro-batch is per group."""
    sequence_parallel: bool = False
    checkpointed_blocks: int | None = None
    """With ``checkpointing``: the first this many blocks are checkpointed; None: every block."""
    selective_rest: bool = False
    """With ``checkpointed_blocks``: the blocks after them are checkpointed selectively."""


def _by_time(option: PlanOption) -> float:
    return option.predicted_step_s if option.predicted_step_s is not None else float("inf")


@dataclass
class _Fitted:
    config: Rung
    result: FitResult
    workload: Workload
    """The workload as fitted (with its accumulation), the whole model: ``rank_workload`` is one rank's."""

    def rank_workload(self, gpus: int) -> Workload:
        """The workload one rank of the configuration traces: under tensor parallelism, with its layout."""
        return config_workload(self.workload, self.config, gpus)


def _could_fit(wl: Workload, dev: Device, config: Rung, gpus: int, budget: int) -> bool:
    """False when the model's state alone (no activations, no batch) exceeds the GPU: no trace needed."""
    try:
        states = state_bytes(wl, config.setup.policy(dev).param_dtype)
    except TraceError:  # an optimizer that cannot step on zero gradients: no bound; its fit will say why
        return True
    return states.sharded(config.state_shards(gpus)) + dev.context_bytes <= budget


def config_workload(wl: Workload, config: Rung, gpus: int) -> Workload:
    """``wl`` as one rank of ``config`` runs it: its ``ParallelLayout`` set under tensor parallelism."""
    layout = config.layout(gpus)
    if layout is None:
        return wl
    import dataclasses

    return dataclasses.replace(wl, parallel=layout)


def _fit_config(
    wl: Workload, dev: Device, config: Rung, gpus: int, share: int, margin: float, *, verify: bool,
    progress: Callable[[str], None] | None = None,
) -> _Fitted | None:  # fmt: skip
    """The largest micro-batch (at most the share) of one configuration, or None when none fits.

    Kept with the traces (the fit, and the whole-share estimate beside it), so that a repeated plan
    traces nothing and replays no allocator.
    """
    policy = config.setup.policy(dev)
    settings = (config, gpus, share, margin, verify, wl.accumulation_steps, errors_key(), allocator_tie_order())

    def compute() -> tuple[FitResult | None, bool]:
        fitted = _fit_config_uncached(wl, dev, config, gpus, share, margin, verify=verify, progress=progress)
        return (None, False) if fitted is None else (fitted.result, fitted.workload is not wl)

    result, accumulating = CACHE.device_fact("plan-config", wl, dev, policy.param_dtype, compute, extra=settings)
    if result is None:
        return None
    return _Fitted(config, result, with_accumulation(wl, 2) if accumulating else wl)


def _fit_config_uncached(
    wl: Workload, dev: Device, config: Rung, gpus: int, share: int, margin: float, *, verify: bool,
    progress: Callable[[str], None] | None = None,
) -> _Fitted | None:  # fmt: skip
    if config.tensor_parallel > 1:  # NOTE [ The most split layout first ]
        for layout, why in more_split_first(config):
            if not one_item_fits(wl, dev, layout, gpus, margin, progress, why):
                return None
    wl = config_workload(wl, config, gpus)
    shards = config.arithmetic_shards(gpus)
    kwargs = dict(setup=config.setup, margin=margin, shard_over=shards, verify=verify, max_batch_size=share,
                  progress=progress)  # fmt: skip
    if share == 1 or wl.accumulation_steps > 1:
        try:
            return _Fitted(config, fit(wl, dev, **kwargs), wl)
        except DoesNotFitError:
            return None
    # A share of several items usually needs several micro-batches, whose later forwards and backwards
    # run with the earlier ones' gradients alive (Workload.accumulation_steps): fit that step directly.
    accumulating = with_accumulation(wl, 2)
    try:
        result = fit(accumulating, dev, **kwargs)
    except DoesNotFitError:
        result = None
    if result is not None and result.max_batch_size == share:
        return _Fitted(config, result, accumulating)
    # The whole share as one micro-batch (no accumulation: no gradients alive in its forward) may fit
    # where the accumulating step does not: its estimate settles it where the plain steps' line says it
    # may (the plan's own configuration with 10% to spare), from the trace the accumulating step at the
    # share was written from if the search looked there, else one more trace.
    if result is not None and _may_fit_whole(result, accumulating, dev, config, share, gpus, generous=verify):
        announce = None if progress is None else lambda: progress(f"tracing a step of {share} items as one micro-batch")
        whole = fit_estimate_at(wl, dev, config.setup, shards > 1, gpus=shards, batch_size=share, announce=announce)
        if whole.device_total_bytes <= result.capacity_bytes:
            return _Fitted(config, dataclasses.replace(result, max_batch_size=share, estimate=whole), wl)
    return None if result is None else _Fitted(config, result, accumulating)


def one_item_fits(
    wl: Workload, dev: Device, config: Rung, gpus: int, margin: float, progress: Callable[[str], None] | None = None,
    why: str = "",
) -> bool:  # fmt: skip
    """Whether one rank of ``config`` fits a step of one item (one trace, kept with the others); ``why`` ends the
    progress line."""
    budget = int((dev.total_bytes or 0) * (1 - margin))
    announce = None if progress is None else lambda: progress(
        f"tracing a step of 1 item as {', '.join(config.remedies)}" + (f", {why}" if why else "")
    )  # fmt: skip
    est = fit_estimate_at(config_workload(wl, config, gpus), dev, config.setup, False, 1, batch_size=1,
                          announce=announce)  # fmt: skip
    return est.device_total_bytes <= budget


def _may_fit_whole(
    result: FitResult, wl: Workload, dev: Device, config: Rung, share: int, gpus: int, *, generous: bool
) -> bool:
    """Whether the plain step of the whole share could fit although the accumulating step at the share
    does not, predicted from the plain steps the accumulating ones were written from where the cache has
    them (``memory/synthesis/accumulation.py``); else from the accumulating step at the share less its
    gradients, alive in it only (twice a rank's share of them kept as slack), its trace predicted by the search's
    line, or its total by the line through the two largest steps the search traced (a search that stopped at
    two items draws no line of traces); with an allocator segment of slack, and 10% more when ``generous`` (the
    plan's own configuration)."""
    shards = config.arithmetic_shards(gpus)
    policy = config.setup.policy(dev)
    plain = with_accumulation(wl, 1)
    classes = config.setup.classes(wl)
    slack = (20 << 20) + (result.capacity_bytes // 10 if generous else 0)  # one segment, and the 10%
    known = {b: cached_trace(plain, b, dev, policy, classes) for b in sorted(result.traces)[-2:]}
    trace = None
    if len(known) == 2 and all(t is not None for t in known.values()):
        (b1, t1), (b2, t2) = known.items()
        try:
            trace = TraceLine(t1, b1, t2, b2).at(share)
        except ValueError:  # the step's code depends on the batch size: no line
            trace = None
    if trace is None:
        slack += 2 * -(-state_bytes(wl, policy.param_dtype).gradients // config.state_shards(gpus))
        trace = result.trace_at(share)
    if trace is None:
        total = _total_on_the_line(result, share)
        return total is None or total - result.capacity_bytes <= slack
    if shards > 1:
        trace = shard_trace(trace, shards)
    est = finish_estimate(trace, plain, share, dev, policy, classes, config.setup.expandable_segments)
    return est.device_total_bytes - result.capacity_bytes <= slack


def _total_on_the_line(result: FitResult, size: int) -> int | None:
    """The device total at ``size`` on the line through the two largest traced steps of ``result``'s search (None:
    it traced fewer)."""
    traced = sorted((a.batch_size, a.device_total_bytes) for a in result.attempts
                    if a.kind == "trace" and a.seq_len is None and a.device_total_bytes is not None)  # fmt: skip
    if len(traced) < 2:
        return None
    (b1, t1), (b2, t2) = traced[-2:]
    return t2 + (size - b2) * (t2 - t1) // (b2 - b1)


def _option(fitted: _Fitted, dev: Device, gpus: int, global_batch_size: int, interconnect: str) -> PlanOption:
    """A fitted configuration as a plan option, with its predicted time per global batch."""
    result, config = fitted.result, fitted.config
    micro = max(max(s) for s in plan_splits(config, global_batch_size, gpus, result.max_batch_size))
    return timed_option(config, fitted.workload, dev, gpus, global_batch_size, interconnect, result.max_batch_size,
                        result.trace_at(micro), result.estimate.device_total_bytes, result.capacity_bytes,
                        config.remedies)  # fmt: skip


def timed_option(
    config: Rung, wl: Workload, dev: Device, gpus: int, global_batch_size: int, interconnect: str, max_micro: int,
    trace: MemoryTrace | None, total: int, capacity: int, remedies: tuple[str, ...],
) -> PlanOption:  # fmt: skip
    """``config`` with the global batch split at micro-batches of at most ``max_micro`` items, as a plan option:
    ``total`` bytes of ``capacity`` and, from ``trace`` (the largest micro-batch's step; None: no time), its
    predicted time per global batch."""
    splits = plan_splits(config, global_batch_size, gpus, max_micro)
    steps = max(len(s) for s in splits)
    seconds = None
    if trace is not None:
        states = state_bytes(wl, config.setup.policy(dev).param_dtype)
        seconds = predict_step_time(
            trace, dev, precision=config.precision, micro_batches=steps, gpus=gpus, sharded=config.sharded,
            interconnect=interconnect, state_bytes=states.as_tuple(), tensor_parallel=config.tensor_parallel,
        ).total_s  # fmt: skip
    return PlanOption(
        precision=config.precision,
        checkpointing=config.checkpointing is not None,
        sharded=config.sharded,
        max_micro_batch_size=max_micro,
        micro_batch_size=max(max(s) for s in splits),
        accumulation_steps=steps,
        device_total_bytes=total,
        headroom_bytes=capacity - total,
        remedies=remedies,
        predicted_step_s=seconds,
        changes_numerics=config.precision == "bf16-true" and "bf16 weights and optimizer states" in remedies,
        tensor_parallel=config.tensor_parallel,
        sequence_parallel=config.sequence_parallel,
    )


def plan_splits(config: Rung, global_batch_size: int, gpus: int, micro_batch_size: int) -> list[list[int]]:
    """Micro-batch sizes per data-parallel rank (a tensor-parallel group is one: its ranks run the same
    items); every rank runs as many micro-batches under FSDP, whose every micro-batch is a collective."""
    same = config.sharded or config.tensor_parallel > 1
    return make_splits(global_batch_size, config.data_parallel(gpus), micro_batch_size, same_count=same)
