"""Data parallelism on the CPU: 1 vs 2 processes (torchrun, gloo) at the same global batch, DDP and FSDP.

Each configuration runs ``batchfit train`` for real under ``python -m torch.distributed.run``; the
step times come from the run's own JSON (rank 0), warm-up steps excluded, median reported. Runs of
the two configurations are interleaved so machine load affects both alike. On a 2-core machine the
second process competes with the first for the cores, so expect a ratio near 1, not 2: the table is
about the overhead of the collectives, not about speed-up: DDP all-reduces once per optimizer step;
FSDP (``--shard``) all-gathers every unit's parameters in each micro-batch's forward and backward and
reduce-scatters its gradients after each micro-batch (the price of holding 1/2 of the model per rank).

Run: ``.venv/bin/python benchmarks/data_parallel.py``
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from rich.console import Console
from rich.table import Table

GLOBAL_BATCH = 512
STEPS = 12
WARMUP = 2
REPEATS = 3
PRESET = ["mlp", "--set", "hidden=512", "--set", "depth=4"]


CONFIGS = {"1 process": (1, ()), "2 processes, DDP": (2, ()), "2 processes, FSDP": (2, ("--shard",))}


def run(nproc: int, extra: tuple[str, ...]) -> list[float]:
    """Seconds per step (rank 0's view) of one run with ``nproc`` processes."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "batchfit",
        "train",
        *PRESET,
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--micro-batch-size",
        str(GLOBAL_BATCH // 4),
        "--steps",
        str(STEPS),
        "--json",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=True)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return [row["seconds"] for row in summary["steps"][WARMUP:]]


def main() -> None:
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(REPEATS):
        for name, (nproc, extra) in CONFIGS.items():
            times[name].extend(run(nproc, extra))
    steps = len(times["1 process"])
    table = Table(title=f"data parallel on CPU (gloo): global batch {GLOBAL_BATCH}, median of {steps} steps")
    for col in ("run", "s / step", "items / s", "ratio to 1 process"):
        table.add_column(col, justify="right")
    base = statistics.median(times["1 process"])
    for name, ts in times.items():
        med = statistics.median(ts)
        table.add_row(name, f"{med:.4f}", f"{GLOBAL_BATCH / med:,.0f}", f"{base / med:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
