"""A causal language model trained with a fused linear cross-entropy: ``--fused-loss liger|cce``.

With Liger (``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)`` and its siblings) or cut
cross-entropy (``cce_patch``), the model's forward stops at the hidden states and one fused op takes
the output head's weight and the labels: the logits are never materialised. The workload's loss does
the same here: the model's body, then the fused loss's stand-in (``memory/kernels/fused_loss.py``), with the
head's weight (a frozen or LoRA-adapted head is read as its base weight, as the patched forward does).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from torch import nn

from ..errors import ConfigError
from ..memory.kernels.fused_loss import IGNORE_INDEX, cce_loss, liger_loss
from ..workload import Workload

KINDS = ("liger", "cce")
_NAMES = {"liger": "Liger fused linear cross-entropy", "cce": "cut cross-entropy"}
PACKAGES = {"liger": ("liger_kernel", "liger-kernel"), "cce": ("cut_cross_entropy", "cut-cross-entropy")}
"""Each kind's module, and the distribution that installs it."""
HOW = {
    "liger": "liger_kernel.transformers.apply_liger_kernel_to_<model>(fused_linear_cross_entropy=True) before "
             "the model is built (or AutoLigerKernelForCausalLM)",
    "cce": "cut_cross_entropy.transformers.cce_patch(model)",
}
"""How a training script turns each kind on."""


def fused_loss_name(kind: str) -> str:
    """The kind's name in words (``Liger fused linear cross-entropy``)."""
    return _NAMES[kind]


def how_to_turn_on(kind: str) -> str:
    """The call that turns ``kind`` on in a training script, and the ``pip install`` first where it is not installed."""
    module, distribution = PACKAGES[kind]
    return HOW[kind] if installed(kind) else f"{HOW[kind]}; {module} is not installed here: pip install {distribution}"


def installed(kind: str) -> bool:
    """Whether ``kind``'s package can be imported here (looked up, not imported)."""
    import importlib.util

    return importlib.util.find_spec(PACKAGES[kind][0]) is not None


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformers model's body (its ``base_model_prefix`` module) and output head, under any peft wrapper."""
    get = getattr(model, "get_base_model", None)
    base = get() if callable(get) else model
    head = base.get_output_embeddings() if callable(getattr(base, "get_output_embeddings", None)) else None
    body = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if not isinstance(head, nn.Module) or not isinstance(body, nn.Module) or body is base:
        raise ConfigError(
            f"--fused-loss needs a transformers causal language model (a body and an output head); "
            f"{type(base).__name__} has none: drop --fused-loss, or write the fused loss into your own workload"
        )
    return body, head


def fused_lm_loss(kind: str, model: nn.Module, batch: Any) -> Any:
    """The loss of ``batch`` as a Liger- or cut-cross-entropy-patched forward computes it: a dict with
    ``labels`` (a transformers model's batch; the loss shifts them), or ``(input_ids, targets)`` with the
    targets already shifted (the presets'; the loss is then ``(loss_sum, n_tokens)``)."""
    body, head = _parts(model)
    weight = getattr(head, "base_layer", head).weight  # a LoRA-wrapped head: the patched forward reads its base
    loss = liger_loss if kind == "liger" else cce_loss
    if isinstance(batch, dict):
        hidden = body(**{k: v for k, v in batch.items() if k != "labels"})[0]
        return loss(hidden, weight, batch["labels"], shift=True)
    ids, targets = batch
    hidden = body(input_ids=ids)[0]
    return loss(hidden, weight, targets, shift=False, reduction="sum"), (targets != IGNORE_INDEX).sum()


def with_fused_loss(workload: Workload, kind: str) -> Workload:
    """``workload`` whose loss is the fused ``kind`` (``liger`` or ``cce``).

    Raises:
        ConfigError: an unknown kind, or a workload that is not a causal language model of transformers.
    """
    kind = str(kind).strip().lower()
    if kind not in KINDS:
        raise ConfigError(f"unknown fused loss {kind!r}; use one of {', '.join(KINDS)}")
    task = workload.config.get("task") or workload.config.get("kind")
    if task not in (None, "causal-lm"):
        raise ConfigError(f"--fused-loss applies to causal language models; this workload trains {task}")
    rebuild = workload.at_seq_len
    return dataclasses.replace(
        workload,
        loss=partial(fused_lm_loss, kind),
        name=f"{workload.name} + {_NAMES[kind]}",
        config={**workload.config, "fused_loss": kind},
        at_seq_len=None if rebuild is None else partial(_with_fused_loss_at, rebuild, kind),
    )


def _with_fused_loss_at(rebuild: Any, kind: str, seq_len: int) -> Workload:
    """The workload at ``seq_len``: the base rebuilt there, its loss fused alike."""
    return with_fused_loss(rebuild(seq_len), kind)
