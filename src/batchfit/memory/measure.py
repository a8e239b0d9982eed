"""Measuring the real CPU allocator during real training steps: the ground truth for the estimator.

There is no CPU allocator statistics API in PyTorch, but the profiler with ``profile_memory=True``
records every allocation and free the CPU allocator makes, including those inside kernels. Sorted by
time, their running sum on top of the bytes live at the start (parameters and buffers) is what the
allocator holds at each instant; its maximum is the peak.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from ..activation_checkpointing import checkpoint_classes
from ..precision import policy_for
from ..workload import Workload, model_tensors, optimizer_tensors
from .steps import build_for_steps, run_workload_steps


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    # Kineto prints "profiler_start"/"profiler_stop" lines straight to file descriptor 2 from C++;
    # the profiler is an internal measuring tool here, so those lines are noise to the user.
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def cpu_memory_profile() -> Iterator[Any]:
    """``torch.profiler`` recording the CPU allocator's events, without its start/stop chatter."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with stderr_silenced():
            prof.__exit__(None, None, None)


def live_storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _allocation_events(prof: Any) -> list[tuple[int, int, int]] | None:
    """``(time_ns, address, bytes)`` of every CPU allocation (bytes > 0) and free (< 0), in time order
    (stable: events of one nanosecond keep the profiler's order); None where the profiler's event
    tree is not available."""
    try:
        from torch._C._profiler import _EventType

        tree = prof.profiler.kineto_results.experimental_event_tree()
    except (ImportError, AttributeError, RuntimeError):
        return None
    events: list[tuple[int, int, int]] = []
    stack = list(reversed(tree))  # depth first, children in their order: ties keep the recorded order
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.children))
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    events.sort(key=lambda event: event[0])
    return events


def profile_peak(prof: Any, start_bytes: int = 0) -> int:
    """The peak of ``start_bytes`` + the running sum of the profiler's CPU allocation events.

    A free counts only when its block was allocated while this profile ran: the CPU allocator's
    reporter remembers the sizes of blocks allocated under *any* earlier profile, so a block an
    earlier measurement left in a cache (a library's, kept across models) and that is dropped during
    this one would show as a free of memory this step never had, a peak too low by its size.
    """
    events = _allocation_events(prof)
    if events is None:  # older torch: the flat list of [memory] events (no addresses)
        memory = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events = sorted(((e.start_ns(), 0, e.nbytes()) for e in memory), key=lambda event: event[0])
        allocated = None
    else:
        allocated = set()
    live = peak = start_bytes
    for _, address, n in events:
        if allocated is not None:
            if n > 0:
                allocated.add(address)
            elif address in allocated:
                allocated.discard(address)
            else:
                continue
        live += n
        peak = max(peak, live)
    return peak


def measure_cpu_peak(
    workload: Workload,
    batch_size: int,
    *,
    precision: str = "fp32",
    checkpointing: Any = None,
    steps: int = 2,
    seed: int = 0,
) -> int:
    """Run ``steps`` real training steps on the CPU and return the allocator's peak, in bytes.

    The model and optimizer are built first (their bytes, states the optimizer's constructor made
    included, are the starting point); then the same
    ``run_steps`` the tracer uses runs under the profiler.
    """
    policy = policy_for(precision)
    torch.manual_seed(seed)
    model, optimizer = build_for_steps(
        workload, policy.param_dtype, checkpoint_classes(checkpointing, workload.checkpoint_blocks)
    )
    start = live_storage_bytes([*model_tensors(model), *optimizer_tensors(optimizer)])

    with cpu_memory_profile() as prof:
        run_workload_steps(
            workload,
            model,
            optimizer,
            batch_size,
            param_dtype=policy.param_dtype,
            autocast=policy.autocast("cpu"),
            steps=steps,
        )
    return profile_peak(prof, start)
