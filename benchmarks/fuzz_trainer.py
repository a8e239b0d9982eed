"""Generated Trainer runs on simulated GPUs: how each ends (exact, re-split, refused, other), and a CLI fuzz.

Every run is a ``tests/fuzz_cases.Case`` (global batch 4-80, a random micro-batch, 1-3 steps, SGD with
momentum or AdamW, clipping on/off, a mean or a padded token loss, float64 or float32, a simulated GPU
of 24-72 MiB that the caller enters or only passes to the Trainer), drawn from ``random.Random(seed)``.
A finished run must equal the full-batch reference (float64: 1e-12, float32: 1e-4, relative) and use
every item exactly once; otherwise it must end in one ``DoesNotFitError``. ``other`` counts everything
else and must be 0. Then ``batchfit.cli.main`` is fed generated argument lists (``tests/cli_fuzz.py``):
each must exit 0, or print exactly one ``batchfit: error:`` line and no traceback.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/fuzz_trainer.py [--runs 500] [--cli 300] [--seed 0]``
(a few minutes on one core; exits 1 if any run is ``other``).
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from cli_fuzz import check_argv, random_argv  # noqa: E402
from fuzz_cases import OUTCOMES, case_from, run_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--cli", type=int, default=300, help="generated command lines")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--show", type=int, default=5, help="examples shown per outcome")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("batchfit").setLevel(logging.ERROR)  # re-plans are counted, not printed

    counts: collections.Counter[str] = collections.Counter()
    by_kind: dict[str, list[str]] = collections.defaultdict(list)
    by_detail: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for seed in range(args.seed, args.seed + args.runs):
        rng = random.Random(seed)
        case = case_from(rng.randint, seed)
        outcome = run_case(case)
        counts[outcome.kind] += 1
        if outcome.kind in ("refused", "other"):
            by_detail[f"{outcome.kind}: {_where(outcome.detail)}"] += 1
        if len(by_kind[outcome.kind]) < args.show:
            by_kind[outcome.kind].append(f"{case} -> {outcome.detail[:200]}")
    seconds = time.perf_counter() - start

    print(f"{args.runs} generated Trainer runs (seeds {args.seed}..{args.seed + args.runs - 1}), {seconds:.0f} s")
    print(f"{'outcome':<10} {'runs':>6} {'share':>7}")
    for kind in OUTCOMES:
        print(f"{kind:<10} {counts[kind]:>6} {counts[kind] / args.runs:>7.1%}")
    print("\nrefusals and failures by where they struck:")
    for detail, n in by_detail.most_common():
        print(f"  {n:>5}  {detail}")
    for kind in ("re-split", "refused", "other"):
        for line in by_kind[kind]:
            print(f"  e.g. {kind}: {line}")

    cli_counts: collections.Counter[str] = collections.Counter()
    rng = random.Random(args.seed)
    bad: list[str] = []
    unexpected: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for _ in range(args.cli):
        argv = random_argv(rng.randint, rng.choice)
        verdict = check_argv(argv)
        cli_counts[verdict.kind] += 1
        if verdict.unexpected:
            cli_counts["unexpected"] += 1
            unexpected[verdict.detail.split(": ", 3)[2]] += 1
        if verdict.kind == "bad" and len(bad) < args.show:
            bad.append(f"{argv} -> {verdict.detail}")
    print(f"\n{args.cli} generated command lines, {time.perf_counter() - start:.0f} s: "
          f"{cli_counts['ok']} exit 0, {cli_counts['error']} one error line "
          f"({cli_counts['unexpected']} of them an unexpected exception), {cli_counts['bad']} bad")  # fmt: skip
    for line in bad:
        print(f"  bad: {line}")
    for kind, n in unexpected.most_common():
        print(f"  {n:>5}  {kind}")
    return 1 if counts["other"] or cli_counts["bad"] else 0


def _where(detail: str) -> str:
    """The message up to its first parenthesis or colon, the capacity left out: refusals by where they struck."""
    for sep in (" (", ": "):
        if sep in detail:
            detail = detail.split(sep)[0]
    return re.sub(r"a simulated [0-9.]+ MiB GPU", "the simulated GPU", detail)[:120]


if __name__ == "__main__":
    sys.exit(main())
