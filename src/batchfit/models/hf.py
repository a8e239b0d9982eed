"""Hugging Face ``transformers`` models built from their config classes with the published shapes.

Only configurations are used (never ``from_pretrained``): no weights or configs are downloaded, and the
models build on fake tensors, so a 7B model is estimated without allocating its memory. ``transformers``
is imported inside the functions, so importing this module stays cheap and works without it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations every preset with attention can be built with (``attn_implementation=``).

``sdpa`` (the default here, and transformers' own where the model supports it) calls
``scaled_dot_product_attention``, which CUDA runs as a flash / memory-efficient kernel keeping no T x T
matrix. ``eager`` is the explicit matmul, softmax, dropout and matmul, which keeps the B x H x T x T
probabilities and their dropout mask for backward, as every model did before transformers adopted SDPA:
measurements published with older versions are reproduced with it. A name registered with
``transformers.AttentionInterface`` is accepted too (see ``registered_attention``).
"""


@dataclass(frozen=True)
class HFSpec:
    """One preset: which classes to build, with which published shapes, and how to feed it."""

    description: str
    model_class: str
    config_class: str
    block: tuple[str, str]
    """(model family, class) of the layer that activation checkpointing wraps."""
    kind: str
    """``causal-lm`` (token loss), ``text-cls`` or ``image-cls`` (mean cross-entropy over items)."""
    shape: dict[str, Any]
    """Published config fields; each can be overridden by name."""
    layer_field: str
    """The config field that the generic ``layers=`` override sets."""
    length: int
    """Default ``seq_len`` (text) or ``image_size`` (images)."""
    position_field: str | None = None
    """Config field that must be at least ``seq_len`` (grown to it unless given explicitly)."""
    heads: tuple[str, str] | None = None
    """(width field, heads field): the width must divide evenly among the heads."""
    dropout_fields: tuple[str, ...] = ()
    dropout: float = 0.0
    """The published value of every field in ``dropout_fields``."""
    sdpa: bool = True
    """Whether the model has an attention to choose: ``attn_implementation`` (sdpa by default) is then a knob."""
    end_token_fields: tuple[str, ...] = ()
    """Special-token id fields set to the last token of the vocabulary, which is where GPT-2 keeps them."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fixed config arguments that are not shapes."""


SPECS: dict[str, HFSpec] = {
    # GPT-2 small: Radford et al. 2019; the openai-community/gpt2 model card config (= GPT2Config() defaults).
    "hf-gpt2": HFSpec(
        "transformers GPT2LMHeadModel, GPT-2 small (124M), seq_len 1024",
        "GPT2LMHeadModel", "GPT2Config", ("gpt2", "GPT2Block"), "causal-lm",
        shape=dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024),
        layer_field="n_layer", length=1024, position_field="n_positions", heads=("n_embd", "n_head"),
        dropout_fields=("resid_pdrop", "embd_pdrop", "attn_pdrop"), dropout=0.1,
        end_token_fields=("bos_token_id", "eos_token_id"),
    ),
    # BERT-large uncased: Devlin et al. 2018; the google-bert/bert-large-uncased model card config.
    "hf-bert-large": HFSpec(
        "transformers BertForSequenceClassification, bert-large-uncased (335M), seq_len 512",
        "BertForSequenceClassification", "BertConfig", ("bert", "BertLayer"), "text-cls",
        shape=dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                   vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, num_labels=2),
        layer_field="num_hidden_layers", length=512, position_field="max_position_embeddings",
        heads=("hidden_size", "num_attention_heads"),
        dropout_fields=("hidden_dropout_prob", "attention_probs_dropout_prob"), dropout=0.1,
    ),
    # Llama 2 7B: Touvron et al. 2023 ("Llama 2"); the meta-llama/Llama-2-7b-hf model card config.
    "hf-llama-7b": HFSpec(
        "transformers LlamaForCausalLM, Llama-2-7B (6.7B), seq_len 4096",
        "LlamaForCausalLM", "LlamaConfig", ("llama", "LlamaDecoderLayer"), "causal-lm",
        shape=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                   rms_norm_eps=1e-5, rope_theta=10000.0),
        layer_field="num_hidden_layers", length=4096, position_field="max_position_embeddings",
        heads=("hidden_size", "num_attention_heads"), dropout_fields=("attention_dropout",),
        extra=dict(tie_word_embeddings=False),
    ),
    # Llama 3 8B: "The Llama 3 Herd of Models" (2024); the meta-llama/Meta-Llama-3-8B model card config.
    "hf-llama3-8b": HFSpec(
        "transformers LlamaForCausalLM, Llama-3-8B (8.0B, 8 kv heads), seq_len 8192",
        "LlamaForCausalLM", "LlamaConfig", ("llama", "LlamaDecoderLayer"), "causal-lm",
        shape=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                   rms_norm_eps=1e-5, rope_theta=500000.0),
        layer_field="num_hidden_layers", length=8192, position_field="max_position_embeddings",
        heads=("hidden_size", "num_attention_heads"), dropout_fields=("attention_dropout",),
        extra=dict(tie_word_embeddings=False),
    ),
    # ViT-B/16: Dosovitskiy et al. 2020; the google/vit-base-patch16-224 model card config.
    "hf-vit-base": HFSpec(
        "transformers ViTForImageClassification, vit-base-patch16-224 (86.6M), 224x224 images",
        "ViTForImageClassification", "ViTConfig", ("vit", "ViTLayer"), "image-cls",
        shape=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                   image_size=224, patch_size=16, num_channels=3, num_labels=1000),
        layer_field="num_hidden_layers", length=224, heads=("hidden_size", "num_attention_heads"),
        dropout_fields=("hidden_dropout_prob", "attention_probs_dropout_prob"),
    ),
    # ResNet-50: He et al. 2015; the microsoft/resnet-50 model card config.
    "hf-resnet50": HFSpec(
        "transformers ResNetForImageClassification, ResNet-50 (25.6M), 224x224 images",
        "ResNetForImageClassification", "ResNetConfig", ("resnet", "ResNetBottleNeckLayer"), "image-cls",
        shape=dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                   num_channels=3, num_labels=1000),
        layer_field="depths", length=224, sdpa=False, extra=dict(layer_type="bottleneck", hidden_act="relu"),
    ),
}


def knobs(name: str) -> dict[str, tuple[type, Any]]:
    """The overrides preset ``name`` accepts besides optimizer and lr: (type, default) by name.

    Every published shape field, ``layers`` (sets ``layer_field``), ``seq_len`` or ``image_size``,
    ``dropout`` where the config has dropout, ``attn_implementation`` where the model has attention to
    choose (see ``ATTN_IMPLEMENTATIONS``), and ``pad`` (padded synthetic items) for causal LMs.
    """
    spec = SPECS[name]
    out: dict[str, tuple[type, Any]] = {k: (type(v), v) for k, v in spec.shape.items()}
    out["layers"] = (int, None)
    out.setdefault("image_size" if spec.kind == "image-cls" else "seq_len", (int, spec.length))
    if spec.dropout_fields:
        out["dropout"] = (float, spec.dropout)
    if spec.sdpa:
        out["attn_implementation"] = (str, ATTN_IMPLEMENTATIONS[0])
    if spec.kind == "causal-lm":
        out["pad"] = (bool, False)
    return out


def config_fields(name: str, cfg: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The config arguments for the resolved knobs ``cfg`` (completed in place), checked for consistency.

    Raises:
        ConfigError: heads that do not divide the width, a sequence longer than the positions given,
            an image size that is not a multiple of the patch size, an unknown attention implementation,
            or a config transformers rejects.
    """
    spec = SPECS[name]
    attn = cfg.get("attn_implementation")
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS and attn not in registered_attention():
        raise ConfigError(
            f"preset {name!r}: attn_implementation={attn!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)} "
            "nor a function registered with transformers.AttentionInterface"
        )
    layers = cfg.pop("layers")
    if layers is not None:
        if spec.layer_field in overrides:
            raise ConfigError(f"preset {name!r}: give layers= or {spec.layer_field}=, not both")
        default = spec.shape[spec.layer_field]
        cfg[spec.layer_field] = [layers] * len(default) if isinstance(default, list) else layers
    if spec.heads and cfg[spec.heads[0]] % cfg[spec.heads[1]]:
        raise ConfigError(f"preset {name!r}: {spec.heads[0]} must be divisible by {spec.heads[1]}")
    if "num_key_value_heads" in cfg:
        heads, kv = "num_attention_heads", "num_key_value_heads"
        if kv not in overrides and spec.shape[kv] == spec.shape[heads]:
            cfg[kv] = cfg[heads]  # a multi-head (not grouped-query) model stays so when its heads change
        if cfg[heads] % cfg[kv]:
            raise ConfigError(f"preset {name!r}: {heads}={cfg[heads]} must be divisible by {kv}={cfg[kv]}")
    position = spec.position_field
    if position and cfg["seq_len"] > cfg[position]:
        if position in overrides:
            raise ConfigError(f"preset {name!r}: seq_len={cfg['seq_len']} exceeds {position}={cfg[position]}")
        cfg[position] = cfg["seq_len"]  # learned positions grow with the sequence, as when fine-tuning longer
    if "patch_size" in cfg and cfg["image_size"] % cfg["patch_size"]:
        raise ConfigError(f"preset {name!r}: image_size={cfg['image_size']} is not a multiple of patch_size")
    fields = {k: cfg[k] for k in spec.shape}
    fields.update({f: cfg["dropout"] for f in spec.dropout_fields})
    if attn is not None:
        fields["attn_implementation"] = attn
    try:
        make_config(spec, fields)  # fail here, naming the preset, rather than when tracing
    except (TypeError, ValueError) as e:
        raise ConfigError(f"preset {name!r}: transformers rejected the configuration: {e}") from e
    return fields


def registered_attention() -> list[str]:
    """Attention functions registered with ``transformers.AttentionInterface`` (an empty list without it).

    A model can be built with any of them (``attn_implementation=<name>``): that is how a different
    attention kernel, or the attention of an older library version, is estimated without changing the
    model's code.
    """
    if not available():
        return []
    from transformers import AttentionInterface

    return list(AttentionInterface().valid_keys())


def available() -> bool:
    """Whether ``transformers`` is installed (checked without importing it)."""
    return importlib.util.find_spec("transformers") is not None


def make_config(spec: HFSpec, fields: dict[str, Any]) -> Any:
    """The transformers config object for ``fields`` (shapes, dropout and fixed arguments)."""
    import transformers

    kwargs = dict(spec.extra, **fields)
    kwargs.update({f: fields["vocab_size"] - 1 for f in spec.end_token_fields})
    if spec.kind == "causal-lm":
        kwargs["use_cache"] = False
    if spec.sdpa:
        kwargs.setdefault("attn_implementation", ATTN_IMPLEMENTATIONS[0])
    return getattr(transformers, spec.config_class)(**kwargs)


def build_model(name: str, fields: dict[str, Any]) -> nn.Module:
    """A freshly initialised model of preset ``name`` (runs on real or fake tensors, any default dtype)."""
    import transformers

    spec = SPECS[name]
    config = make_config(spec, fields)
    from ..memory.trace.construct import buildable_under_fake_mode

    with buildable_under_fake_mode():
        return getattr(transformers, spec.model_class)(config)


def block_class(name: str) -> type[nn.Module]:
    """The layer class of preset ``name`` that ``checkpointing="blocks"`` wraps."""
    family, cls = SPECS[name].block
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls)
