"""``batchfit.estimate``: the memory of one training step of a workload, or of a model named by a string.

The estimate itself is read off the step's trace in ``memory/estimate.py``; this is the public question,
which also takes a preset name, a hub id or a ``module:function`` spec (``batchfit.sources``), and so
sits above both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..activation_checkpointing import checkpoint_classes
from ..gpu.catalog import Device, get_device
from ..memory.estimate import (
    Estimate,
    check_batch_size,
    finish_estimate,
    trace_for_device,
    with_accumulation,
    with_layout,
)
from ..precision import policy_for
from ..sources import as_workload

if TYPE_CHECKING:
    from ..workload import Workload


def estimate(
    workload: Workload | str,
    batch_size: int,
    *,
    device: str | Device = "cpu",
    precision: str = "fp32",
    checkpointing: Any = None,
    expandable_segments: bool = False,
    accumulation_steps: int | None = None,
    parallel: Any = None,
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
        precision: ``fp32``, ``bf16``, ``fp16`` (autocast), ``bf16-true`` or ``bf16-true-autocast``.
        checkpointing: None, ``"blocks"`` (the workload's blocks) or a list of module classes.
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
    workload = with_layout(with_accumulation(as_workload(workload), accumulation_steps), parallel)
    batch_size = check_batch_size(batch_size)
    dev = get_device(device)
    policy = policy_for(precision, bf16_supported=dev.bf16 or dev.exact, device_name=dev.name)
    classes = checkpoint_classes(checkpointing, workload.checkpoint_blocks)
    trace = trace_for_device(workload, batch_size, dev, policy, classes)
    return finish_estimate(trace, workload, batch_size, dev, policy, classes, expandable_segments)
