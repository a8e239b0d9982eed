"""The memory a model holds whatever the batch: parameters, gradients and optimizer states.

A plan uses it as a lower bound before tracing anything: a configuration whose parameters,
gradients and optimizer states alone exceed a GPU (or a GPU's shard of them) cannot fit, at any
micro-batch, so it is skipped without a trace. The numbers are exact, not a rule of thumb: the model is
built on fake tensors and the optimizer takes one real ``step()`` on fake zero gradients, so its states
are the ones it really creates (two per parameter for Adam, one for SGD with momentum, factored ones
for Adafactor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..workload import model_tensors, trainable_parameters


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


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


def state_bytes(workload: Any, param_dtype: torch.dtype | None) -> StateBytes:
    """The parameters, gradients and optimizer states of ``workload`` in ``param_dtype`` (cached)."""
    from ..cache import CACHE

    return CACHE.fact("state bytes", workload, param_dtype, lambda: _state_bytes(workload, param_dtype))


def _state_bytes(workload: Any, param_dtype: torch.dtype | None) -> StateBytes:
    from ..errors import BatchfitError, TraceError
    from .construct import build_fake_model, fake_session, materialize_lazy
    from .steps import default_dtype, prefer_foreach
    from .trace import _make_optimizer

    with fake_session():
        with default_dtype(param_dtype):
            model, _ = build_fake_model(workload, param_dtype)
            try:
                materialize_lazy(model, workload)  # lazy modules get their shapes from a batch, as in a trace
            except BatchfitError:
                raise
            except Exception as e:
                raise TraceError(_failed("the first forward of its lazy modules", e)) from e
        params = trainable_parameters(model)
        optimizer = _make_optimizer(workload, model)
        prefer_foreach(optimizer)  # as a GPU's trace steps it (capturable is refused for CPU tensors)
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            optimizer.step()
        except Exception as e:
            raise TraceError(_failed("the optimizer's step on zero gradients", e)) from e
        states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        result = StateBytes(
            parameters=_storage_bytes(model_tensors(model)),
            gradients=_storage_bytes(p.grad for p in params),
            optimizer_states=_storage_bytes(states),
        )
    return result


def _failed(what: str, e: Exception) -> str:
    from ..errors import first_line

    return (
        f"counting the model's parameters and optimizer states failed in {what}: {type(e).__name__}: {first_line(e)} "
        "(the training step would fail the same way: check the model, batch, loss and optimizer)"
    )
