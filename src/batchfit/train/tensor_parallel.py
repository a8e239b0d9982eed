"""Tensor (and sequence) parallelism for the Trainer: the 2-D mesh and the layout the estimate assumed.

Under torchrun, ``Trainer(..., tensor_parallel=T)`` splits the processes into groups of ``T``
consecutive ranks (inside a node: ``LOCAL_WORLD_SIZE`` bounds ``T``), the ``("dp", "tp")`` mesh of
``batchfit.memory.trace.model_parallel.make_mesh``, and splits the model with ``apply_layout``, the function the
estimator traces: the model's tensor-parallel plan on ``tp``, FSDP2 on ``dp`` when there are several
groups. What follows for the loop:

- The ranks of a group run the same items: each group is one data-parallel rank, and its ranks pass
  the group's share of the global batch to ``step`` (``Trainer.share``).
- Counts and losses are summed over the data-parallel ranks only (``data_parallel_group``): a
  group's ranks hold the same loss, and FSDP2 averages gradients over ``dp``, not over every process.
- Each rank splits *its own* copy of the parameters, so rank 0's are broadcast first (as for FSDP), and
  the optimizer built on the plain model is re-pointed at the split parameters by name.
- A causal LM's head keeps its logits split over the vocabulary; every micro-batch's forward and
  backward then run under ``loss_parallel()`` (``loss_context``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..batching import check_batch_size
from ..errors import ConfigError
from ..workload import ParallelLayout


def gpus_per_node() -> int:
    """Processes torchrun started on this node (``LOCAL_WORLD_SIZE``; the world without it)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else dist.get_world_size()


def check_tensor_parallel(degree: Any, world_size: int) -> int:
    """``degree`` as a whole number that divides the processes, or one line naming the fix.

    Raises:
        ConfigError: not a whole number >= 1, or one that does not divide the processes.
    """
    check_batch_size(degree, "tensor_parallel")
    if degree > 1 and world_size % degree:
        valid = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ConfigError(
            f"tensor parallel degree {degree} does not divide the {world_size} processes; valid degrees: {valid}"
        )
    return degree


def split_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: ParallelLayout,
    device: torch.device,
    tp_plan: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, Any]:
    """``model`` split as ``layout`` says on this job's mesh (in place); ``optimizer`` re-pointed.

    Returns the model and its ``("dp", "tp")`` mesh.

    Raises:
        ConfigError: no process group, an optimizer holding state or parameters not the model's, a
            degree that does not divide the model's heads or a node (naming the valid ones), a model
            without a tensor-parallel plan.
    """
    from ..memory.trace.model_parallel import apply_layout, make_mesh
    from .fsdp import equalise, parameter_names, repoint

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("tensor parallelism needs a process group: launch with torchrun --nproc_per_node=N")
    name_of = parameter_names(model, optimizer, "so that tensor parallelism can split them")
    if any(optimizer.state.values()):
        raise ConfigError(
            "the optimizer already holds state; split the model first (build the Trainer), then load a checkpoint"
        )
    equalise(model)
    mesh = make_mesh(layout, device.type)
    apply_layout(model, layout, mesh, tp_plan, gpus_per_node())
    repoint(optimizer, model, name_of)
    return model, mesh


def is_split(model: nn.Module) -> bool:
    """True when ``model``'s parameters are DTensors (tensor parallelism or FSDP2): states are gathered whole."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def data_parallel_group(mesh: Any) -> Any:
    """The process group of this rank's data-parallel peers (one rank per tensor-parallel group)."""
    return mesh["dp"].get_group()


def loss_context(model: nn.Module, layout: ParallelLayout, tp_plan: Mapping[str, Any] | None) -> Callable[[], Any]:
    """The context every micro-batch's forward and backward run in (``loss_parallel`` or nothing)."""
    from functools import partial

    from ..memory.trace.model_parallel import loss_context as context
    from ..memory.trace.model_parallel import splits_the_loss

    if not splits_the_loss(model, layout, tp_plan):
        return contextlib.nullcontext
    return partial(context, True)
