"""How long a plan takes: one estimate, a plan with an empty trace cache, and the same plan again.

Two cases, each in fresh subprocesses so that every figure includes what a user's command pays:

* ``hf-llama-7b`` (6.7B, seq 4096), global batch 64 on 8 x A100-80GB;
* ``gpt`` (GPT-2 small, seq 1024), global batch 512 on one V100-16GB.

For each: one ``estimate`` at batch 1 (no cache), the ``plan`` with an empty cache ("cold": how many
steps it traced, and its time as a multiple of the estimate's), once fitting one configuration at a
time (``BATCHFIT_WORKERS=1``) and once as a user's command runs it (configurations fitted ahead in as
many processes as the machine has cores, ``planning/parallel.py``), the same plan in a new process with
the cache the cold one left ("warm": its time beyond the process's start-up, measured as the median
of three processes that do the same up to the plan call: import batchfit and build the preset's
workload, which for a transformers preset imports transformers). Targets: cold <= 3 estimates' time,
warm <= 1 s beyond start-up.

Run: ``.venv/bin/python benchmarks/plan_speed.py`` (several minutes: the 7B plan traces several
7B steps). ``benchmarks/trace_speed.py`` compares the trace itself with PyTorch's ``MemTracker``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = (
    ("hf-llama-7b", {}, 64, "A100-80GB", 8),
    ("gpt", {}, 512, "V100-16GB", 1),
)
TARGET_COLD_ESTIMATES = 3.0
TARGET_WARM_SECONDS = 1.0
STARTUP_RUNS = 3
"""Start-up reference runs per case (their median is subtracted from the warm plan's process time)."""


def _worker(kind: str, name: str, global_batch_size: int, device: str, gpus: int) -> dict[str, Any]:
    start = time.perf_counter()
    import batchfit
    from batchfit.cache import CACHE

    workload = batchfit.presets.get(name)
    if kind == "startup":  # the same process up to the plan call: imports and the workload, no plan
        return {"seconds": time.perf_counter() - start}
    begin = time.perf_counter()
    if kind == "estimate":
        batchfit.estimate(workload, 1, device=device)
    else:
        p = batchfit.plan(workload, global_batch_size, device=device, gpus=gpus)
    end = time.perf_counter()
    out = {"seconds": end - begin, "process_seconds": end - start, "traces": CACHE.misses}
    if kind != "estimate":
        out["plan"] = f"{p.micro_batch_size} x {p.accumulation_steps} x {p.gpus}, {p.precision}" + "".join(
            f", {r}" for r in p.remedies if "autocast" not in r
        )
    return out


def _run(kind: str, case: tuple, cache: str | None, workers: int | None = None) -> dict[str, Any]:
    name, _, global_batch_size, device, gpus = case
    env = dict(os.environ)
    if workers is not None:
        env["BATCHFIT_WORKERS"] = str(workers)
    if cache is None:
        env["BATCHFIT_CACHE"] = "0"
    else:
        env["BATCHFIT_CACHE_DIR"] = cache
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", kind, name, str(global_batch_size), device,
         str(gpus)],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - start
    return result


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="plan speed: fresh processes, traces counted by the trace cache", title_justify="left")
    from batchfit.planning.parallel import resolve_workers

    workers = resolve_workers(None)
    for col in ("case", "estimate s", "cold plan s, 1 process", "/ estimate", f"cold plan s, {workers} processes",
                "/ estimate", "traces", "warm plan s", "warm traces", "warm beyond start-up s", "plan"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("case", "plan") else "right")
    checks = {}
    for case in CASES:
        name, _, g, device, gpus = case
        label = f"{name}, G={g} on {gpus} x {device}"
        estimate = _run("estimate", case, None)
        with tempfile.TemporaryDirectory() as cache:
            serial = _run("plan", case, cache, workers=1)
        with tempfile.TemporaryDirectory() as cache:
            cold = _run("plan", case, cache)
            warm = _run("plan", case, cache)
        startup = statistics.median(_run("startup", case, None)["wall_seconds"] for _ in range(STARTUP_RUNS))
        beyond = warm["wall_seconds"] - startup
        ratio = cold["seconds"] / estimate["seconds"]
        table.add_row(label, f"{estimate['seconds']:.1f}", f"{serial['seconds']:.1f}",
                      f"{serial['seconds'] / estimate['seconds']:.1f}x", f"{cold['seconds']:.1f}", f"{ratio:.1f}x",
                      f"{serial['traces']} / {cold['traces']}", f"{warm['seconds']:.2f}", str(warm["traces"]),
                      f"{beyond:.2f}", cold["plan"])  # fmt: skip
        checks[f"{name}: cold <= {TARGET_COLD_ESTIMATES:.0f} estimates"] = ratio <= TARGET_COLD_ESTIMATES
        checks[f"{name}: warm <= {TARGET_WARM_SECONDS:.0f} s beyond start-up"] = beyond <= TARGET_WARM_SECONDS
    console = Console(width=200)
    console.print(table)
    console.print("  ".join(f"{k}: {'ok' if v else '[red]missed[/red]'}" for k, v in checks.items()))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))))
        sys.exit(0)
    sys.exit(main())
