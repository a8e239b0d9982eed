"""Where the test suite's time goes: every step it traces, by test file, and how much of it traces a step
another test already traced.

Runs ``make test``'s pytest command with this file loaded as a plugin (``-p suite_traces``), which wraps
``trace_workload`` (one traced step), ``_trace_for_device`` (the same, with the trace cache's key of the step)
and ``measure_cpu_peak`` (a real CPU step) and writes one JSON line per call: the test, what ran, its seconds
and the key. Then it prints, side by side from that one run: the tests' own time (pytest's durations), the
time in traced steps, in real CPU steps, and the seconds spent tracing a step whose key an earlier call
already had (what sharing traces between tests could save at most), by file and in total.

Run: ``.venv/bin/python benchmarks/suite_traces.py`` (the length of ``make test``; extra arguments go to
pytest, e.g. ``tests/test_depth.py``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOG = "BATCHFIT_SUITE_TRACES_LOG"


def _logged(kind: str, fn: Any, key: Any = None) -> Any:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            try:
                step = key(*args, **kwargs) if key is not None else None
            except Exception:  # noqa: BLE001 - a step without a key is logged without one
                step = None
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            with open(os.environ[LOG], "a") as f:
                f.write(json.dumps({"test": test, "kind": kind, "seconds": seconds, "key": step}) + "\n")

    return inner


def pytest_configure(config: Any) -> None:
    """As a pytest plugin: wrap the three calls where every module that uses them looks them up."""
    if LOG not in os.environ:
        return
    import batchfit.memory.estimate as estimate
    import batchfit.memory.measure as measure
    import batchfit.memory.trace.fake_step as fake_step
    import batchfit.planning.sweep as sweep

    fake_step.trace_workload = estimate.trace_workload = _logged("trace", fake_step.trace_workload)
    estimate._trace_for_device = _logged("step", estimate._trace_for_device, estimate._cache_key)
    measure.measure_cpu_peak = sweep.measure_cpu_peak = _logged("measure", measure.measure_cpu_peak)


def _durations(output: str) -> dict[str, float]:
    """pytest's ``--durations=0`` lines, summed by test file."""
    out: dict[str, float] = defaultdict(float)
    for seconds, path in re.findall(r"^([0-9.]+)s (?:call|setup|teardown) +([^:\s]+)::", output, re.M):
        out[path] += float(seconds)
    return out


def summarise(rows: list[dict[str, Any]], durations: dict[str, float]) -> list[tuple[str, float, float, float, float]]:
    """Per test file (and ``total``): the tests' time, traced steps, real CPU steps, and steps traced again."""
    traced: dict[str, float] = defaultdict(float)
    measured: dict[str, float] = defaultdict(float)
    again: dict[str, float] = defaultdict(float)
    seen: set[str] = set()
    for row in rows:
        path = row["test"].split("::")[0]
        if row["kind"] == "trace":
            traced[path] += row["seconds"]
        elif row["kind"] == "measure":
            measured[path] += row["seconds"]
        elif row["key"] is not None:
            if row["key"] in seen:
                again[path] += row["seconds"]
            seen.add(row["key"])
    files = sorted(set(durations) | set(traced), key=lambda p: -durations.get(p, 0.0))
    table = [(p, durations.get(p, 0.0), traced[p], measured[p], again[p]) for p in files]
    total = ("total", *(sum(r[i] for r in table) for i in range(1, 5)))
    return [total, *table]  # type: ignore[list-item]


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "calls.jsonl"
        env = dict(os.environ, **{LOG: str(log), "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"),
                                                                                 os.environ.get("PYTHONPATH", "")])})
        command = [sys.executable, "-m", "pytest", "-q", "-n", "auto", "--maxprocesses=4", "--dist", "worksteal",
                   "-p", "suite_traces", "-p", "no:cacheprovider", "--durations=0", "--durations-min=0",
                   *sys.argv[1:]]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "(no output)"
    table = Table(title=f"the suite in {wall:.0f} s wall ({summary}): seconds of worker time", title_justify="left")
    for col in ("test file", "tests", "traced steps", "share", "real CPU steps", "traced again"):
        table.add_column(col, justify="left" if col == "test file" else "right")
    for path, tests, traced, measured, again in summarise(rows, _durations(done.stdout))[:31]:
        share = f"{100 * traced / tests:.0f}%" if tests else "-"
        table.add_row(path, f"{tests:.1f}", f"{traced:.1f}", share, f"{measured:.1f}", f"{again:.1f}")
    Console(width=160).print(table)
    print(f"{sum(r['kind'] == 'trace' for r in rows)} steps traced")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
