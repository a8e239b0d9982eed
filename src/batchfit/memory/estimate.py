"""Estimate: the memory of one training step on a named device, read off its trace (the public
``batchfit.estimate``, which also resolves a preset name, is ``planning/estimate.py``).

Limitations:
    - CUDA numbers assume one process per GPU, one stream, and the default allocator settings
      (``PYTORCH_CUDA_ALLOC_CONF`` unset, or ``expandable_segments:True`` when asked).
    - The CUDA context is a per-architecture constant assuming lazy module loading, unless a device
      profile measured it or it is overridden (``context_source`` says which); other processes on
      the GPU are not counted.
    - cuDNN convolution workspaces depend on the engine cuDNN picks at run time: they are an
      assumption (``memory/kernels/cudnn.py``) unless a device profile measured them.
    - Compiled regions (``torch.compile``) are traced eagerly: the estimate is that of eager mode.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from ..activation_checkpointing import Selective, SelectiveRest, selected_blocks, without_selection
from ..batching import check_batch_size
from ..errors import ConfigError
from ..gpu.catalog import Device
from ..precision import PrecisionPolicy
from .allocator.caching import AllocatorStats, StorageEvents, replay, round_size
from .allocator.stream_replay import tie_order_for
from .analytic import analytic_estimate
from .cache import CACHE, Uncacheable, trace_key
from .categories import ORDER, Category
from .kernels.cpu_probe import CpuScratchProbe
from .kernels.cuda import CudaKernels, cuda_emulation
from .kernels.cudnn import WORKSPACE
from .synthesis.accumulation import accumulating_trace
from .synthesis.depth import trace_deep
from .synthesis.stackplan import CutPlan, plan_cut
from .synthesis.stacks import synthesis_enabled
from .trace.fake_step import MemoryTrace, trace_workload
from .trace.heap import full_collections_deferred

if TYPE_CHECKING:
    from ..workload import Workload


@dataclass(frozen=True)
class Estimate:
    """The memory of one training step of a workload at one batch size on one device."""

    workload: str
    batch_size: int
    device: str
    precision: str
    checkpointing: bool
    peak_allocated_bytes: int
    """Bytes held by live tensors at the peak (on CUDA: rounded blocks, as ``memory_allocated``)."""
    peak_reserved_bytes: int
    """Bytes the caching allocator holds at its peak (``memory_reserved``); equal to allocated on CPU."""
    device_total_bytes: int
    """What nvidia-smi would show: reserved + CUDA context (cuBLAS workspaces are inside reserved) + paged
    optimizer states (``paged_optimizer_bytes``)."""
    capacity_bytes: int | None
    """The device's total memory (None: no limit)."""
    breakdown: dict[str, int]
    """The six categories at the peak; they sum to ``peak_allocated_bytes``."""
    per_module: dict[str, int]
    """Bytes live at the peak by the module that allocated them (largest first)."""
    peak_phase: str
    """The phase of the step where the peak sits (forward, backward, optimizer, ...)."""
    peak_step: int
    """Which traced step (0: first, optimizer state not yet created; 1: steady state)."""
    context_bytes: int
    workspace_bytes: int
    """cuBLAS workspaces held in the allocator (inside ``temporaries`` of the breakdown)."""
    analytic: dict[str, Any] = field(default_factory=dict)
    """The closed-form estimate (``memory/analytic.py``), for comparison."""
    num_alloc_retries: int = 0
    """Times the caching allocator had to free its cache and retry (fragmentation pressure)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step the estimate is for (see ``Workload.accumulation_steps``)."""
    notes: tuple[str, ...] = ()
    """What the trace had to assume: values it could not know (the branch taken), compiled modules
    run eagerly, kernels it could not measure. Empty when the trace is the step as it runs."""
    context_source: str = ""
    """Where ``context_bytes`` comes from: ``default``, ``eager``, ``profile`` or ``override`` ("" on CPU)."""
    context_assumption: str = ""
    """The context in one line: its size and its source (``Device.describe_context``)."""
    cudnn_workspace_bytes: int = 0
    """The largest cuDNN convolution workspace of the step (transient; ``memory/kernels/cudnn.py``)."""
    checkpointed_blocks: tuple[int, ...] | None = None
    """With ``checkpointing``: the blocks checkpointed, by index (NOTE [ Checkpointing some blocks ] in
    ``activation_checkpointing.py``); None: every block of the checkpointed classes."""
    selective_checkpointing: bool = False
    """The checkpointed blocks recompute only their cheap ops (NOTE [ Selective checkpointing ]); with
    ``checkpointed_blocks``, the blocks outside them do (NOTE [ Some blocks whole, the rest selectively ])."""
    allocator_allocated_bytes: int | None = None
    """The allocated-bytes peak as the caching allocator counts it (``torch.cuda.max_memory_allocated``): whole
    blocks, a large block's unsplit leftover of up to 1 MiB included, from the allocator replay whose reserved
    memory ``peak_reserved_bytes`` is (None on the CPU). ``peak_allocated_bytes`` counts live tensors' rounded
    sizes alone, which is what the per-category ``breakdown`` adds up to."""
    paged_optimizer_bytes: int = 0
    """Optimizer states in CUDA unified memory (a paged bitsandbytes optimizer on a GPU): outside the
    caching allocator, so in neither ``peak_allocated_bytes`` nor ``peak_reserved_bytes``; held on the GPU
    once touched, so in ``device_total_bytes``. When the GPU fills, the driver moves their pages to host
    RAM and back: the step slows down instead of failing (``memory/kernels/paged.py``). 0 on the CPU, where
    paged optimizers are their non-paged selves."""

    @property
    def headroom_bytes(self) -> int | None:
        """Capacity left over at the peak (negative: it does not fit)."""
        if self.capacity_bytes is None:
            return None
        return self.capacity_bytes - self.device_total_bytes

    @property
    def fits(self) -> bool:
        """True when the step fits in the device's memory."""
        return self.capacity_bytes is None or self.device_total_bytes <= self.capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: every field plus ``headroom_bytes`` and ``fits``."""
        d = asdict(self)
        d["headroom_bytes"] = self.headroom_bytes
        d["fits"] = self.fits
        return d


@dataclass(frozen=True)
class PeakReading:
    """Where the allocated-bytes peak is and what is live there."""

    peak_bytes: int
    event_index: int
    by_category: dict[str, int]
    by_module: dict[str, int]


def read_peak(trace: MemoryTrace, *, rounded: bool) -> PeakReading:
    """The allocated-bytes peak of ``trace`` and its breakdown by category and module.

    ``rounded`` counts each storage as the caching allocator's block (512-byte multiples), as
    ``torch.cuda.memory_allocated`` does; otherwise exact bytes, as the CPU allocator holds them.
    Paged storages (``MemoryTrace.paged``) are not the allocator's and count 0.
    """
    size = {sid: round_size(n) for sid, n in trace.nbytes.items()} if rounded else dict(trace.nbytes)
    for sid in trace.paged:
        size[sid] = 0
    # live bytes after each event; the peak is the first event where they are the most (0 at event 0)
    events = trace.events
    live = list(accumulate([size[e] if e >= 0 else -size[~e] for e in events]))
    peak = max(live, default=0)
    peak_index = live.index(peak) if peak > 0 else 0
    alive: set[int] = set()
    for e in events[: peak_index + 1]:
        if e >= 0:
            alive.add(e)
        else:
            alive.discard(~e)
    by_category = {c.value: 0 for c in ORDER}
    by_module: dict[str, int] = defaultdict(int)
    for sid in alive:
        by_category[trace.role.get(sid, Category.TEMPORARIES).value] += size[sid]
        by_module[trace.module.get(sid, "")] += size[sid]
    modules = dict(sorted(by_module.items(), key=lambda kv: -kv[1]))
    return PeakReading(peak, peak_index, by_category, modules)


@full_collections_deferred
def estimate_from_trace(
    trace: MemoryTrace,
    *,
    workload: str,
    batch_size: int,
    device: Device,
    precision: str,
    checkpointing: bool,
    expandable_segments: bool = False,
    analytic: dict[str, Any] | None = None,
    allocator_capacity: int | None = None,
    accumulation_steps: int = 1,
) -> Estimate:
    """Turn a trace into an ``Estimate`` for ``device`` (exact bytes on CPU, allocator model on CUDA).

    NOTE [ Reserved memory near the capacity ]
    The caching allocator keeps freed segments cached, so without a limit its reserved memory only
    grows; a real GPU near its capacity instead frees cached segments and retries before raising OOM.
    The trace is therefore replayed with the device's capacity (total less the CUDA context, or
    ``allocator_capacity``): if it runs to the end, its peak reserved is what the GPU would hold, and
    the step fits even where an unlimited cache would have grown past the capacity. If it raises OOM
    there, the unlimited replay's peak (necessarily above the capacity) is reported, so that
    ``device_total_bytes > capacity`` says "does not fit" in both the estimate and the fitter.

    NOTE [ Fits whatever addresses the driver gives ]
    The caching allocator breaks ties between free blocks of equal size, and near the capacity that decides
    whether a large request finds a block: a Llama-3.1-8B LoRA step at 15 items (2048 tokens, capped at an
    H100-80GB's capacity) runs or runs out of memory by which of two equal free blocks was split. From torch
    2.13 the tie goes to the oldest segment (``stream_replay.tie_order_for``), which is the model's replay with
    increasing segment addresses: the bounded replay is made so. Up to 2.12 it goes to the lowest address, and
    where the driver puts a new segment is not knowable off the GPU. The recorded H200 streams (torch 2.11)
    placed the first segments of a process below or above the earlier ones, and after an out-of-memory retry had
    released cached segments the driver put most new ones back into the freed ranges, so that the newest segments
    often lie lowest. The replay in which each new segment lies below every earlier one decided as those GPUs did
    in every recorded step where the two orders disagree (capped at an H100's capacity: the 8B LoRA at 15, out of
    memory; the Qwen2.5-7B LoRA at 7 and 8 items, run twice, once in a process whose segments ascended; the
    two-layer QLoRA base at 7, out of memory; VGG-16 at 60), and gave the Llama-shaped decoder's reserved peak
    where increasing addresses give 8% less. Up to 2.12 the bounded replay is therefore made with descending
    addresses. ``BATCHFIT_ALLOCATOR_TORCH=2.11`` replays the allocator of another release than the installed one
    (a GPU whose torch differs; ``benchmarks/gpu_truth.py --replay`` does it for each recorded row).

    NOTE [ A workspace cuDNN can do without ]
    A cuDNN convolution whose engine's workspace cannot be allocated (after the allocator released its cache and
    retried) does not fail the step: PyTorch catches the out-of-memory error and runs the next engine in cuDNN's
    list, which needs less (``memory/kernels/cudnn.py``, NOTE item 6). The bounded replay takes each traced cuDNN
    workspace as optional: where it does not fit, the step goes on without it (the engines a GPU fell back to in
    the recorded VGG-16 streams took 0 to 240 MiB where the one refused wanted about 1 GiB). Capped at 8 GiB on an
    H200, that puts the largest batch the model fits next to the GPU's: VGG-16 81 (the GPU ran 80, not 81),
    Inception v3 81 (81 ran, 82 did not), the ResNet-18 shape 35 (36 did not); with every workspace kept, fit
    answered 51 for VGG-16. The estimate's notes say how many workspaces were refused.
    """
    rounded = not device.exact
    reading = read_peak(trace, rounded=rounded)
    blocks: int | None = None
    notes = list(trace.notes)
    if device.exact:
        reserved, context, retries = reading.peak_bytes, 0, 0
    else:
        context = device.context_bytes
        stats = None
        limit = allocator_capacity if allocator_capacity is not None else device.usable_bytes
        # Live blocks above the limit run out of memory whatever the cache does: no bounded replay needed.
        if limit is not None and reading.peak_bytes <= limit:
            stats = _bounded_replay(trace, limit, expandable_segments)
        if stats is None:
            stats = replay(_storage_events(trace), expandable_segments=expandable_segments)
        elif stats.num_ooms:  # NOTE [ A workspace cuDNN can do without ]
            notes.append(f"{stats.num_ooms} cuDNN convolution workspace{'s' if stats.num_ooms != 1 else ''} did not "
                         f"fit at the capacity: cuDNN falls back to engines that need less (slower), as on the GPU")
        reserved, retries, blocks = stats.peak_reserved_bytes, stats.num_alloc_retries, stats.peak_allocated_bytes
    paged = paged_bytes(trace)
    phase, step = trace.phase_at(reading.event_index)
    workspace = sum(round_size(trace.nbytes[sid]) for sid, op in trace.op.items() if op.startswith("cuBLAS workspace"))
    conv_workspace = max(
        (round_size(trace.nbytes[sid]) for sid, op in trace.op.items() if op.startswith(WORKSPACE)), default=0
    )
    return Estimate(
        workload=workload,
        batch_size=batch_size,
        device=device.name,
        precision=precision,
        checkpointing=checkpointing,
        peak_allocated_bytes=reading.peak_bytes,
        peak_reserved_bytes=reserved,
        device_total_bytes=reserved + context + paged,
        capacity_bytes=device.total_bytes,
        breakdown=reading.by_category,
        per_module=reading.by_module,
        peak_phase=phase,
        peak_step=step,
        context_bytes=context,
        workspace_bytes=workspace,
        analytic=analytic or {},
        num_alloc_retries=retries,
        accumulation_steps=accumulation_steps,
        notes=tuple(notes),
        context_source="" if device.exact else device.context_source,
        context_assumption="" if device.exact else device.describe_context(),
        cudnn_workspace_bytes=conv_workspace,
        allocator_allocated_bytes=blocks,
        paged_optimizer_bytes=paged,
    )


def _storage_events(trace: MemoryTrace, fallbacks: bool = False) -> StorageEvents:
    """``trace.allocations()`` as ``replay`` takes it without a tuple per event; ``fallbacks``: its cuDNN
    convolution workspaces are optional (NOTE [ cuDNN convolution workspaces ], item 6)."""
    optional = frozenset(sid for sid, op in trace.op.items() if op.startswith(WORKSPACE)) if fallbacks else frozenset()
    return StorageEvents(trace.events, trace.nbytes, trace.paged, optional)


ALLOCATOR_TORCH = "BATCHFIT_ALLOCATOR_TORCH"
"""Names the torch release whose caching allocator runs the step, where it is not the installed one (``2.11``)."""


def allocator_tie_order() -> str:
    """How the caching allocator that runs the step orders free blocks of one size (``address`` or ``segment``,
    ``stream_replay.tie_order_for``): the installed torch's, or the release ``BATCHFIT_ALLOCATOR_TORCH`` names (a
    GPU with another torch, or a measurement made with one and replayed here).

    Raises:
        ConfigError: ``BATCHFIT_ALLOCATOR_TORCH`` names no torch release.
    """
    named = os.environ.get(ALLOCATOR_TORCH) or None
    try:
        return tie_order_for(named)
    except ConfigError:
        raise ConfigError(f"{ALLOCATOR_TORCH}={named!r} names no torch release: set it to one such as 2.11, "
                          f"or unset it to replay the installed torch's allocator") from None


def _bounded_replay(trace: MemoryTrace, limit: int, expandable_segments: bool) -> AllocatorStats | None:
    """The trace replayed with the capacity, in the order of segment addresses of the allocator's torch, cuDNN's
    workspaces optional; None when it runs out of memory (NOTE [ Fits whatever addresses the driver gives ], NOTE
    [ A workspace cuDNN can do without ])."""
    descending = allocator_tie_order() == "address"
    stats = replay(_storage_events(trace, fallbacks=True), capacity_bytes=limit,
                   expandable_segments=expandable_segments, descending_addresses=descending)  # fmt: skip
    return None if stats.oom_at_event is not None else stats


def paged_bytes(trace: MemoryTrace) -> int:
    """The most bytes the trace holds in unified memory at once (``MemoryTrace.paged``)."""
    paged = trace.paged
    if not paged:
        return 0
    live = most = 0
    for e in trace.events:
        if e >= 0:
            if e in paged:
                live += trace.nbytes[e]
                most = max(most, live)
        elif ~e in paged:
            live -= trace.nbytes[~e]
    return most


@full_collections_deferred
def trace_for_device(
    workload: Workload, batch_size: int, device: Device, policy: PrecisionPolicy, classes: tuple[type, ...],
    announce: Callable[[], None] | None = None,
) -> MemoryTrace:  # fmt: skip
    """The trace of ``workload`` at ``batch_size`` with the kernel model of ``device``'s kind, from the
    trace cache when the same step was traced before (``memory/cache/``); ``announce`` is called
    just before a step is traced (not when the cache has it: a progress display names real work)."""
    if workload.accumulation_steps > 1 and not device.exact:  # the plain step's, a second micro-batch written in

        plain = trace_for_device(with_accumulation(workload, 1), batch_size, device, policy, classes, announce)
        accumulating = accumulating_trace(plain)
        if accumulating is not None:
            return accumulating
    notes: list[str] = []
    key = _cache_key(workload, batch_size, device, policy, classes)
    cached = CACHE.get(key, notes) if key is not None else None
    if cached is not None:
        return cached
    if announce is not None:
        announce()
    trace = _trace_for_device(workload, batch_size, device, policy, classes)
    if key is not None:
        CACHE.put(key, trace)
    return dataclasses.replace(trace, notes=[*trace.notes, *notes]) if notes else trace


def cached_trace(
    workload: Workload, batch_size: int, device: Device, policy: PrecisionPolicy, classes: tuple[type, ...]
) -> MemoryTrace | None:
    """The trace the cache holds of this step, or None: never traces (a guess may use what is known)."""
    key = _cache_key(workload, batch_size, device, policy, classes)
    return None if key is None else CACHE.get(key, [], count=False)


def _cache_key(
    workload: Workload, batch_size: int, device: Device, policy: PrecisionPolicy, classes: tuple[type, ...]
) -> str | None:
    """The trace cache's key of this step (None: the workload cannot be described, so is not cached)."""
    try:
        return trace_key(workload, batch_size, device, policy, classes)
    except Uncacheable:
        return None


def _trace_for_device(
    workload: Workload, batch_size: int, device: Device, policy: PrecisionPolicy, classes: tuple[type, ...]
) -> MemoryTrace:
    def trace(depth: Any) -> MemoryTrace:
        if device.exact:
            kernels: Any = CpuScratchProbe()
            emulation = None
        else:
            kernels = CudaKernels(device)
            emulation = cuda_emulation(policy, device.compute_capability)
        return trace_workload(
            workload,
            batch_size,
            param_dtype=policy.param_dtype,
            autocast=policy.autocast("cpu"),
            checkpoint_classes=classes,
            kernels=kernels,
            emulation=emulation,
            foreach_optimizer=not device.exact,
            host_memory_counts=device.exact,
            unified_memory=not device.exact,
            depth=depth,
        )

    return trace_deep(trace, _alike_key(workload, batch_size, device, policy, classes))


def _alike_key(
    workload: Workload, batch_size: int, device: Device, policy: PrecisionPolicy, classes: tuple[type, ...]
) -> tuple[str, CutPlan] | None:
    """Where some blocks are checkpointed and the cut is planned: the key its cut step shares with every selection of
    the same cut shape (NOTE [ One cut step for neighbouring selections ] in ``memory/synthesis/depth.py``), and the
    plan; else None."""
    if selected_blocks(classes) is None or not synthesis_enabled():
        return None
    plan = plan_cut(workload, policy.param_dtype, classes)
    key = _cache_key(workload, batch_size, device, policy, without_selection(classes))
    if plan is None or not plan.shape or key is None:
        return None
    return f"cut-step-{key}-{hashlib.sha256(repr(plan.shape).encode()).hexdigest()}", plan


def finish_estimate(
    trace: MemoryTrace,
    workload: Workload,
    batch_size: int,
    device: Device,
    policy: PrecisionPolicy,
    classes: tuple[type, ...],
    expandable_segments: bool = False,
    allocator_capacity: int | None = None,
) -> Estimate:
    """The ``Estimate`` of a trace (shared by ``estimate`` and the fitter's predicted traces)."""
    est = estimate_from_trace(
        trace,
        workload=workload.name,
        batch_size=batch_size,
        device=device,
        precision=policy.precision.value,
        checkpointing=bool(classes),
        expandable_segments=expandable_segments,
        analytic=analytic_estimate(workload, batch_size, policy, trace),
        allocator_capacity=allocator_capacity,
        accumulation_steps=workload.accumulation_steps,
    )
    return dataclasses.replace(est, checkpointed_blocks=selected_blocks(classes),
                               selective_checkpointing=Selective in classes or SelectiveRest in classes)  # fmt: skip


def with_accumulation(workload: Workload, accumulation_steps: int | None) -> Workload:
    """``workload`` with ``accumulation_steps`` (checked: a whole number >= 1); None keeps its own."""
    if accumulation_steps is None or accumulation_steps == workload.accumulation_steps:
        return workload
    return dataclasses.replace(workload, accumulation_steps=check_batch_size(accumulation_steps, "accumulation_steps"))

