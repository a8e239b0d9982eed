"""A small MLP classifier and its synthetic, learnable items.

The smallest preset: it builds and steps in milliseconds, so tests and demos of fitting and exact
gradient accumulation can run many steps on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn

TEACHER_SEED = 20240601
"""Seed of the fixed teacher that labels synthetic items: a constant, so every run sees the same task."""


class MLPBlock(nn.Module):
    """Linear -> ReLU -> Dropout: the unit that activation checkpointing wraps."""

    def __init__(self, in_features: int, out_features: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.act(self.linear(x)))


class MLP(nn.Module):
    """``depth`` linear layers: ``depth - 1`` hidden blocks of width ``hidden``, then a linear head.

    Input ``(b, in_features)`` -> logits ``(b, classes)``.
    """

    def __init__(
        self, in_features: int = 32, hidden: int = 64, depth: int = 3, classes: int = 10, dropout: float = 0.0
    ) -> None:
        super().__init__()
        widths = [in_features] + [hidden] * (depth - 1)
        pairs = zip(widths[:-1], widths[1:], strict=True)
        self.blocks = nn.Sequential(*(MLPBlock(a, b, dropout) for a, b in pairs))
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def teacher(classes: int, features: int) -> torch.Tensor:
    """The fixed random projection ``(classes, features)`` whose argmax labels the items.

    Built from ``TEACHER_SEED`` only (float32, whatever the default dtype), so the task is the same for
    every seed, split and precision; a linear teacher makes the labels learnable from the inputs.
    """
    gen = torch.Generator().manual_seed(TEACHER_SEED + 7919 * classes + features)
    return torch.randn(classes, features, generator=gen, dtype=torch.float32)  # (classes, features)


def mlp_batch(b: int, in_features: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs (default dtype) and labels of the right shapes, for tracing."""
    x = torch.randn(b, in_features)  # (b, in_features)
    y = torch.randint(0, classes, (b,))  # (b,)
    return x, y


def mlp_item(gen: torch.Generator, in_features: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One item: ``x ~ N(0, 1)`` and the label the teacher gives it."""
    x = torch.randn(in_features, generator=gen, dtype=torch.float32)  # (in_features,)
    y = torch.argmax(teacher(classes, in_features) @ x)  # () int64
    return x.to(torch.get_default_dtype()), y
