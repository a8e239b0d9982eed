"""Data parallelism on the CPU: 1 vs 2 processes (torchrun, gloo) at the same global batch.

Each configuration runs ``batchfit train`` for real under ``python -m torch.distributed.run``; the
step times come from the run's own JSON (rank 0), warm-up steps excluded, median reported. Runs of
the two configurations are interleaved so machine load affects both alike. On a 2-core machine the
second process competes with the first for the cores, so expect a ratio near 1, not 2: the table is
about the overhead of the collective (gloo all-reduce once per optimizer step), not about speed-up.

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


def run(nproc: int) -> list[float]:
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
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=True)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return [row["seconds"] for row in summary["steps"][WARMUP:]]


def main() -> None:
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(REPEATS):
        for nproc in (1, 2):
            times[nproc].extend(run(nproc))
    table = Table(title=f"data parallel on CPU (gloo): global batch {GLOBAL_BATCH}, median of {len(times[1])} steps")
    for col in ("processes", "s / step", "items / s", "ratio to 1 process"):
        table.add_column(col, justify="right")
    base = statistics.median(times[1])
    for nproc, ts in times.items():
        med = statistics.median(ts)
        table.add_row(str(nproc), f"{med:.4f}", f"{GLOBAL_BATCH / med:,.0f}", f"{base / med:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
