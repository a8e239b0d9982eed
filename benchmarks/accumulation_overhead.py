"""Overhead of ``Trainer.step`` over a hand-written accumulation loop (target: ratio <= 1.02).

Both run the same model, data, optimizer and micro-batch split on the CPU; the hand-written loop is the
usual one done right (slice, forward, ``loss * n / N``, backward, one optimizer step, ``zero_grad``,
one ``.item()`` for the logged loss). The Trainer adds what it is for: shape checks, the count
weighting, ``no_sync`` and autocast contexts, OOM bookkeeping, the device copy seam. Timings are medians
of interleaved runs (A, B, B, A, ...), so drifts hit both sides alike, and they are the process's CPU
time rather than wall time: with one intra-op thread every kernel (autograd's CPU backward included)
runs on the calling thread, and on a shared machine other processes' load moves wall time by more than
the overhead being measured.

Run: ``python benchmarks/accumulation_overhead.py``
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

from batchfit.batching import split_batch
from batchfit.train.accumulate import micro_batch_sizes
from batchfit.train.trainer import Trainer

ROUNDS = 41  # interleaved blocks per configuration
STEPS_PER_BLOCK = 1
WARMUP_STEPS = 3

CONFIGS = [  # (name, width, depth, global batch, micro-batch)
    ("linear (overhead floor)", 0, 0, 256, 32),
    ("MLP 128-256x3-10", 256, 3, 256, 32),
    ("MLP 128-768x4-10", 768, 4, 256, 32),
]


def make_model(width: int, depth: int) -> nn.Module:
    if depth == 0:  # almost no compute: what remains is per-micro-batch Python overhead
        return nn.Linear(128, 10)
    layers: list[nn.Module] = [nn.Linear(128, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def hand_written(model: nn.Module, optimizer: torch.optim.Optimizer, sizes: list[int]) -> Callable:
    n = sum(sizes)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        logged = torch.zeros(())
        for micro in split_batch(batch, sizes):
            loss = loss_fn(model, micro)
            (loss * (micro[0].shape[0] / n)).backward()  # count-weighted, as the Trainer does
            logged += loss.detach() * micro[0].shape[0]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return (logged / n).item()

    return step


def measure(name: str, width: int, depth: int, global_batch: int, micro: int) -> dict[str, float | str]:
    torch.manual_seed(0)
    base = make_model(width, depth)
    hand_model, trainer_model = make_model(width, depth), make_model(width, depth)
    hand_model.load_state_dict(base.state_dict())
    trainer_model.load_state_dict(base.state_dict())
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-3)
    trainer_opt = torch.optim.AdamW(trainer_model.parameters(), lr=1e-3)
    sizes = micro_batch_sizes(global_batch, micro)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(global_batch, 128, generator=gen), torch.randint(0, 10, (global_batch,), generator=gen))
               for _ in range(4)]
    hand = hand_written(hand_model, hand_opt, sizes)
    trainer = Trainer(trainer_model, trainer_opt, loss_fn, global_batch_size=global_batch, micro_batch_size=micro)
    runners: dict[str, Callable] = {"hand": hand, "trainer": lambda b: trainer.step(b).loss}

    times: dict[str, list[float]] = {"hand": [], "trainer": []}
    for i in range(WARMUP_STEPS):
        for run in runners.values():
            run(batches[i % len(batches)])
    for r in range(ROUNDS):
        order = ("hand", "trainer") if r % 2 == 0 else ("trainer", "hand")
        for key in order:
            start = time.process_time()
            for s in range(STEPS_PER_BLOCK):
                runners[key](batches[(r + s) % len(batches)])
            times[key].append((time.process_time() - start) / STEPS_PER_BLOCK)
    hand_ms = statistics.median(times["hand"]) * 1e3
    trainer_ms = statistics.median(times["trainer"]) * 1e3
    diff = max((p - q).abs().max().item() for p, q in zip(hand_model.parameters(), trainer_model.parameters()))
    return {
        "name": name,
        "split": f"{global_batch} = {micro} x {len(sizes)}",
        "hand_ms": hand_ms,
        "trainer_ms": trainer_ms,
        "ratio": trainer_ms / hand_ms,
        "per_micro_us": (trainer_ms - hand_ms) * 1e3 / len(sizes),
        "diff": diff,
    }


def main() -> None:
    torch.set_num_threads(1)
    rows = [measure(*config) for config in CONFIGS]
    table = Table(
        title="Trainer.step vs a hand-written accumulation loop (CPU, 1 thread, AdamW; median CPU time of "
        f"{ROUNDS} interleaved runs)"
    )
    for column in ("workload", "global = micro x steps", "hand-written ms/step", "Trainer ms/step", "ratio",
                   "extra us/micro-batch", "max |param diff|"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for row in rows:
        table.add_row(
            str(row["name"]), str(row["split"]), f"{row['hand_ms']:.2f}", f"{row['trainer_ms']:.2f}",
            f"{row['ratio']:.3f}", f"{row['per_micro_us']:.0f}", f"{row['diff']:.1e}",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
