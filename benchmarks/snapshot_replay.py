"""Real GPU memory snapshots replayed through the allocator model: is every decision the GPU's?

For each snapshot (``torch.cuda.memory._dump_snapshot``, e.g. those ``benchmarks/gpu_truth.py --snapshots
DIR`` writes, ``.pickle`` or ``.pickle.gz``) it prints the entries replayed, the real and the model's
reserved peak, the out-of-memory errors of each, the capacity the replay used and where it came from, and
the first difference (``batchfit.memory.allocator.stream_replay``). The torch that recorded a snapshot decides how
equal free blocks are ordered; give it with ``--torch`` when it is not the one installed here.

Run: ``python benchmarks/snapshot_replay.py PATH [PATH ...] [--torch 2.11.0] [--capacity BYTES]`` (a PATH may
be a folder: every snapshot in it). Exit status: 0 when every snapshot replays exactly, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from batchfit.errors import ConfigError  # noqa: E402
from batchfit.memory.allocator.stream_replay import StreamReplay, replay_snapshot  # noqa: E402

MiB = 2**20


def snapshot_files(paths: list[str]) -> list[Path]:
    """The snapshot files named, folders expanded to the ``*.pickle`` / ``*.pickle.gz`` inside, sorted."""
    files: list[Path] = []
    for name in paths:
        p = Path(name)
        files += sorted([*p.glob("*.pickle"), *p.glob("*.pickle.gz")]) if p.is_dir() else [p]
    return files


def row(name: str, r: StreamReplay) -> str:
    status = "exact" if r.exact else (f"not replayed: {r.unsupported}" if r.unsupported else f"{r.divergences} differ")
    capacity = "-" if r.capacity_bytes is None else f"{r.capacity_bytes / MiB:,.0f} ({r.capacity_source})"
    line = (f"{name}: {status}; {r.events} entries, reserved peak GPU {r.real_peak_reserved_bytes / MiB:,.1f} MiB, "
            f"model {r.model_peak_reserved_bytes / MiB:,.1f} MiB; OOM GPU {list(r.real_ooms)}, model "
            f"{list(r.model_ooms)}; retries GPU {r.real_retries}, model {r.model_retries}; capacity {capacity} MiB; "
            f"ties by {r.tie_order}")  # fmt: skip
    return line + (f"\n    first difference: {r.first_divergence}" if r.first_divergence else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="snapshot files or folders of them")
    parser.add_argument("--torch", help="the torch version that recorded them (default: the installed one)")
    parser.add_argument("--capacity", type=int, help="bytes the allocator could reserve (default: from the stream)")
    args = parser.parse_args(argv)
    files = snapshot_files(args.paths)
    if not files:
        print("snapshot_replay: no snapshots found")
        return 1
    exact = 0
    for path in files:
        try:
            r = replay_snapshot(path, capacity_bytes=args.capacity, torch_version=args.torch)
        except ConfigError as e:  # one unreadable file is a line, the others are still replayed
            print(f"{path.name}: {e}")
            continue
        exact += r.exact
        print(row(path.name, r))
    print(f"{exact} of {len(files)} snapshots replayed exactly")
    return 0 if exact == len(files) else 1


if __name__ == "__main__":
    raise SystemExit(main())
