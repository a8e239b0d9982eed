"""One plain training step, shared by the tracer, the real-run measurement and the simulated device.

The estimator's claim is "this is what the step you would run allocates". That holds only if the
traced step and the measured step are the same Python code, down to when each reference is dropped,
so they both call ``run_steps`` here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..batching import Batch
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..workload import Workload

#: Phases of a step, in order; the tracer marks them on its timeline.
PHASES = ("batch", "forward", "backward", "optimizer", "zero_grad")


def loss_for_backward(out: Any) -> torch.Tensor:
    """The scalar to call ``backward`` on, from what a workload's loss returned.

    A scalar is a mean over the batch's items; ``(loss_sum, n_items)`` is a token-level loss whose
    mean is ``loss_sum / n_items``. Nothing here reads a tensor's value, so it runs on fake tensors.

    Raises:
        ConfigError: the loss is neither form.
    """
    if isinstance(out, torch.Tensor):
        if out.dim() != 0 or not out.is_floating_point():
            raise ConfigError(
                f"the loss returned a tensor of shape {tuple(out.shape)} and dtype {out.dtype}; return a scalar "
                "float tensor (the mean over the batch) or a tuple (loss_sum, n_items)"
            )
        return out
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        total, count = out
        if total.dim() != 0 or not total.is_floating_point():
            raise ConfigError(f"the loss's loss_sum has shape {tuple(total.shape)}; it must be a scalar float tensor")
        if isinstance(count, torch.Tensor):
            if count.dim() != 0:
                raise ConfigError("the loss's n_items must be an int or a 0-d tensor")
        elif not isinstance(count, int) or isinstance(count, bool):
            raise ConfigError(f"the loss's n_items must be an int or a 0-d tensor, got {type(count).__name__}")
        return total / count
    raise ConfigError(
        f"the loss returned {type(out).__name__}; return a scalar float tensor (the mean over the batch) "
        "or a tuple (loss_sum, n_items) for token-level losses"
    )


Marker = Callable[[str, int], None]


def _no_marker(phase: str, step: int) -> None:
    return None


def run_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[], Batch],
    loss_fn: Callable[[nn.Module, Batch], Any],
    *,
    steps: int = 2,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    mark: Marker = _no_marker,
    set_grads_to_none: bool = True,
    micro_batches: int = 1,
    loss_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> None:
    """Run ``steps`` full training steps: batch, forward + loss, backward, optimizer step, zero_grad.

    Two steps by default: the first creates the optimizer's state lazily, the second is the steady
    state; the larger of the two is what a training run needs. References are held the way a usual
    ``for batch in loader:`` loop holds them: the batch and the loss stay alive through the optimizer
    step, and the next batch is made while the previous one is still referenced.

    Args:
        mark: called with ``(phase, step)`` as each phase starts (the tracer's timeline).
        set_grads_to_none: ``zero_grad(set_to_none=...)``; False keeps gradient buffers allocated
            between steps (torch < 2.0's default, and older training loops').
        micro_batches: forward + backward passes per optimizer step (gradient accumulation): the
            second and later find the gradients of the earlier ones alive.
        loss_context: factory of a context around each forward and its backward (tensor parallelism's
            ``loss_parallel``, ``memory/trace/model_parallel.py``).
    """
    batch = loss = None
    around = loss_context or contextlib.nullcontext
    for step in range(steps):
        for _ in range(micro_batches):
            mark("batch", step)
            batch = make_batch()
            mark("forward", step)
            with around(), autocast() if autocast is not None else contextlib.nullcontext():
                loss = loss_for_backward(loss_fn(model, batch))
            mark("backward", step)
            with around():
                loss.backward()
        mark("optimizer", step)
        optimizer.step()
        mark("zero_grad", step)
        optimizer.zero_grad(set_to_none=set_grads_to_none)
    del batch, loss
    mark("end", steps)


def prefer_foreach(optimizer: torch.optim.Optimizer) -> bool:
    """Resolve ``foreach=None`` ("pick for me") to True, as torch does for CUDA parameters; True when
    ``capturable=True`` was set aside.

    ``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``: the multi-tensor kernels a GPU
    runs allocate group-sized temporaries that the per-parameter loop CPU tensors get would not.
    ``capturable`` (step counters on the GPU, for CUDA graphs) is refused for CPU tensors, real or
    fake: the step is traced without it, its counters counted on the device all the same.
    """
    capturable = False
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("differentiable", False):
            group["foreach"] = True
        if group.get("capturable"):
            group["capturable"], capturable = False, True
    return capturable


def build_for_steps(
    workload: Workload,
    param_dtype: torch.dtype | None,
    checkpoint_classes: tuple[type, ...],
    *,
    device: str | None = None,
    foreach: bool = False,
    empty_weights: bool = False,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The workload's real model (in ``param_dtype``, on ``device``, checkpointed, in train mode) and
    its optimizer: the set-up every real run of ``run_workload_steps`` shares.

    ``empty_weights``: build on the meta device, give ``device`` storage (``Module.to_empty``) and fill it
    with small random values in place. The device sees the same allocations in the same order as
    ``.to(device)`` makes them; only the values differ, which a memory measurement never reads. It spares
    the CPU initialisation of a model with billions of parameters (minutes).
    """
    from ..activation_checkpointing import apply_checkpointing
    from ..workload import trainable_parameters

    if empty_weights and device is None:
        raise ValueError("empty_weights needs a device to put the storage on")
    with default_dtype(param_dtype), torch.device("meta") if empty_weights else contextlib.nullcontext():
        model = workload.build_model()
    if empty_weights:
        model = model.to_empty(device=device)
        with torch.no_grad():  # finite values (uninitialised storage can hold NaN or denormals), in place
            for t in (*model.parameters(), *model.buffers()):
                if t.is_floating_point():
                    t.normal_(0.0, 0.02)
    elif device is not None:
        model = model.to(device)
    apply_checkpointing(model, checkpoint_classes)
    model.train()
    from .trace.construct import materialize_lazy

    with default_dtype(param_dtype):
        materialize_lazy(model, workload, move=(lambda t: t.to(device)) if device is not None else None)
    optimizer = workload.optimizer(trainable_parameters(model))
    if foreach:
        prefer_foreach(optimizer)
    return model, optimizer


def run_workload_steps(
    workload: Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    *,
    param_dtype: torch.dtype | None,
    autocast: Callable[[], contextlib.AbstractContextManager] | None,
    move: Callable[[torch.Tensor], torch.Tensor] | None = None,
    mark: Marker = _no_marker,
    steps: int = 2,
) -> None:
    """``run_steps`` on a workload's batches of ``batch_size`` (built in ``param_dtype``, then ``move``d).

    The one way every part of batchfit runs a workload's steps: traced, measured, simulated, on a GPU.
    """

    def make_batch() -> Batch:
        with default_dtype(param_dtype):
            batch = workload.batch(batch_size)
        if move is None:
            return batch
        from ..batching import map_tensors

        return map_tensors(batch, move)

    run_steps(
        model,
        optimizer,
        make_batch,
        workload.loss,
        steps=steps,
        autocast=autocast,
        mark=mark,
        set_grads_to_none=workload.set_grads_to_none,
        micro_batches=min(max(int(getattr(workload, "accumulation_steps", 1)), 1), 2),  # see Workload
        loss_context=_loss_context(workload, model),
    )


def _loss_context(workload: Workload, model: nn.Module) -> Callable[[], contextlib.AbstractContextManager] | None:
    """``loss_parallel`` around forward and backward when the workload's layout splits its loss."""
    layout = getattr(workload, "parallel", None)
    if layout is None or layout.tensor_parallel <= 1:
        return None
    from functools import partial

    from .trace.model_parallel import loss_context, splits_the_loss

    return partial(loss_context, splits_the_loss(model, layout, workload.tp_plan))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Build models and batches in ``dtype`` (how bf16-true training is set up without ``.to()``)."""
    from .trace.construct import temporarily

    if dtype is None:
        yield
        return
    with temporarily(torch.get_default_dtype, torch.set_default_dtype, dtype):
        yield
