"""torchao's low-bit optimizers on fake tensors: their states as torchao lays them out, their update as
the fused kernel runs it.

NOTE [ torchao's low-bit Adam, traced ]
``torchao.optim.AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` (and their Adam twins) keep ``exp_avg`` and
``exp_avg_sq`` as tensor subclasses (``OptimState8bit``: uint8 ``codes`` of the parameter's shape, an
fp32 ``scale`` per block, a 256-entry fp32 ``qmap``; ``OptimState4bit``: two codes a byte, a 16-entry
map) and update each parameter with ``torch.compile(single_param_adam, fullgraph=True)``
(``torchao/optim/adam.py``, ``_AdamBase.step``). Neither survives a fake trace: the subclasses
implement a handful of ops (``clone`` is not among them), and a compiled function runs eagerly there,
which would allocate the fp32 copies of every state the fused kernel never writes to memory.

So the trace steps a stand-in instead. Its states are the subclasses' own tensors, laid out by the
optimizer's own ``_new_buffer`` run on a meta copy of the parameter (so which tensors are quantised,
with which block size, codes and map, is torchao's decision, not a copy of it); each is kept in the
state as a plain tensor (``exp_avg.codes``, ``exp_avg.scale``, ``exp_avg.qmap``), next to the 0-d
fp32 ``step`` torchao keeps. Its update is one op (NOTE [ The update's CPU scratch ]) whose fake kernel
allocates nothing: on a GPU the compiled kernel reads the gradient and the states and writes the
parameter and the states in place.

Limitations:
    What the CUDA kernel keeps while it runs is inductor's choice: the estimate assumes a fully fused
    kernel (nothing beyond its outputs). On the CPU the kernel runs for real and is measured.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..measure import stderr_silenced

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))
_LAYOUTS: dict[str, tuple[Any, tuple[str, ...], list[Any]]] = {}
"""A state's layout by its key: torchao's subclass, its tensor attributes and the rest of its flattening
(``__tensor_flatten__``); the plain layout (``zeros_like(p)``) is ``""``."""


def _layout_key(buffer: torch.Tensor) -> str:
    flatten = getattr(buffer, "__tensor_flatten__", None)
    if not getattr(buffer, "tensor_attrs", None) or flatten is None:
        return ""
    attrs, context = flatten()
    cls = type(buffer)
    key = f"{cls.__module__}.{cls.__qualname__}{tuple(attrs)}{context!r}"
    _LAYOUTS.setdefault(key, (cls, tuple(attrs), list(context)))
    return key


# NOTE [ The update's CPU scratch ]
# The stand-in's update is one op, ``batchfit::lowbit_adam_update``, whose fake kernel makes nothing
# (the fused CUDA kernel's model) and whose CPU kernel is torchao's own compiled update on the states
# rebuilt as torchao's subclasses. A CPU trace replays each op signature for real to measure its
# scratch (``memory/kernels/cpu_probe.py``), so the CPU estimate holds what inductor's C++ kernel holds while it
# runs, whatever inductor makes of it.
def _lowbit_adam_update(
    p: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, lr: torch.Tensor, states: list[torch.Tensor],
    layouts: str, beta1: float, beta2: float, weight_decay: float, eps: float, is_adamw: bool, stochastic: bool,
) -> None:  # fmt: skip

    with _as_called_from_python(), stderr_silenced():
        _torchao_update(p, grad, step, lr, states, layouts, beta1, beta2, weight_decay, eps, is_adamw, stochastic)


_K = torch._C.DispatchKey


def _as_called_from_python() -> Any:
    """The dispatcher's thread-local state as outside any kernel: a custom op's kernel runs below autograd,
    where ``.float()`` of a torchao subclass reaches it undecomposed (``aten.to.dtype``, which it does
    not implement); torchao's own step calls its compiled update from Python."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (_K.AutogradOther, _K.AutogradNestedTensor, _K.AutogradCPU, _K.AutogradFunctionality):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _torchao_update(
    p: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, lr: torch.Tensor, states: list[torch.Tensor],
    layouts: str, beta1: float, beta2: float, weight_decay: float, eps: float, is_adamw: bool, stochastic: bool,
) -> None:  # fmt: skip
    """torchao's ``_AdamBase.step`` for one parameter, its states rebuilt from ``states``."""
    from torchao.optim.adam import single_param_adam

    moments: list[torch.Tensor | None] = []
    it = iter(states)
    for key in layouts.split("|"):
        if not key:
            moments.append(next(it))
            continue
        cls, attrs, context = _LAYOUTS[key]
        moments.append(cls.__tensor_unflatten__({a: next(it) for a in attrs}, context, None, None))
    moments += [None] * (3 - len(moments))
    step.add_(1)
    # A traced step runs compiled regions eagerly (memory/trace/construct.py); this kernel runs for real.
    with torch._dynamo.config.patch(disable=False), torch._dynamo.utils.disable_cache_limit():
        torch.compile(single_param_adam, fullgraph=True, dynamic=False)(
            p.detach(), grad, step, moments[0], moments[1], moments[2], lr, beta1, beta2, weight_decay, eps,
            is_adamw, stochastic and p.dtype is torch.bfloat16,
        )  # fmt: skip


def _fake_update(p: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, lr: torch.Tensor,
                 states: list[torch.Tensor], *args: Any) -> None:  # fmt: skip
    return None


@functools.cache
def _define_update() -> None:
    """Define ``batchfit::lowbit_adam_update``, once, when the first stand-in is made: registering its fake
    kernel reads the caller's source (a hundredth of a second), which a process that never traces a
    torchao optimizer need not pay for importing this module."""
    op = torch.library.custom_op("batchfit::lowbit_adam_update", mutates_args=("p", "step", "states"))
    op(_lowbit_adam_update).register_fake(_fake_update)


def is_torchao_lowbit(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of torchao's low-bit Adam optimizers (see the NOTE)."""
    module = type(optimizer).__module__ or ""
    return module.startswith("torchao.") and callable(getattr(optimizer, "_new_buffer", None))


class LowBitAdamStandIn(torch.optim.Optimizer):
    """What a traced step runs for a torchao low-bit Adam optimizer (see NOTE [ torchao's low-bit Adam, traced ]).

    Args:
        original: the torchao optimizer, built on the traced (fake) parameters; its parameter groups
            (learning rates kept as the tensors torchao made) are taken over.
    """

    def __init__(self, original: torch.optim.Optimizer) -> None:
        _define_update()
        super().__init__([dict(group) for group in original.param_groups], dict(original.defaults))
        self.original = original
        """The torchao optimizer: its ``_new_buffer`` decides each state's layout."""

    def _layout(self, p: torch.Tensor, signed: bool) -> tuple[str, list[tuple[str, torch.Tensor]]]:
        """The layout key and ``(suffix, meta tensor)`` of each tensor torchao keeps for one state of ``p``."""
        with _disable_current_modes():
            buffer = self.original._new_buffer(torch.empty(p.shape, dtype=p.dtype, device="meta"), signed)
            key = _layout_key(buffer)
        if not key:
            return key, [("", buffer)]
        return key, [(f".{name}", getattr(buffer, name)) for name in _LAYOUTS[key][1]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Make the states at the first step (as torchao does), count the step; the update allocates nothing."""
        if closure is not None:
            raise TypeError("step() got a closure: torchao's optimizers take one, batchfit's traced step does not")
        for group in self.param_groups:
            moments = [*_MOMENTS, ("max_exp_avg_sq", False)] if group.get("amsgrad") else list(_MOMENTS)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # torchao's own: a 0-d fp32 count per parameter
                    keys = []
                    for name, signed in moments:
                        key, parts = self._layout(p, signed)
                        keys.append(key)
                        for suffix, like in parts:
                            state[name + suffix] = torch.zeros(like.shape, dtype=like.dtype)
                    state["layouts"] = "|".join(keys)
                tensors = [v for k, v in state.items() if k not in ("step", "layouts")]
                beta1, beta2 = group["betas"]
                torch.ops.batchfit.lowbit_adam_update(
                    p, p.grad, state["step"], group["lr"], tensors, state["layouts"], beta1, beta2,
                    group["weight_decay"], group["eps"], self.original.is_adamw, self.original.bf16_stochastic_round,
                )  # fmt: skip


def traceable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` itself, or the stand-in a traced step runs for it (torchao's low-bit optimizers)."""
    return LowBitAdamStandIn(optimizer) if is_torchao_lowbit(optimizer) else optimizer
