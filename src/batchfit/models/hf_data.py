"""Batches, synthetic items and losses of the ``hf-*`` presets (the torch half of ``models/hf.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import token_loss


def causal_lm_loss(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, n_tokens)`` from the model's logits (targets are already shifted, so no ``labels=``)."""
    idx, targets = batch
    return token_loss(model(input_ids=idx).logits, targets)


def text_cls_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the items of a sequence-classification batch."""
    ids, labels = batch
    return F.cross_entropy(model(input_ids=ids).logits, labels)


def image_cls_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the items of an image-classification batch."""
    pixels, labels = batch
    return F.cross_entropy(model(pixel_values=pixels).logits, labels)


def text_cls_batch(
    b: int, seq_len: int, vocab_size: int, num_labels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and labels of the right shapes, for tracing."""
    ids = torch.randint(0, vocab_size, (b, seq_len))  # (b, t)
    labels = torch.randint(0, num_labels, (b,))  # (b,)
    return ids, labels


def text_cls_item(
    gen: torch.Generator, seq_len: int, vocab_size: int, num_labels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One "topic" sequence: 3 tokens in 4 come from the label's own band of the vocabulary.

    The label is then readable from a bag of words, so a classifier learns it quickly.
    """
    label = torch.randint(0, num_labels, (), generator=gen)  # ()
    band = max(1, vocab_size // num_labels)
    in_band = int(label) * band + torch.randint(0, band, (seq_len,), generator=gen)  # (t,)
    anywhere = torch.randint(0, vocab_size, (seq_len,), generator=gen)  # (t,)
    use_band = torch.rand(seq_len, generator=gen) < 0.75  # (t,)
    ids = torch.where(use_band, in_band.clamp_max(vocab_size - 1), anywhere)  # (t,)
    return ids, label
