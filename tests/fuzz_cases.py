"""Generated Trainer runs on simulated GPUs, and the invariant every run must keep.

Shared by the property tests (``test_fuzz.py``) and ``benchmarks/fuzz_trainer.py``. A ``Case`` is one
run as a new user would write it: a global batch built on the host, a micro-batch size, SGD with
momentum or AdamW, clipping on or off, a mean loss or a token loss with padding, float64 or float32,
1 to 3 steps, on a simulated GPU of a small capacity that the caller enters, or only passes to the
Trainer. Each run ends in one of four outcomes:

- ``exact``: finished without a re-plan; parameters equal the full-batch reference, every item used
  exactly once in each step's gradient;
- ``re-split``: the same, after out-of-memory re-plans;
- ``refused``: a one-line ``DoesNotFitError``;
- ``other``: anything else (another exception, a finished run that is not exact or used an item
  twice or never). Never allowed.

Item accounting: ``tag`` holds one zero-valued parameter per item id, outside the optimizer, and the
loss adds ``tag[id] - tag[id].detach()`` per item: nothing in value, while each use of an item adds
``1 / N`` to its gradient (``N``: the step's item count for mean losses; for token losses the
previous step's token count, the divisor a token window backpropagates with, which the end-of-window
correction does not touch outside the optimizer). So ``N * tag.grad`` at the optimizer step counts
how often each item reached it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchfit.errors import BatchfitError, DoesNotFitError
from batchfit.runtime.simulated import SimulatedDevice
from batchfit.train.trainer import Trainer

MiB = 2**20
IGNORE = -100
FEATURES = 32768  # mean model: 256 KiB per float64 item, so a host global batch of 80 items is 20 MiB
HIDDEN = 16
CLASSES = 3
SEQ, VOCAB, EMBED = 16, 512, 64  # token model: 64 KiB of float64 logits per sequence
OUTCOMES = ("exact", "re-split", "refused", "other")
TOLERANCE = {"float64": 1e-12, "float32": 1e-3}
"""Largest relative difference from the full-batch reference (max |a - b| / max |b| per tensor).

Measured on 120 cases on a GPU too large to re-split: float64 up to 1.6e-13 (AdamW), 3e-15 (SGD);
float32 up to 2.3e-5 (AdamW), 3e-7 (SGD), and 1.4e-4 seen (AdamW: 32768-term dot products summed
in another order per micro-batch size, then normalised by Adam). A wrong split is far above: one of
80 items used twice and another never gives 0.1 (SGD) to 1.1 (AdamW), and the item count catches it."""


@dataclass(frozen=True)
class Case:
    """One generated run."""

    global_batch_size: int
    micro_batch_size: int
    steps: int
    optimizer: str
    """``sgd-momentum`` or ``adamw``."""
    clip: float | None
    loss: str
    """``mean`` (cross-entropy over items) or ``tokens`` (a sum over non-padding tokens)."""
    dtype: str
    """``float64`` or ``float32``."""
    capacity_mib: int
    entered: bool
    """True: the caller enters the device (``with gpu:``); False: it is only passed to the Trainer."""
    scheduled: bool
    seed: int


@dataclass(frozen=True)
class Outcome:
    kind: str
    """One of ``OUTCOMES``."""
    detail: str = ""


class MeanModel(nn.Module):
    def __init__(self, n_ids: int) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, CLASSES)
        self.tag = nn.Parameter(torch.zeros(n_ids))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))  # (b, classes)


class TokenModel(nn.Module):
    def __init__(self, n_ids: int) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, EMBED), nn.Linear(EMBED, VOCAB)
        self.tag = nn.Parameter(torch.zeros(n_ids))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(idx)))  # (b, t, vocab)


def _tag_term(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    tag = model.tag[ids]  # (b,)
    return tag - tag.detach()  # zero in value; gradient 1 per item


def mean_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, ids = batch
    return (F.cross_entropy(model(x), y, reduction="none") + _tag_term(model, ids)).mean()


def token_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    idx, targets, ids = batch
    logits = model(idx)
    total = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return total + _tag_term(model, ids).sum(), (targets != IGNORE).sum()


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The run's global batches, on the host (made before any device is entered)."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    n, out = case.global_batch_size, []
    for t in range(case.steps):
        ids = torch.arange(t * n, (t + 1) * n)
        if case.loss == "mean":
            x = torch.randn(n, FEATURES, generator=gen, dtype=dtype)
            out.append((x, torch.randint(0, CLASSES, (n,), generator=gen), ids))
        else:
            idx = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
            targets = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
            lengths = torch.randint(1, SEQ + 1, (n,), generator=gen)  # at least one real token per item
            pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
            out.append((idx.masked_fill(pad, 0), targets.masked_fill(pad, IGNORE), ids))
    return out


def build(case: Case) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model (float ``case.dtype``), its optimizer over everything but ``tag``, and a scheduler."""
    torch.manual_seed(case.seed)
    n_ids = case.global_batch_size * case.steps
    model = (MeanModel(n_ids) if case.loss == "mean" else TokenModel(n_ids)).to(getattr(torch, case.dtype))
    params = [p for name, p in model.named_parameters() if name != "tag"]
    if case.optimizer == "adamw":
        # With Adam's default eps (1e-8), a gradient component that nearly cancels over the items (there
        # are half a million here) is updated by about lr * sign(g): its summation-order rounding, 1e-16
        # of the terms, becomes a parameter difference of up to 2 lr (seen: 1.8e-9 relative in float64,
        # 5e-3 in float32). A larger eps keeps the update linear in g, so the comparison measures the
        # split, not Adam's amplification of rounding (test_accumulate checks the default eps, on a model
        # with no such components).
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)
    else:
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7) if case.scheduled else None
    return model, optimizer, scheduler


def divisors(case: Case, data: list) -> list[float]:
    """Per step, the ``N`` that turns ``tag.grad`` into use counts (see the module docstring)."""
    if case.loss == "mean":
        return [float(case.global_batch_size)] * case.steps
    tokens = [float((targets != IGNORE).sum()) for _, targets, _ in data]
    return [float(case.global_batch_size)] + tokens[:-1]


def reference(case: Case, data: list) -> nn.Module:
    """One plain full-batch step per global batch: forward of every item, backward, clip, step, schedule."""
    model, optimizer, scheduler = build(case)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for batch in data:
        out = (mean_loss if case.loss == "mean" else token_loss)(model, batch)
        (out if isinstance(out, torch.Tensor) else out[0] / out[1]).backward()
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, case.clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        model.tag.grad = None
    return model


def train(case: Case, data: list) -> tuple[nn.Module, list, list[list[float]]]:
    """The Trainer's run: the model, the step results and each step's ``tag.grad`` (read on the host)."""
    model, optimizer, scheduler = build(case)
    grads: list[list[float]] = []

    def read_tags(opt: Any, args: Any, kwargs: Any) -> None:
        grads.append(model.tag.grad.tolist())  # a host read: allocates nothing on the device
        model.tag.grad = None

    optimizer.register_step_pre_hook(read_tags)
    gpu = SimulatedDevice(case.capacity_mib * MiB)
    with gpu if case.entered else contextlib.nullcontext():
        trainer = Trainer(
            model,
            optimizer,
            mean_loss if case.loss == "mean" else token_loss,
            global_batch_size=case.global_batch_size,
            micro_batch_size=case.micro_batch_size,
            device=gpu,
            max_grad_norm=case.clip,
            scheduler=scheduler,
        )
        results = [trainer.step(batch) for batch in data]
    return model, results, grads


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        ((p - q).abs().max() / q.abs().max().clamp_min(1e-300)).item()
        for (name, p), q in zip(a.named_parameters(), b.parameters())
        if name != "tag"
    )


def run_case(case: Case) -> Outcome:
    """Run ``case`` and classify it (see the module docstring)."""
    data = batches(case)
    try:
        model, results, grads = train(case, data)
    except DoesNotFitError as exc:
        if "\n" in str(exc) or not str(exc):
            return Outcome("other", f"a refusal of several lines: {exc!r}")
        return Outcome("refused", str(exc))
    except BatchfitError as exc:
        return Outcome("other", f"{type(exc).__name__} on valid input: {exc}")
    except Exception as exc:  # noqa: BLE001 - the point is to classify everything
        return Outcome("other", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    diff = max_rel_diff(model, reference(case, data))
    if not diff <= TOLERANCE[case.dtype]:
        return Outcome("other", f"finished but differs from the full batch by {diff:.3g}")
    if len(grads) != case.steps:
        return Outcome("other", f"{len(grads)} optimizer steps for {case.steps} global batches")
    n = case.global_batch_size
    for t, (step_grads, divisor) in enumerate(zip(grads, divisors(case, data))):
        uses = [g * divisor for g in step_grads]
        expected = [1.0 if t * n <= i < (t + 1) * n else 0.0 for i in range(len(uses))]
        if any(not math.isclose(u, e, abs_tol=1e-6) for u, e in zip(uses, expected)):
            wrong = [i for i, (u, e) in enumerate(zip(uses, expected)) if not math.isclose(u, e, abs_tol=1e-6)]
            return Outcome("other", f"step {t}: items {wrong[:8]} used {[round(uses[i], 3) for i in wrong[:8]]} times")
    if any(sum(r.micro_batch_sizes) != n for r in results):
        return Outcome("other", f"micro-batches of {[r.micro_batch_sizes for r in results]} for {n} items")
    return Outcome("re-split" if any(r.replanned for r in results) else "exact")


def case_from(draw: Any, seed: int) -> Case:
    """A case from ``draw(low, high)`` (inclusive integers) and ``seed``: the one generator of both the
    property tests (hypothesis draws) and the benchmark (``random.Random.randint``)."""
    global_batch_size = draw(4, 80)
    return Case(
        global_batch_size=global_batch_size,
        micro_batch_size=draw(1, global_batch_size),
        steps=draw(1, 3),
        optimizer=("sgd-momentum", "adamw")[draw(0, 1)],
        clip=(None, 0.5)[draw(0, 1)],
        loss=("mean", "tokens")[draw(0, 1)],
        dtype=("float64", "float32")[draw(0, 1)],
        capacity_mib=draw(24, 72),
        entered=bool(draw(0, 1)),
        scheduled=bool(draw(0, 1)),
        seed=seed,
    )
