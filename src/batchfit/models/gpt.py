"""A GPT-2-shaped decoder in plain torch (after nanoGPT), its token loss and its synthetic token items.

Plain torch so that the ``gpt`` preset needs nothing beyond torch and every op it runs is one the fake-tensor
tracer knows; the defaults are GPT-2 small (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners", and the published ``gpt2`` config: 12 layers, 12 heads, 768 wide, 50,257 tokens,
1,024 positions), which has 124,439,808 parameters with the token embedding tied to the output head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""Targets equal to this carry no loss (padding), as in ``torch.nn.functional.cross_entropy``."""


@dataclass(frozen=True)
class GPTConfig:
    """Shapes of the decoder; the defaults are GPT-2 small."""

    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention`` (no explicit mask)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (b, t, c)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (b, nh, t, hs)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (b, nh, t, hs)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (b, nh, t, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (b, nh, t, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The 4x-wide GELU feed-forward of a GPT-2 block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: the unit that activation checkpointing wraps."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids ``(b, t)`` -> logits ``(b, t, vocab_size)`` for every position (training needs all).

    The output head shares its weight with the token embedding (one parameter, used twice), and the
    positions are built in ``forward`` with ``torch.arange`` (a small int64 tensor per step).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so the residual stream keeps its size.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.config.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)  # (t,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (b, t, c)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (b, t, vocab_size)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, n_tokens)`` over the targets that carry loss.

    A sum and a count rather than a mean, so that micro-batches holding different numbers of padded tokens
    add up to exactly the loss of the whole batch. Reads no tensor value (runs on fake tensors).
    """
    vocab = logits.size(-1)
    loss_sum = F.cross_entropy(
        logits.view(-1, vocab), targets.view(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )  # ()
    n_tokens = (targets != IGNORE_INDEX).sum()  # () int64
    return loss_sum, n_tokens


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``gpt`` preset's loss: next-token cross-entropy as ``(loss_sum, n_tokens)``."""
    idx, targets = batch
    return token_loss(model(idx), targets)


def token_batch(b: int, seq_len: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets of the right shapes, for tracing (no padding)."""
    idx = torch.randint(0, vocab_size, (b, seq_len))  # (b, t)
    targets = torch.randint(0, vocab_size, (b, seq_len))  # (b, t)
    return idx, targets


def token_item(
    gen: torch.Generator, seq_len: int, vocab_size: int, pad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One learnable sequence: a random motif of 2-8 tokens repeated, so later tokens copy earlier ones.

    With ``pad`` the tail after a random length in ``[1, seq_len]`` is padding: ids set to the last token
    of the vocabulary (as GPT-2's end-of-text) and targets to ``IGNORE_INDEX``. The same random draws are
    made with or without ``pad``, so the unpadded tokens are identical either way.
    """
    period = int(torch.randint(2, 9, (1,), generator=gen))
    motif = torch.randint(0, vocab_size, (period,), generator=gen)  # (period,)
    seq = motif.repeat(-(-(seq_len + 1) // period))[: seq_len + 1]  # (t + 1,)
    n_valid = int(torch.randint(1, seq_len + 1, (1,), generator=gen))
    idx, targets = seq[:-1].clone(), seq[1:].clone()  # (t,), (t,)
    if pad:
        idx[n_valid:] = vocab_size - 1
        targets[n_valid:] = IGNORE_INDEX
    return idx, targets
