"""Tiny float64 models and their losses, shared by the trainer and noise-scale tests.

Double precision: those tests compare gradients and parameters across splits to ~1e-12.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100
"""Targets of padding tokens (``cross_entropy``'s ``ignore_index``)."""
VOCAB = 11


def mlp() -> nn.Module:
    """6 features -> 3 classes."""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def mean_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy averaged over the batch's items."""
    x, y = batch
    return F.cross_entropy(model(x), y)


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(idx)))  # (b, t, vocab)


def token_model() -> nn.Module:
    return TokenModel().double()


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, n_tokens)`` over the targets that are not padding."""
    idx, targets = batch
    total = F.cross_entropy(model(idx).view(-1, VOCAB), targets.view(-1), ignore_index=IGNORE, reduction="sum")
    return total, (targets != IGNORE).sum()
