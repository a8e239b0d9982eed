"""Where the caching allocator grew: the segments (cudaMalloc) of a memory snapshot, in order, each with the
allocation that asked for it and what was allocated and reserved then.

Reserved memory above the allocated peak comes from the moments a request found no cached block large
enough. Printed for a real step's snapshot (``benchmarks/gpu_truth.py --snapshots DIR``) and for the
estimate's (``batchfit report ... --snapshot FILE``), the two lists show where a real step reserves what
the allocator model did not: which request, of what size, with how much already allocated.

Run: ``python benchmarks/snapshot_segments.py SNAPSHOT.pickle [SNAPSHOT.pickle ...] [--top N]``
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Any

MiB = 2**20


def segments(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``segment_alloc`` of device 0's trace with the request after it and the running totals."""
    events = snapshot.get("device_traces", [[]])[0]
    allocated = reserved = 0
    out: list[dict[str, Any]] = []
    for i, e in enumerate(events):
        action, size = e.get("action"), int(e.get("size", 0))
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action == "segment_free":
            reserved -= size
        elif action == "segment_alloc":
            reserved += size
            request = next((n for n in events[i + 1 : i + 4] if n.get("action") == "alloc"), {})
            frames = request.get("frames") or []
            where = next((f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '')}" for f in frames
                          if "torch/" not in str(f.get("filename", ""))), frames[0].get("name", "") if frames else "")
            out.append({"index": i, "segment": size, "request": int(request.get("size", 0)),
                        "allocated": allocated, "reserved": reserved, "where": where})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="+", help="memory snapshot pickles")
    parser.add_argument("--top", type=int, default=0, help="only the N largest segments (default: all)")
    args = parser.parse_args(argv)
    for path in args.snapshots:
        with Path(path).open("rb") as f:
            rows = segments(pickle.load(f))
        shown = sorted(rows, key=lambda r: -r["segment"])[: args.top] if args.top else rows
        total = sum(r["segment"] for r in rows)
        print(f"{path}: {len(rows)} segments, {total / MiB:,.1f} MiB")
        print(f"{'event':>7} {'segment MiB':>12} {'request MiB':>12} {'allocated MiB':>14} {'reserved MiB':>13}  where")
        for r in shown:
            print(f"{r['index']:>7} {r['segment'] / MiB:>12,.1f} {r['request'] / MiB:>12,.1f} "
                  f"{r['allocated'] / MiB:>14,.1f} {r['reserved'] / MiB:>13,.1f}  {r['where']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
