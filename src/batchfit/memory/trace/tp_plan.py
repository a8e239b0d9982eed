"""Tensor-parallel plans: what a model publishes, a user's own, and the degrees they allow.

A plan maps module paths (``*`` for one name, as transformers writes them) to styles: ``colwise`` and
``rowwise`` (PyTorch's ``ColwiseParallel`` / ``RowwiseParallel``), ``colwise_gather_output`` (the whole
output on every rank), ``loss_parallel`` (a head whose logits stay split over the vocabulary), or a
``ParallelStyle`` of the user's. ``resolve_plan`` matches one to a model; a degree must then split
every planned layer and every head count evenly (each rank keeps whole heads), and divide a node.
Applying a plan is ``memory/trace/model_parallel.py``'s.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...errors import ConfigError
from ...gpu.catalog import GPUS_PER_NODE
from ...workload import ParallelLayout

STYLES = ("colwise", "rowwise", "colwise_gather_output", "loss_parallel")
"""The plan's style names batchfit maps to PyTorch's: transformers' names, and ``loss_parallel`` for a
head whose logits go straight into a cross-entropy loss (NOTE [ The head under loss parallelism ])."""
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "num_heads", "num_kv_heads", "n_head", "n_kv_heads")
"""Attributes naming head counts: a tensor-parallel degree must divide each (every rank keeps whole heads)."""


def published_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan a transformers model publishes, keyed by module paths of ``model``.

    ``config.base_model_tp_plan`` is relative to the base model (``model.model`` of a causal LM), the
    class's ``_tp_plan`` (the head: ``lm_head: colwise_gather_output``) to the model itself; entries
    whose style batchfit does not map (``embedding_rowwise``, ...) are left out (those modules stay
    whole on every rank).
    """
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    plan: dict[str, str] = {}
    for pattern, style in dict(base).items():
        plan[f"{inner}.{pattern}" if inner else pattern] = style
    causal_lm = type(model).__name__.endswith("ForCausalLM")  # its head's logits feed its cross-entropy
    for klass in reversed(type(model).__mro__):
        for name, style in (vars(klass).get("_tp_plan") or {}).items():
            plan[name] = "loss_parallel" if causal_lm and style == "colwise_gather_output" else style
    return {k: v for k, v in plan.items() if isinstance(v, str) and v in STYLES}


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def resolve_plan(model: nn.Module, plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """The plan (``plan``, else the model's published one) matched to ``model``'s modules: path -> style.

    Raises:
        ConfigError: no plan, a style not understood, a style on a module it cannot split, or a plan
            that matches no module.
    """
    given = dict(plan) if plan is not None else published_plan(model)
    if not given:
        raise ConfigError(
            f"{type(model).__name__} publishes no tensor-parallel plan; pass Workload(tp_plan={{'layers.*.mlp.up': "
            "'colwise', 'layers.*.mlp.down': 'rowwise', ...}) or use FSDP sharding alone"
        )
    from torch.distributed.tensor.parallel import ParallelStyle

    modules = dict(model.named_modules())
    tied = _tied_modules(model)
    resolved: dict[str, Any] = {}
    for pattern, style in given.items():
        if not (isinstance(style, ParallelStyle) or (isinstance(style, str) and style in STYLES)):
            raise ConfigError(
                f"tensor-parallel plan entry {pattern!r}: {style!r} is not a style batchfit knows; use one of "
                f"{', '.join(STYLES)} or a torch.distributed.tensor.parallel.ParallelStyle"
            )
        for name, module in modules.items():
            if not _matches(pattern, name) or name in tied:
                continue
            if isinstance(style, str) and not isinstance(module, (nn.Linear, nn.Embedding)):
                raise ConfigError(
                    f"tensor-parallel plan entry {pattern!r} names {name} ({type(module).__name__}); "
                    f"'{style}' splits nn.Linear and nn.Embedding layers only"
                )
            resolved[name] = style
    if not resolved:
        raise ConfigError(
            f"the tensor-parallel plan ({', '.join(given)}) matches no module of {type(model).__name__}; "
            "write its keys as module paths (model.named_modules()), '*' for one name"
        )
    return resolved


def _tied_modules(model: nn.Module) -> set[str]:
    """Modules whose weight another module shares (a head tied to the embedding): not split."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    return {name for names in owners.values() if len(names) > 1 for name in names}


def valid_degrees(model: nn.Module, plan: Mapping[str, Any], candidates: Any = (2, 4, 8)) -> list[int]:
    """The degrees among ``candidates`` that split every planned layer and every head count evenly."""
    sizes: list[int] = []
    for name, style in plan.items():
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear) and isinstance(style, str):
            sizes.append(module.in_features if style == "rowwise" else module.out_features)
    for count in head_counts(model, plan):
        sizes.append(count)
    return [d for d in candidates if all(size % d == 0 for size in sizes)]


def head_counts(model: nn.Module, plan: Mapping[str, Any]) -> list[int]:
    """Head counts of the modules whose children the plan splits (and of a transformers model's config)."""
    parents = {name.rpartition(".")[0] for name in plan}
    counts: list[int] = []
    holders: list[Any] = [model.get_submodule(p) for p in parents if p or p == ""]
    config = getattr(model, "config", None)
    if config is not None and any(n.split(".")[-1].endswith(("q_proj", "k_proj", "v_proj")) for n in plan):
        holders.append(config)
    for holder in holders:
        for field in HEAD_FIELDS:
            value = getattr(holder, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                counts.append(value)
    return sorted(set(counts))


@dataclass(frozen=True)
class SplitFacts:
    """What a model's tensor-parallel plan allows, read off the model once (the plan asks before tracing)."""

    error: str | None
    """Why the model cannot be split (no plan, a plan that does not fit it); None when it can."""
    degrees: tuple[int, ...] = ()
    """Degrees up to 64 that split every planned layer and every head count evenly."""
    heads: tuple[int, ...] = ()
    """The head counts that constrain the degree."""
    blocks: bool = False
    """The plan splits layers of numbered blocks, which sequence parallelism needs."""


def split_facts(model: nn.Module, plan: Mapping[str, Any] | None) -> SplitFacts:
    """``SplitFacts`` of ``model`` under ``plan`` (None: its published plan)."""
    try:
        resolved = resolve_plan(model, plan)
    except ConfigError as e:
        return SplitFacts(str(e))
    degrees = tuple(valid_degrees(model, resolved, range(2, 65)))
    return SplitFacts(None, degrees, tuple(head_counts(model, resolved)), bool(blocks_of_names(resolved)))


def degree_error(
    degree: int, facts: SplitFacts, gpus: int | None, gpus_per_node: int = GPUS_PER_NODE
) -> str | None:
    """One line when ``degree`` cannot split the model, a node of ``gpus_per_node`` or ``gpus`` (None: the
    GPUs are the layout's own); else None. The line names the valid degrees: those that split the
    model and divide both."""
    if degree <= 1:
        return None
    if facts.error is not None:
        return facts.error
    valid = [d for d in facts.degrees if gpus_per_node % d == 0 and (gpus is None or gpus % d == 0)]
    if degree in valid:
        return None
    what = f"the heads ({', '.join(str(h) for h in facts.heads)})" if facts.heads else "the planned layers"
    fails = [what] if degree not in facts.degrees else []
    if gpus_per_node % degree:
        fails.append(f"the {gpus_per_node} GPUs of a node")
    if gpus is not None and gpus % degree:
        fails.append(f"the {gpus} GPUs")
    listed = fails[0] if len(fails) == 1 else f"{', '.join(fails[:-1])} or {fails[-1]}"
    options = ", ".join(str(d) for d in [1, *valid])
    return f"tensor parallel degree {degree} does not divide {listed}; valid degrees: {options}"


def check_degree(model: nn.Module, plan: Mapping[str, Any], layout: ParallelLayout, gpus_per_node: int) -> None:
    """Raise ``degree_error``'s line for ``layout`` on ``model`` (resolved ``plan``), if any.

    Raises:
        ConfigError: the degree does not divide a head count, a planned layer, a node or the GPUs.
    """
    facts = SplitFacts(None, tuple(valid_degrees(model, plan, range(2, 65))), tuple(head_counts(model, plan)))
    error = degree_error(layout.tensor_parallel, facts, None, gpus_per_node)
    if error is not None:
        raise ConfigError(error)


def blocks_of_names(plan: Mapping[str, Any]) -> set[str]:
    """Numbered block paths among ``plan``'s module paths (``model.layers.3`` of ``model.layers.3.mlp.up``)."""
    blocks = set()
    for name in plan:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                blocks.add(".".join(parts[: i + 1]))
                break
    return blocks
