"""Training tasks of transformers models: which head to build, what one batch holds, which loss to take.

A config says what a model is (``architectures``, sizes); a task says how it is trained. Each task here
builds the batch a fine-tuning run feeds that head (shapes from the config and ``seq_len``) and takes
the model's own loss through ``labels=`` (the path the HF ``Trainer`` runs), so the traced step is the
step a user runs. Everything is a module-level function or a ``functools.partial`` of one, so a
workload made here pickles like a preset's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class Task:
    """One way of training a transformers model."""

    name: str
    mapping: str
    """The ``transformers.models.auto.modeling_auto`` mapping whose classes train this way."""
    description: str
    modality: str
    """What one item is: ``text``, ``seq2seq`` (text in, text out), ``image``, ``audio`` (a waveform),
    ``speech`` (log-mel features in, text out) or ``text+image``."""


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "next-token prediction", "text"),
        Task("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "speech recognition (seq2seq)",
             "speech"),
        Task("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "text-to-text generation", "seq2seq"),
        Task("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked-token prediction", "text"),
        Task("text-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
             "sequence classification", "text"),
        Task("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
             "per-token classification", "text"),
        Task("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image classification",
             "image"),
        Task("ctc", "MODEL_FOR_CTC_MAPPING_NAMES", "speech recognition (CTC)", "audio"),
        Task("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "audio classification",
             "audio"),
        Task("contrastive", "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
             "image-text contrastive (CLIP-style)", "text+image"),
    )
}  # fmt: skip
"""Tasks in the order a config's architecture is matched against them."""


def _mapping(task: Task) -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, task.mapping, {}))


def task_of_architecture(architecture: str) -> Task | None:
    """The task whose auto-mapping holds the class ``architecture`` (``LlamaForCausalLM`` -> causal-lm)."""
    for task in TASKS.values():
        if architecture in _mapping(task).values():
            return task
    return None


def model_class_for(config: Any, task: Task) -> str:
    """The transformers class that trains ``config``'s model on ``task``.

    Raises:
        ConfigError: the model type has no head for the task.
    """
    for arch in getattr(config, "architectures", None) or []:
        if arch in _mapping(task).values():
            return arch
    cls = _mapping(task).get(getattr(config, "model_type", ""))
    if cls is None:
        known = [name for name, t in TASKS.items() if getattr(config, "model_type", "") in _mapping(t)]
        hint = f"; this model supports --task {' / '.join(known)}" if known else ""
        raise ConfigError(
            f"transformers has no {task.name} head for model type {getattr(config, 'model_type', '?')!r}{hint}"
        )
    return cls


def choose_task(config: Any, task: str | None) -> Task:
    """The task named, or the one the config's ``architectures`` implies.

    Raises:
        ConfigError: an unknown task name, or a config whose architecture implies none (name one).
    """
    if task is not None:
        if task not in TASKS:
            raise ConfigError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
        return TASKS[task]
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        found = task_of_architecture(arch)
        if found is not None:
            return found
    model_type = getattr(config, "model_type", "?")
    supported = [name for name, t in TASKS.items() if model_type in _mapping(t)]
    named = f"architectures {archs}" if archs else "no architectures"
    if len(supported) == 1:
        return TASKS[supported[0]]
    hint = f"one of {', '.join(supported)}" if supported else f"one of {', '.join(TASKS)}"
    raise ConfigError(f"the config ({model_type}, {named}) does not say how it is trained; pass --task ({hint})")


# -- shapes from the config ------------------------------------------------------------------------
def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _vision_config(config: Any) -> Any:
    return getattr(config, "vision_config", None) or config


def vocab_size(config: Any) -> int:
    vocab = getattr(_text_config(config), "vocab_size", None) or getattr(config, "vocab_size", None)
    if not vocab:
        raise ConfigError(f"the {getattr(config, 'model_type', '?')} config has no vocab_size to draw token ids from")
    return int(vocab)


def max_positions(config: Any) -> int | None:
    text = _text_config(config)
    for name in ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def image_shape(config: Any) -> tuple[int, int, int]:
    """``(channels, height, width)`` of one image (224 x 224 when the config does not say)."""
    vision = _vision_config(config)
    size = getattr(vision, "image_size", None) or 224
    if isinstance(size, dict):
        size = (size.get("height", 224), size.get("width", 224))
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
    return int(getattr(vision, "num_channels", 3) or 3), height, width


def _num_labels(config: Any) -> int:
    return max(int(getattr(config, "num_labels", 2) or 2), 1)


def default_length(config: Any, task: Task) -> int:
    """The sequence length (tokens, or samples for waveforms) used when none is given."""
    if task.modality == "audio":
        return 16000  # one second at 16 kHz
    if task.modality == "speech":
        return min(448, max_positions(config) or 448)  # decoder tokens; the audio is the model's fixed window
    limit = max_positions(config)
    return min(512, limit) if limit else 512


def item_shape(config: Any, task: Task, length: int) -> str:
    """One item in words, for names and tables: ``512 tokens``, ``3x224x224 images``."""
    if task.modality == "image":
        return "x".join(map(str, image_shape(config))) + " images"
    if task.modality == "audio":
        return f"{length} samples"
    if task.modality == "speech":
        return f"{length} target tokens"
    if task.modality == "text+image":
        return f"{min(length, max_positions(config) or length)} tokens + " + "x".join(map(str, image_shape(config)))
    return f"{length} tokens"


# -- batches ---------------------------------------------------------------------------------------
def text_batch(b: int, seq_len: int, vocab: int, labels: str, num_labels: int = 2) -> dict[str, torch.Tensor]:
    """Token ids, an all-ones attention mask (a tokenizer's output, unpadded) and the task's labels."""
    ids = torch.randint(0, vocab, (b, seq_len))  # (b, t)
    batch = {"input_ids": ids, "attention_mask": torch.ones(b, seq_len, dtype=torch.long)}
    if labels == "tokens":
        batch["labels"] = torch.randint(0, vocab, (b, seq_len))  # (b, t)
    elif labels == "token-classes":
        batch["labels"] = torch.randint(0, num_labels, (b, seq_len))  # (b, t)
    else:
        batch["labels"] = torch.randint(0, num_labels, (b,))  # (b,)
    return batch


def image_batch(b: int, shape: tuple[int, int, int], num_labels: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(b, *shape), "labels": torch.randint(0, num_labels, (b,))}


def speech_batch(b: int, features: tuple[int, int], seq_len: int, vocab: int) -> dict[str, torch.Tensor]:
    """Log-mel features of the model's fixed audio window and target token ids (Whisper-style)."""
    return {"input_features": torch.randn(b, *features), "labels": torch.randint(0, vocab, (b, seq_len))}


def audio_batch(b: int, samples: int, label_len: int, vocab: int, ctc: bool) -> dict[str, torch.Tensor]:
    """A raw waveform and CTC transcript ids (``ctc``) or one class label per clip."""
    batch = {"input_values": torch.randn(b, samples)}
    if ctc:
        batch["labels"] = torch.randint(1, max(vocab, 2), (b, label_len))  # (b, l): id 0 is CTC's blank
    else:
        batch["labels"] = torch.randint(0, vocab, (b,))
    return batch


def contrastive_batch(b: int, seq_len: int, vocab: int, shape: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (b, seq_len))  # (b, t)
    return {"input_ids": ids, "attention_mask": torch.ones(b, seq_len, dtype=torch.long),
            "pixel_values": torch.randn(b, *shape), "return_loss": True}  # fmt: skip


def model_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The model's own loss for ``batch`` (its ``labels=`` path, as the HF Trainer computes it)."""
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else getattr(out, "loss", None)
    if loss is None:
        raise ConfigError(f"{type(model).__name__} returned no loss for this batch; pass --task to pick another head")
    return loss


def make_batch_fn(config: Any, task: Task, seq_len: int) -> tuple[Any, int | None]:
    """``(batch_fn, tokens_per_item)`` for ``task`` on ``config`` at ``seq_len``."""
    if task.modality in ("text", "seq2seq"):
        vocab, labels = vocab_size(config), "class"
        if task.name in ("causal-lm", "masked-lm", "seq2seq-lm"):
            labels = "tokens"
        elif task.name == "token-classification":
            labels = "token-classes"
        fn = partial(text_batch, seq_len=seq_len, vocab=vocab, labels=labels, num_labels=_num_labels(config))
        return fn, seq_len
    if task.modality == "image":
        return partial(image_batch, shape=image_shape(config), num_labels=_num_labels(config)), None
    if task.modality == "speech":
        mels = int(getattr(config, "num_mel_bins", 80))
        frames = 2 * int(getattr(config, "max_source_positions", 1500))  # the encoder's two stride-2 convs
        return partial(speech_batch, features=(mels, frames), seq_len=seq_len, vocab=vocab_size(config)), seq_len
    if task.modality == "audio":
        ctc = task.name == "ctc"
        strides = getattr(config, "conv_stride", None) or (320,)
        frames = max(1, seq_len // math.prod(strides))
        vocab = vocab_size(config) if ctc else _num_labels(config)
        fn = partial(audio_batch, samples=seq_len, label_len=max(1, frames // 4), vocab=vocab, ctc=ctc)
        return fn, None
    text = min(seq_len, max_positions(config) or seq_len)
    return partial(contrastive_batch, seq_len=text, vocab=vocab_size(config), shape=image_shape(config)), None
