"""``batchfit.estimate``: the memory of one training step of a workload, or of a model named by a string.

The estimate itself is read off the step's trace in ``memory/estimate.py``; this is the public question,
which also takes a preset name, a hub id or a ``module:function`` spec (``batchfit.sources``), and so
sits above both.
"""

from __future__ import annotations

from collections.abc import Callable

from ..activation_checkpointing import Checkpointing
from ..batching import check_batch_size
from ..gpu.catalog import Device, get_device
from ..memory.cache import CACHE
from ..memory.estimate import Estimate, finish_estimate, trace_for_device
from ..memory.synthesis.sharding import shard_trace
from ..sources import as_workload
from ..workload import ParallelLayout, Setup, Workload


def estimate(
    workload: Workload | str,
    batch_size: int,
    *,
    device: str | Device = "cpu",
    setup: Setup | None = None,
    precision: str | None = None,
    checkpointing: Checkpointing = None,
    expandable_segments: bool | None = None,
    accumulation_steps: int | None = None,
    parallel: ParallelLayout | None = None,
) -> Estimate:
    """Estimate the memory of one training step of ``workload`` at ``batch_size`` on ``device``.

    The step (forward, loss, backward, optimizer step, zero_grad) runs twice on fake tensors; the
    trace of every storage gives the peak, its breakdown and, through the caching-allocator model,
    reserved memory and what nvidia-smi would show. No GPU is needed, and a 7B model costs no memory.

    Args:
        workload: a ``Workload``, or a preset name / ``"module:function"`` spec.
        batch_size: items in the step's batch.
        device: a catalog GPU (``"A100-40GB"``), a capacity (``"24GiB"``), ``"cpu"`` or a ``Device``.
            On ``"cpu"`` the peak is the exact number of bytes the CPU allocator holds.
        setup: how the step is run (``batchfit.Setup``: precision, checkpointing, accumulation, layout,
            allocator options); None: ``Setup()``, fp32 with none of them. Each keyword below that is given
            (not None) replaces that field of it.
        precision: ``fp32``, ``bf16``, ``fp16`` (autocast), ``bf16-true`` or ``bf16-true-autocast``.
        checkpointing: None, ``"blocks"`` (the workload's blocks) or a list of module classes; False turns
            off a setup's.
        expandable_segments: model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        accumulation_steps: micro-batches of ``batch_size`` per optimizer step (None: the workload's,
            1 by default). Above 1 the gradients of earlier micro-batches are alive through the
            later ones' forward and backward, which can move the peak.
        parallel: a ``ParallelLayout`` (tensor / sequence parallelism, FSDP2): the estimate is then one
            rank's, its step traced as rank 0 of a fake process group (``memory/trace/model_parallel.py``); None:
            the workload's own (``Workload.parallel``).

    Returns:
        An ``Estimate``.

    Raises:
        ConfigError: a bad batch size, device, precision, checkpointing or loss.

    Example:
        >>> import batchfit
        >>> est = batchfit.estimate(batchfit.presets.get("mlp"), 32, device="cpu")
        >>> sum(est.breakdown.values()) == est.peak_allocated_bytes
        True

    Limitations:
        See the module docstring: the context, cuDNN workspaces, other processes, compiled regions.
    """
    workload = as_workload(workload)
    setup = Setup.of(setup, precision=precision, checkpointing=checkpointing, expandable_segments=expandable_segments,
                     accumulation_steps=accumulation_steps, parallel=parallel).concrete("an estimate")  # fmt: skip
    workload = setup.workload(workload)
    batch_size = check_batch_size(batch_size)
    dev = get_device(device)
    policy, classes = setup.policy(dev), setup.classes(workload)
    trace = trace_for_device(workload, batch_size, dev, policy, classes)
    return finish_estimate(trace, workload, batch_size, dev, policy, classes, setup.expandable_segments)


def fit_estimate_at(
    wl: Workload, dev: Device, setup: Setup, sharded: bool, gpus: int, batch_size: int,
    announce: Callable[[], None] | None = None,
) -> Estimate:  # fmt: skip
    """The estimate of one rank at ``batch_size`` in a plan's configuration (kept with the traces, so
    that a repeated plan replays no allocator); ``announce`` is called if a step must be traced."""
    wl = setup.workload(wl)
    policy, classes = setup.policy(dev), setup.classes(wl)

    def compute() -> Estimate:
        trace = trace_for_device(wl, batch_size, dev, policy, classes, announce)
        if sharded:
            trace = shard_trace(trace, gpus)
        return finish_estimate(trace, wl, batch_size, dev, policy, classes, setup.expandable_segments)

    settings = (setup.key(wl), sharded, gpus, batch_size)
    return CACHE.device_fact("estimate-at", wl, dev, policy.param_dtype, compute, extra=settings)
