"""The memory trace of real training steps, run on fake tensors.

``trace_workload`` builds the model, its optimizer and its batches under ``FakeTensorMode`` (shapes,
dtypes and storages exist; bytes do not, so a 7B model costs nothing), runs two real training steps
and records every storage's birth and death with its role (``Category``), the module that allocated
it and the phase of the step. Everything batchfit knows about memory is computed from that list.

Limitations:
    The trace sees op outputs. Memory a kernel allocates and frees inside one op (oneDNN, cuDNN,
    cuBLAS scratch) is added by a kernel model: measured per op signature on the CPU
    (``memory/kernels/cpu_probe.py``), modelled from the kernels' sources for CUDA (``memory/kernels/cuda.py``).
    Fragmentation is the allocator simulator's job, not the trace's.

The recording itself (``MemoryTrace``, ``Tracer``) is ``tracer.py``, re-exported here; this module
builds the workload on fake tensors and runs its steps inside the tracer.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ...workload import Workload, trainable_parameters
from ..steps import default_dtype
from .tracer import OUTSIDE, MemoryTrace, Tracer

__all__ = [
    "OUTSIDE", "MemoryTrace", "Tracer", "fake_model", "model_structure", "real_execution", "step_failure",
    "trace_workload",
]  # fmt: skip


def fake_model(workload: Workload, param_dtype: torch.dtype | None = None) -> nn.Module:
    """The workload's model on fake tensors (for advice that only needs its structure)."""
    from .construct import build_fake_model, fake_session

    with fake_session():
        with default_dtype(param_dtype):
            model, _ = build_fake_model(workload, param_dtype)
    return model


def model_structure(workload: Workload, param_dtype: torch.dtype | None = None) -> nn.Module:
    """The workload's model to read the structure of (names, classes, shapes; never values): the instance
    given, else built on the meta device (several times cheaper than on fake tensors: a 7B Llama in 25 ms
    against 150 ms), else on fake tensors when a constructor refuses meta (it reads values)."""
    if isinstance(workload.model, nn.Module):
        return workload.model
    from .construct import fake_construction

    try:
        with torch.device("meta"), default_dtype(param_dtype), fake_construction(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return workload.build_model()
    except Exception:  # noqa: BLE001 - a constructor that reads values: build it as the trace does
        return fake_model(workload, param_dtype)


@contextlib.contextmanager
def real_execution() -> Iterator[None]:
    """Leave every dispatch mode (fake, tracking) for a moment, to run a kernel for real."""
    with _disable_current_modes():
        yield


def trace_workload(
    workload: Workload,
    batch_size: int,
    *,
    param_dtype: torch.dtype | None,
    autocast: Callable[[], contextlib.AbstractContextManager] | None,
    checkpoint_classes: tuple[type, ...] = (),
    kernels: Any = None,
    emulation: Callable[[], contextlib.AbstractContextManager] | None = None,
    foreach_optimizer: bool = False,
    host_memory_counts: bool = True,
    steps: int = 2,
    unified_memory: bool = False,
    depth: Any = None,
) -> MemoryTrace:
    """Trace ``steps`` training steps of ``workload`` at ``batch_size`` on fake CPU tensors.

    Args:
        param_dtype: default dtype while building the model and batches (bf16-true training).
        autocast: factory of the autocast context wrapping forward and loss (None: no autocast).
        checkpoint_classes: module classes whose forward is checkpointed.
        kernels: a kernel model (``CpuScratchProbe`` or ``CudaKernels``): its ``after_op`` adds
            scratch after each op, and ``finish(trace)`` fills in what it measured after the trace.
        emulation: factory of a context that makes CPU kernels behave like the target's (CUDA).
        foreach_optimizer: resolve an optimizer's ``foreach=None`` ("pick for me") to True, as torch
            does for CUDA parameters (``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``);
            fake CPU parameters would otherwise get the per-parameter loop, which allocates far less
            scratch than the multi-tensor kernels a GPU runs.
        unified_memory: the device has CUDA unified memory: the states a paged optimizer would put
            there are recorded in ``MemoryTrace.paged`` (``memory/kernels/paged.py``).
        depth: a ``memory.depth.DepthCut``: the built model's stacks are cut to a few blocks and the
            trace's events labelled by block, for ``memory.depth.trace_deep`` to write the full depth.
    """
    from ...activation_checkpointing import apply_checkpointing
    from ..steps import prefer_foreach
    from .construct import fake_session, materialize_lazy

    if depth is not None:
        depth.prepare(workload, param_dtype, checkpoint_classes)
    layout = getattr(workload, "parallel", None)
    with _one_rank(layout) as mesh, fake_session() as values:
        with default_dtype(param_dtype):
            model, notes = _build(workload, param_dtype, depth)
            apply_checkpointing(model, checkpoint_classes)
            model.train()
            if materialize_lazy(model, workload):
                notes.append("lazy modules were initialised by one forward pass on a batch of one item")
        if mesh is not None:
            from .model_parallel import apply_layout_traced

            apply_layout_traced(model, layout, mesh, workload.tp_plan)
            notes.append(f"one rank of {layout.describe()} ({layout.world_size} GPUs), traced on a fake process group")
        if depth is not None:  # after the layout: the stacks are cut as the rank's model names them
            depth.apply(model)
        optimizer = _make_optimizer(workload, model)
        if foreach_optimizer and prefer_foreach(optimizer):
            notes.append("capturable=True: traced without it (CPU tensors refuse it); its step counters are counted")
        return _trace_steps(
            workload, model, optimizer, batch_size, values, notes,
            param_dtype=param_dtype, autocast=autocast, kernels=kernels, emulation=emulation,
            host_memory_counts=host_memory_counts, steps=steps, unified_memory=unified_memory,
            recorder=getattr(depth, "recorder", None),
        )  # fmt: skip


def _build(workload: Workload, param_dtype: torch.dtype | None, depth: Any) -> tuple[nn.Module, list[str]]:
    """The fake model; with a ``DepthCut`` that planned the cut, built without the blocks it drops (and
    built again, whole, if that does not go as planned, or if building read values the trace notes:
    their count is the whole model's)."""
    from .construct import build_fake_model
    from .values import active_value_mode

    if depth is None or depth.plan is None:
        return build_fake_model(workload, param_dtype)
    values = active_value_mode()
    before = dict(values.notes) if values is not None else {}
    try:
        with depth.building():
            model, notes = build_fake_model(workload, param_dtype)
    except Exception:  # noqa: BLE001 - a constructor that reads the blocks it built: built whole below
        model = None
    if model is None or not depth.built_as_planned(model) or (values is not None and values.notes != before):
        depth.plan_failed(workload, param_dtype)
        if values is not None:
            values.notes = before
        return build_fake_model(workload, param_dtype)
    return model, notes
def _one_rank(layout: Any) -> contextlib.AbstractContextManager:
    """Rank 0 of ``layout``'s fake process group, yielding its mesh (None: a whole step, no group)."""
    if layout is None or layout.world_size <= 1:
        return contextlib.nullcontext()
    from .model_parallel import fake_world

    return fake_world(layout)


def _make_optimizer(workload: Workload, model: nn.Module) -> torch.optim.Optimizer:
    """The workload's optimizer on the fake parameters, as a traced step runs it (``memory/kernels/lowbit.py``)."""
    from ...errors import BatchfitError, ConfigError
    from ...third_party import quiet_third_party
    from ..kernels.lowbit import traceable

    params = trainable_parameters(model)
    if not params:
        raise ConfigError("the model has no trainable parameter (every requires_grad is False); nothing to train")
    try:
        with quiet_third_party():
            return traceable(workload.optimizer(params))
    except BatchfitError:
        raise
    except Exception as e:
        raise ConfigError(f"the workload's optimizer factory raised {type(e).__name__}: {e}") from e


def _trace_steps(
    workload: Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    values: Any,
    notes: list[str],
    *,
    param_dtype: torch.dtype | None,
    autocast: Callable[[], contextlib.AbstractContextManager] | None,
    kernels: Any,
    emulation: Callable[[], contextlib.AbstractContextManager] | None,
    host_memory_counts: bool,
    steps: int,
    unified_memory: bool = False,
    recorder: Any = None,
) -> MemoryTrace:
    from ...third_party import quiet_third_party
    from ..kernels.fused_loss import fused_losses_traced
    from ..kernels.paged import paged_states
    from ..steps import run_workload_steps
    from .compat import counted_rng_states, counted_saved_numbers

    tracer = Tracer(model, optimizer, kernels, recorder)
    values.where = tracer.current_module
    emulate = emulation() if emulation is not None else contextlib.nullcontext()
    # Checkpointing's saved RNG states are CPU tensors: device memory when the device is the CPU, host
    # memory (not counted) when it is a GPU.
    # So are the Python numbers autograd keeps as 0-d tensors for backward (CPU tensors as well).
    rng: Any = contextlib.nullcontext()
    numbers: Any = contextlib.nullcontext()
    if host_memory_counts:
        rng = counted_rng_states(tracer.register_kept)
        numbers = counted_saved_numbers(tracer.register_kept, tracer.saved_pack)
    paged: Any = contextlib.nullcontext()
    if unified_memory:
        paged = paged_states(optimizer, tracer.storage_id, tracer.trace.paged)
    try:
        with emulate, fused_losses_traced() as replaced, tracer, rng, numbers, paged, quiet_third_party():
            notes.extend(replaced)
            run_workload_steps(
                workload,
                model,
                optimizer,
                batch_size,
                param_dtype=param_dtype,
                autocast=autocast,
                mark=tracer.mark,
                steps=steps,
            )
    except Exception as e:
        failure = step_failure(e, tracer)
        if failure is e:  # already batchfit's own error: as it is (not its own cause)
            raise
        raise failure from e
    if kernels is not None:
        kernels.finish(tracer.trace)
    trace = tracer.trace
    trace.notes = [*notes, *trace.notes,  # the kernel model's, from finish
                   *(str(n) + (f" ({k} times)" if k > 1 else "") for n, k in values.notes.items())]
    return trace


def step_failure(e: Exception, tracer: Tracer) -> Exception:
    """One clear error for an exception raised inside a traced step (batchfit's own pass through)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedFakeTensorException,
        UnsupportedOperatorException,
    )

    from ...errors import BatchfitError, TraceError, first_line

    if isinstance(e, BatchfitError):
        return e
    where, op = tracer.failed_at or (tracer.current_module(), "")
    at = f" at {op}" if op else ""
    text = first_line(e)
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
        return TraceError(
            f"the step's output sizes depend on its data in {where}{at}, which batchfit cannot assume; "
            "estimate with a batch whose shapes do not depend on values, or report this model"
        )
    if isinstance(e, TypeError) and "closure" in text and "step()" in text:
        return TraceError(
            "the optimizer's step needs a closure (LBFGS re-runs forward and backward up to max_iter times per "
            "step), which batchfit's training step does not pass; estimate with a first-order optimizer (its "
            "activations are LBFGS's) and add its history, about 2 x history_size x the parameters' bytes"
        )
    if isinstance(e, (UnsupportedFakeTensorException, UnsupportedOperatorException)):
        return TraceError(
            f"{where}{at} uses an op fake tensors cannot run ({text}); "
            "estimate this model with device='cpu' measurements (batchfit sweep) instead"
        )
    return TraceError(
        f"the training step failed in {where}{at}: {type(e).__name__}: {text} "
        "(the same step would fail on a real device: check the model, batch and loss)"
    )
