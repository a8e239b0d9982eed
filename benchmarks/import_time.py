"""How long the commands that make no tensor take, against importing torch.

Each row is a fresh process (``python -m batchfit ...``), timed from spawn to exit; the median of
``--repeats`` runs, interleaved so that machine load falls on every row alike. The ratio column is
the row's median over ``python -c "import torch"``'s: below 1 means the command costs less than
torch's import alone. The last column says whether the process imported torch at all (read from
``python -X importtime``, which lists every module a process imports).

Target: ``--help``, ``--version``, ``gpus`` and ``presets`` import no torch and answer in well under
a second on an idle machine.

Run: ``.venv/bin/python benchmarks/import_time.py [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

BASELINE = ("import torch", [sys.executable, "-c", "import torch"])
COMMANDS = (
    ("batchfit --help", ["--help"]),
    ("batchfit --version", ["--version"]),
    ("batchfit gpus", ["gpus"]),
    ("batchfit presets", ["presets"]),
    ("batchfit estimate --help", ["estimate", "--help"]),
)


def _argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "batchfit", *args]


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def imports_torch(argv: list[str]) -> bool:
    """Whether the process imports torch: ``-X importtime`` writes one stderr line per module."""
    done = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True, check=True)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in done.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = [BASELINE, *((name, _argv(a)) for name, a in COMMANDS)]
    times: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _name, argv in rows:  # one untimed run each: the file cache warm for every row
        _seconds(argv)
    for _ in range(args.repeats):
        for name, argv in rows:
            times[name].append(_seconds(argv))
    base = statistics.median(times[BASELINE[0]])
    table = Table(title=f"Start-up time, median of {args.repeats} fresh processes")
    for column in ("command", "median s", "min s", "x import torch", "imports torch"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for name, argv in rows:
        median = statistics.median(times[name])
        torch_imported = "yes" if imports_torch(argv) else "no"
        table.add_row(name, f"{median:.3f}", f"{min(times[name]):.3f}", f"{median / base:.2f}", torch_imported)
    Console().print(table)


if __name__ == "__main__":
    main()
