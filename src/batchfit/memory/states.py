"""The memory a model holds whatever the batch: parameters, gradients and optimizer states.

A plan uses it as a lower bound before tracing anything: a configuration whose parameters,
gradients and optimizer states alone exceed a GPU (or a GPU's shard of them) cannot fit, at any
micro-batch, so it is skipped without a trace. The numbers are exact, not a rule of thumb: the model is
built on fake tensors and the optimizer takes one real ``step()`` on fake zero gradients, so its states
are the ones it really creates (two per parameter for Adam, one for SGD with momentum, factored ones
for Adafactor). A deep model is counted as its trace is written (``memory/synthesis/depth.py``): built without
the blocks a cut drops, each of which holds what a kept block of its period holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import BatchfitError, TraceError, first_line
from ..workload import model_tensors, trainable_parameters
from .cache import CACHE
from .steps import default_dtype, prefer_foreach
from .synthesis.stackplan import plan_cut
from .synthesis.stacks import _tensors, cut_stacks, synthesis_enabled
from .trace.construct import build_fake_model, fake_session, materialize_lazy
from .trace.fake_step import _make_optimizer

if TYPE_CHECKING:
    from ..workload import Workload


@dataclass(frozen=True)
class StateBytes:
    """Bytes of the model's state, unsharded."""

    parameters: int
    """Parameters and buffers (every tensor the model holds)."""
    gradients: int
    """One gradient per trainable parameter."""
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    def sharded(self, world_size: int) -> int:
        """What one rank of FSDP over ``world_size`` GPUs holds (buffers are not sharded: see sharding.py)."""
        return -(-self.total // max(1, world_size))

    def as_tuple(self) -> tuple[int, int, int]:
        return self.parameters, self.gradients, self.optimizer_states


def state_bytes(workload: Workload, param_dtype: torch.dtype | None) -> StateBytes:
    """The parameters, gradients and optimizer states of ``workload`` in ``param_dtype`` (cached)."""
    return CACHE.fact("state bytes", workload, param_dtype, lambda: _state_bytes(workload, param_dtype))


def _state_bytes(workload: Workload, param_dtype: torch.dtype | None) -> StateBytes:
    plan = _cut_plan(workload, param_dtype) if synthesis_enabled() else None
    with fake_session():
        with default_dtype(param_dtype):
            model = None
            if plan is not None:  # the blocks a cut drops are not built: counted as the ones they repeat
                with contextlib.suppress(Exception), plan.skipping():
                    model, _ = build_fake_model(workload, param_dtype)
                if model is None or not plan.built_as_planned(model):
                    model, plan = None, None
            if model is None:
                model, _ = build_fake_model(workload, param_dtype)
            try:
                materialize_lazy(model, workload)  # lazy modules get their shapes from a batch, as in a trace
            except BatchfitError:
                raise
            except Exception as e:
                raise TraceError(_failed("the first forward of its lazy modules", e)) from e
        repeats = _repeats(model, plan) if plan is not None else {}
        params = trainable_parameters(model)
        optimizer = _make_optimizer(workload, model)
        prefer_foreach(optimizer)  # as a GPU's trace steps it (capturable is refused for CPU tensors)
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            optimizer.step()
        except Exception as e:
            raise TraceError(_failed("the optimizer's step on zero gradients", e)) from e
        states = [(p, v) for p, state in optimizer.state.items() for v in state.values() if isinstance(v, torch.Tensor)]
        result = StateBytes(
            parameters=_storage_bytes(model_tensors(model), repeats),
            gradients=_storage_bytes((p.grad for p in params), repeats, owners=params),
            optimizer_states=_storage_bytes((v for _, v in states), repeats, owners=[p for p, _ in states]),
        )
    return result


def _cut_plan(workload: Workload, param_dtype: torch.dtype | None) -> Any:
    plan = plan_cut(workload, param_dtype)
    return plan if plan is not None and plan.stacks else None


def _repeats(model: Any, plan: Any) -> dict[int, int]:
    """How many times each tensor of the blocks a plan's cut keeps stands for itself: once, and once
    more for each block the cut dropped that repeats it (the middle period's, every written block's)."""
    cut_stacks(model, list(plan.stacks))
    out: dict[int, int] = {}
    for stack in plan.stacks:
        container = model.get_submodule(stack.path) if stack.path else model
        for b in range(stack.period, 2 * stack.period):
            for module in container[stack.start + b].modules():
                for _, t in _tensors(module):
                    out[id(t)] = 1 + stack.inserted // stack.period
    return out


def _storage_bytes(tensors: Any, repeats: dict[int, int] | None = None, owners: list[Any] | None = None) -> int:
    """Bytes of the storages of ``tensors``, each counted once (or as many times as the tensor, or its
    owner in ``owners``, stands for blocks a cut dropped)."""
    seen: dict[int, int] = {}
    for i, t in enumerate(tensors):
        st = t.untyped_storage()
        times = (repeats or {}).get(id(owners[i] if owners is not None else t), 1)
        seen[id(st)] = st.nbytes() * times
    return sum(seen.values())


def _failed(what: str, e: Exception) -> str:
    return (
        f"counting the model's parameters and optimizer states failed in {what}: {type(e).__name__}: {first_line(e)} "
        "(the training step would fail the same way: check the model, batch, loss and optimizer)"
    )
