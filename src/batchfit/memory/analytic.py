"""The closed-form memory equation: instant and approximate, kept beside the trace as a cross-check.

    memory ~ P*(w + g + s*k) + activations(batch)

with ``P`` trainable parameters, ``w``/``g`` the bytes of a weight/gradient element, ``k`` optimizer
states of ``s`` bytes each (AdamW: 2, SGD with momentum: 1). For transformer-shaped workloads the
activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1: per layer ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit training (no sequence or
tensor parallelism), which we scale by 2 for fp32 activations; with full activation checkpointing
only the ``2*s*b*h`` bytes of each layer's input remain.

It is wrong in both directions, which is why batchfit traces: it ignores the logits and loss buffers
(large for big vocabularies), optimizer temporaries, autocast weight copies and the fact that the peak
moves between the start of backward and the optimizer step with batch size.
"""

from __future__ import annotations

from typing import Any

from ..precision import Precision, PrecisionPolicy
from .categories import Category
from .trace import MemoryTrace

_STATES_PER_PARAM = {"adamw": 2, "adam": 2, "sgd": 1}


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


def analytic_estimate(
    workload: Any, batch_size: int, policy: PrecisionPolicy, trace: MemoryTrace
) -> dict[str, Any]:
    """The equation's terms in bytes, and what they were computed from.

    Parameter bytes are counted from the trace's parameter storages (the only thing taken from it);
    the rest is arithmetic.
    """
    param_bytes = sum(n for sid, n in trace.nbytes.items() if trace.role.get(sid) is Category.PARAMETERS)
    elem = 2 if policy.precision is Precision.BF16_TRUE else 4
    n_params = param_bytes // elem
    optimizer = str(workload.config.get("optimizer", "adamw")).lower()
    k = _STATES_PER_PARAM.get(optimizer, 2)
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
        "gradients": n_params * elem,
        "optimizer_states": n_params * elem * k,
        "activations": activations,
    }
    total = sum(v for v in terms.values() if v is not None)
    return {
        **terms,
        "total": total,
        "trainable_parameters_approx": n_params,
        "optimizer_states_per_parameter": k,
        "activations_source": source,
    }
