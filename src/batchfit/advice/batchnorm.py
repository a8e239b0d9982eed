"""BatchNorm under gradient accumulation: the one layer that accumulation cannot make exact.

Accumulation reproduces the global batch's gradient because the loss is a sum over items. BatchNorm
breaks that premise: in training mode it normalises each item with the mean and variance of the
items *in the same forward pass*, so with micro-batches it sees micro-batch statistics (noisier, and
different from the global batch's) and updates its running averages once per micro-batch. The run
is then not the large-batch run it emulates, however exact the weighting. ``SyncBatchNorm``
normalises over the same micro-step on every rank, which widens the statistics across GPUs but not
across accumulation steps.

Example:
    >>> from torch import nn
    >>> from batchfit.advice.batchnorm import batchnorm_advice
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    >>> batchnorm_advice(model, micro_batch_size=256, global_batch_size=256, world_size=1) is None
    True
    >>> batchnorm_advice(model, micro_batch_size=32, global_batch_size=256, world_size=1)[:46]
    'BatchNorm under gradient accumulation: 1 layer'
"""

from __future__ import annotations

import logging
import warnings

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

log = logging.getLogger("batchfit")


class BatchNormWarning(UserWarning):
    """BatchNorm layers normalise over micro-batches smaller than the global batch."""


def batchnorm_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The BatchNorm layers (any ``_BatchNorm`` subclass) that normalise with the batch's own statistics.

    Layers in eval mode that track running statistics use those instead (frozen BatchNorm, common
    when fine-tuning) and are left out: they do not depend on the batch.
    """
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and (m.training or not m.track_running_stats)
    ]


def batchnorm_advice(
    model: nn.Module, micro_batch_size: int, global_batch_size: int, world_size: int = 1
) -> str | None:
    """One line of advice when BatchNorm layers normalise over fewer items than the global batch.

    Args:
        model: the model as it will train (its layers' training mode matters).
        micro_batch_size: items per forward pass on one rank.
        global_batch_size: items per optimizer step over all ranks.
        world_size: ranks (``SyncBatchNorm`` normalises over all of them at once).

    Returns:
        None when no BatchNorm layer is affected, else what was observed, why it matters and the
        concrete changes (a micro-batch size, a layer, a conversion call).
    """
    return advice_for_layers(layer_facts(model), micro_batch_size, global_batch_size, world_size)


def layer_facts(model: nn.Module) -> list[tuple[str, str, bool]]:
    """``(name, class name, is SyncBatchNorm)`` of each layer ``batchnorm_layers`` finds."""
    return [(name, type(m).__name__, isinstance(m, nn.SyncBatchNorm)) for name, m in batchnorm_layers(model)]


def advice_for_layers(
    layers: list[tuple[str, str, bool]], micro_batch_size: int, global_batch_size: int, world_size: int = 1
) -> str | None:
    """``batchnorm_advice`` from the layers' ``(name, class name, is SyncBatchNorm)`` alone (what a plan
    keeps of a model, so that a repeated plan need not build it)."""
    # Items one forward pass takes its statistics from: SyncBatchNorm normalises over every rank at once.
    affected = [
        (name, cls, sync, over)
        for name, cls, sync in layers
        if (over := micro_batch_size * world_size if sync and world_size > 1 else micro_batch_size)
        < global_batch_size
    ]
    if not affected:
        return None
    smallest = min(over for *_, over in affected)
    names = ", ".join(f"{name or '<root>'} ({cls})" for name, cls, _, _ in affected[:3])
    more = f" and {len(affected) - 3} more" if len(affected) > 3 else ""
    plural = "s" if len(affected) > 1 else ""
    per_rank = -(-global_batch_size // max(world_size, 1))
    updates = -(-per_rank // micro_batch_size)  # forward passes per optimizer step on one rank
    plain = any(not sync for _, _, sync, _ in affected)
    if world_size == 1:
        remedies = [f"a micro-batch of {global_batch_size} if it fits (no accumulation)"]
    elif plain:
        remedies = [
            f"model = nn.SyncBatchNorm.convert_sync_batchnorm(model) to normalise over {micro_batch_size} x "
            f"{world_size} = {micro_batch_size * world_size} items across ranks (the whole global batch with a "
            f"micro-batch of {per_rank} per rank)"
        ]
    else:
        remedies = [f"a micro-batch of {per_rank} per rank if it fits (SyncBatchNorm then sees the global batch)"]
    remedies.append(
        "nn.GroupNorm or nn.LayerNorm instead of BatchNorm (they normalise each item on its own, so accumulation "
        "is exact)"
    )
    if world_size == 1:
        remedies.append("on several GPUs, nn.SyncBatchNorm.convert_sync_batchnorm(model) to normalise across them")
    return (
        f"BatchNorm under gradient accumulation: {len(affected)} layer{plural} ({names}{more}) normalise over "
        f"{smallest} items per forward pass, not over the global batch of {global_batch_size}, so training "
        f"differs from a true batch of {global_batch_size} (noisier batch statistics, running averages updated "
        f"{updates} times per step); fix: " + "; or ".join(remedies)
    )


def warn_batchnorm(
    model: nn.Module, micro_batch_size: int, global_batch_size: int, world_size: int = 1, *, stacklevel: int = 2
) -> str | None:
    """``batchnorm_advice``, issued as a ``BatchNormWarning`` (pointing at the caller) and logged.

    Args:
        stacklevel: passed to ``warnings.warn``; 2 points at the function that called this one.

    Returns:
        The advice, or None when there was nothing to say.
    """
    advice = batchnorm_advice(model, micro_batch_size, global_batch_size, world_size)
    if advice is not None:
        warnings.warn(advice, BatchNormWarning, stacklevel=stacklevel)
        log.warning("%s", advice)
    return advice
