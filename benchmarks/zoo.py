"""The zoo (``tests/zoo.py``) as a table: CPU estimate vs the CPU allocator's peak, and a GPU estimate.

For every architecture: the CPU estimate (two steps traced on fake tensors, CPU kernels replayed) against
``measure_cpu_peak`` (the same two steps run for real, the CPU allocator's events summed from the
profiler), the difference, and the estimate for an A100-80GB (device total, default context). Ends
with the count of exact / within 0.5% / failing entries. ``tests/test_zoo.py`` asserts the same.

Run: ``.venv/bin/python benchmarks/zoo.py [name ...]`` (a few minutes; exits 1 if any entry fails).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zoo import BY_NAME, ZOO  # noqa: E402

import batchfit  # noqa: E402
from batchfit.memory.measure import measure_cpu_peak  # noqa: E402
from batchfit.units import format_bytes  # noqa: E402


def main(names: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(1)
    entries = [BY_NAME[n] for n in names] if names else ZOO
    table = Table(title="the zoo: CPU estimate vs profiler peak, and an A100-80GB estimate", title_justify="left")
    for col, justify in (("architecture", "left"), ("family", "left"), ("CPU estimate B", "right"),
                         ("CPU profiler B", "right"), ("difference", "right"), ("A100-80GB total", "right"),
                         ("notes", "right"), ("s", "right")):  # fmt: skip
        table.add_column(col, justify=justify)
    exact = close = failing = 0
    for entry in entries:
        start = time.perf_counter()
        try:
            workload = entry.make()
            est = batchfit.estimate(workload, entry.batch_size, device="cpu")
            real = measure_cpu_peak(workload, entry.batch_size)
            gpu = batchfit.estimate(workload, entry.batch_size, device="A100-80GB")
        except Exception as e:  # noqa: BLE001 - a failing entry is a row, not a crash
            failing += 1
            table.add_row(entry.name, entry.family, "-", "-", f"[red]{type(e).__name__}: {str(e)[:60]}[/red]",
                          "-", "-", f"{time.perf_counter() - start:.1f}")  # fmt: skip
            continue
        diff = est.peak_allocated_bytes - real
        rel = abs(diff) / real
        if diff == 0:
            exact += 1
        elif rel <= 0.005:
            close += 1
        else:
            failing += 1
        table.add_row(entry.name, entry.family, f"{est.peak_allocated_bytes:,}", f"{real:,}",
                      "0" if diff == 0 else f"{diff:+,} ({rel:.2%})", format_bytes(gpu.device_total_bytes),
                      str(len(est.notes)), f"{time.perf_counter() - start:.1f}")  # fmt: skip
    console = Console()
    console.print(table)
    console.print(f"{len(entries)} architectures: {exact} exact, {close} within 0.5%, {failing} failing")
    return 1 if failing else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
