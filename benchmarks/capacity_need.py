"""The smallest capacity a recorded step completes in: the GPU's own allocator stream against the trace's.

``fit`` decides with the allocator model replayed at the GPU's capacity (NOTE [ Reserved memory near the capacity ]
in ``memory/estimate.py``): what it must get right is not the reserved peak of an unbounded run, which a real
allocator gives back when memory runs short, but the least capacity at which the step still completes. This
script measures that quantity on both sides for every recorded step that ran (``benchmarks/results/snapshots-*``
with the rows of the CSVs beside them): the GPU's stream is replayed through the allocator model (exact against
the GPU's own decisions, ``benchmarks/snapshot_replay.py``) at decreasing capacities, and so is the trace of the
same step; each capacity is the smallest (to 2 MiB, a large segment's granularity) at which the replay finishes in
the order of segment addresses ``fit`` uses for the row's torch (NOTE [ Fits whatever addresses the driver gives ]),
the trace's cuDNN workspaces optional as in ``fit``'s replay. A negative shortfall is capacity the GPU needed and
the trace did not: what ``fit`` would have to keep free for the step's family (``planning/known_error.py``).

The GPU's stream is a fixed sequence: replayed at a capacity below the one it ran under, a cuDNN workspace that
runs out of memory fails the replay, where the real ``try_configs`` would have fallen back to an engine that needs
less. So for convolutional steps the GPU's figure is an upper bound, and a large negative shortfall there may be
that fall-back rather than the trace (VGG-16's 784 MiB workspace is one).

Run: ``.venv/bin/python benchmarks/capacity_need.py [--cases a,b] [SNAPSHOT ...]`` (a few minutes: one trace and
about forty allocator replays per row).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from stream_diff import real_calls  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MiB = 2**20
_NAME = re.compile(r"snapshot-(.+)-(fp32|bf16|fp16|bf16-true)-(\d+)(?:-cap(\d+))?\.pickle")


def _truth() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_truth", ROOT / "benchmarks" / "gpu_truth.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_truth"] = module
    spec.loader.exec_module(module)
    return module


def recorded_rows() -> dict[str, dict[str, str]]:
    """Every measured row that names a snapshot, by the snapshot's file name."""
    rows = {}
    for path in sorted(RESULTS.glob("gpu_truth-*.csv")):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                if row.get("snapshot"):
                    rows[row["snapshot"]] = row
    return rows


def completes(calls: Any, capacity: int, descending: bool) -> bool:
    """Whether ``calls`` (``replay``'s events) finish within ``capacity`` bytes, new segments' addresses
    descending or not (the order ``fit`` replays for the row's torch: ``memory/estimate.allocator_tie_order``)."""
    from batchfit.memory.allocator.caching import replay

    return replay(calls, capacity_bytes=capacity, descending_addresses=descending).oom_at_event is None


def smallest_capacity(calls: Any, descending: bool) -> int:
    """The least capacity (a multiple of 2 MiB) at which ``calls`` complete: at least their allocated peak, at most
    their unbounded reserved peak, which always suffices."""
    from batchfit.memory.allocator.caching import replay

    unbounded = replay(calls, descending_addresses=descending)
    lo = -(-unbounded.peak_allocated_bytes // (2 * MiB)) - 1  # below the allocated peak: never completes
    hi = unbounded.peak_reserved_bytes // (2 * MiB) + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if completes(calls, mid * 2 * MiB, descending) else (mid, hi)
    return hi * 2 * MiB


def measure(path: Path, row: dict[str, str], truth: Any) -> dict[str, Any] | None:
    """The row's two smallest capacities and the trace's families (None: not a step that ran, or no case)."""
    from batchfit.memory.allocator.stream_replay import load_snapshot, tie_order_for
    from batchfit.memory.estimate import _storage_events, trace_for_device
    from batchfit.planning.known_error import families
    from batchfit.precision import policy_for

    named = _NAME.match(path.name)
    if named is None or row.get("result", "ran") != "ran" or row.get("error") or row["case"] not in truth.BY_NAME:
        return None
    case, precision, batch = named.group(1), named.group(2), int(named.group(3))
    device = truth._replay_device(row["gpu"], row.get("capacity") or None, None, {})[0]
    policy = policy_for(precision, bf16_supported=device.bf16, device_name=device.name)
    from batchfit.activation_checkpointing import checkpoint_classes

    c = truth.BY_NAME[case]
    workload = c.make()
    trace = trace_for_device(workload, batch, device, policy, checkpoint_classes(c.blocks, workload.checkpoint_blocks))
    descending = tie_order_for(row.get("torch") or None) == "address"
    gpu = smallest_capacity(real_calls(load_snapshot(path)), descending)
    traced = smallest_capacity(_storage_events(trace, fallbacks=True), descending)  # as the estimate replays it
    return {"case": case, "precision": precision, "batch": batch, "cap": named.group(4), "gpu": gpu, "trace": traced,
            "shortfall": (traced - gpu) / gpu, "families": sorted(families(trace))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="*", help="snapshot files (default: every one in benchmarks/results)")
    parser.add_argument("--cases", help="comma-separated case names to keep")
    args = parser.parse_args(argv)
    truth, rows = _truth(), recorded_rows()
    paths = [Path(p) for p in args.snapshots] or sorted(RESULTS.glob("snapshots-*/*.pickle.gz"))
    keep = set(args.cases.split(",")) if args.cases else None
    measured = []
    for path in paths:
        row = rows.get(path.name)
        if row is None or (keep is not None and row["case"] not in keep):
            continue
        m = measure(path, row, truth)
        if m is None:
            continue
        measured.append(m)
        cap = f" capped at {int(m['cap']) / 2**30:g} GiB" if m["cap"] else ""
        print(f"{m['case']} {m['precision']} {m['batch']}{cap}: GPU {m['gpu'] / MiB:,.0f} MiB, trace "
              f"{m['trace'] / MiB:,.0f} MiB ({m['shortfall']:+.2%}; {', '.join(m['families']) or 'no family'})",
              flush=True)  # fmt: skip
    by_family: dict[str, list[float]] = {}
    for m in measured:
        for family in m["families"] or ["other"]:
            by_family.setdefault(family, []).append(m["shortfall"])
    for family, errors in sorted(by_family.items()):
        worst = min(errors)
        print(f"{family}: {len(errors)} rows, median {statistics.median(errors):+.2%}, worst {worst:+.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
