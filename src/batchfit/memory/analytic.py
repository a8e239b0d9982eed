"""The closed-form memory equation: instant and approximate, kept beside the trace as a cross-check.

    memory ~ W + sum over trainable tensors (g*n + states(n)) + activations(batch)

with ``W`` the bytes of the weights and buffers, ``n`` the values of each trainable tensor, ``g`` the
bytes of a gradient value and ``states(n)`` the bytes the optimizer keeps for a tensor of ``n``
values: two moments in the parameter's dtype for Adam/AdamW, one for SGD with momentum, a row and a
column for Adafactor's matrices, about 2.03 B a value for 8-bit AdamW (``batchfit.sources.optim``,
NOTE [ Optimizer states per tensor, by name ]; a named optimizer carries its closed form as ``states``).
Frozen parameters (LoRA's base) have neither gradients nor states. For transformer-shaped workloads the
activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1: per layer ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit training (no sequence or tensor
parallelism), which we scale by 2 for fp32 activations; with full activation checkpointing only the
``2*s*b*h`` bytes of each layer's input remain.

It is wrong in both directions, which is why batchfit traces: it ignores the logits and loss buffers
(large for big vocabularies), optimizer temporaries, autocast weight copies and the fact that the peak
moves between the start of backward and the optimizer step with batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..precision import PrecisionPolicy
from .categories import Category
from .trace.fake_step import MemoryTrace

if TYPE_CHECKING:
    from ..workload import Workload


def _transformer_shape(config: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """(layers, hidden, heads, seq_len) from a preset's config, when it is a transformer."""
    def pick(*names: str) -> int | None:
        for n in names:
            if isinstance(config.get(n), int):
                return int(config[n])
        return None

    layers = pick("n_layer", "num_hidden_layers", "layers")
    hidden = pick("n_embd", "hidden_size")
    heads = pick("n_head", "num_attention_heads")
    seq = pick("seq_len")
    if None in (layers, hidden, heads, seq):
        return None
    return layers, hidden, heads, seq  # type: ignore[return-value]


def trainable_tensors(trace: MemoryTrace) -> list[tuple[int, int | None]]:
    """``(bytes, rows)`` of each trainable parameter's gradient in the trace's first step (``rows``: its
    first dimension, None when unknown): the trainable tensors, as the only ones that get gradients."""
    end = next((index for index, phase, _ in trace.phases if phase == "optimizer"), len(trace.events))
    return [
        (trace.nbytes[e], trace.rows.get(e))
        for e in trace.events[:end]
        if e >= 0 and trace.role.get(e) is Category.GRADIENTS
    ]


def _adamw_moments(n: int, rows: int | None, elem: int) -> int:
    """AdamW's two moments in the parameter's dtype: what the equation assumes of an optimizer it cannot name."""
    return 2 * n * elem


def optimizer_states(workload: Workload) -> tuple[str, Callable[[int, int | None, int], int]]:
    """The optimizer's name and the closed form of its states per tensor, from the optimizer itself: a named
    one (``sources.optim``'s factories, the HF adapter's ``args.optim``) says both; any other is AdamW."""
    name = getattr(workload.optimizer, "name", None)
    states = getattr(workload.optimizer, "states", None)
    named = name.lower() if isinstance(name, str) and name else "adamw"
    return named, states if callable(states) else _adamw_moments


def analytic_estimate(
    workload: Workload, batch_size: int, policy: PrecisionPolicy, trace: MemoryTrace
) -> dict[str, Any]:
    """The equation's terms in bytes, and what they were computed from.

    Parameter bytes are counted from the trace's parameter storages and the trainable tensors' sizes
    from its first step's gradients (the only things taken from it); the rest is arithmetic.
    """
    param_bytes = sum(n for sid, n in trace.nbytes.items() if trace.role.get(sid) is Category.PARAMETERS)
    elem = 2 if policy.param_dtype is not None and policy.param_dtype.itemsize == 2 else 4  # weights built in bf16
    optimizer, states = optimizer_states(workload)
    tensors = trainable_tensors(trace)
    n_trainable = sum(nbytes // elem for nbytes, _ in tensors)
    state_bytes = sum(states(nbytes // elem, rows, elem) for nbytes, rows in tensors)  # type: ignore[misc]
    shape = _transformer_shape(workload.config)
    activations = None
    source = "unknown (not a transformer-shaped preset)"
    if shape is not None:
        layers, hidden, heads, seq = shape
        act_elem_scale = 1 if policy.autocast_dtype is not None or policy.param_dtype is not None else 2
        per_layer = seq * batch_size * hidden * (34 + 5 * heads * seq // hidden) * act_elem_scale
        activations = layers * per_layer
        source = "Korthikanti et al. 2022, sec. 4.1"
    terms = {
        "parameters": param_bytes,
        "gradients": sum(nbytes for nbytes, _ in tensors),
        "optimizer_states": state_bytes,
        "activations": activations,
    }
    total = sum(v for v in terms.values() if v is not None)
    return {
        **terms,
        "total": total,
        "trainable_parameters_approx": n_trainable,
        "optimizer": optimizer,
        "optimizer_states_per_parameter": round(state_bytes / (n_trainable * elem), 3) if n_trainable else 0,
        "activations_source": source,
    }
