"""Where a traced step's requests differ from a real GPU's: the two allocator streams aligned, op by op.

The allocator model can only reproduce the GPU's reserved memory when it is fed the GPU's requests.
Kernels that allocate on CUDA and not on the CPU (cuBLAS/cuDNN workspaces, attention kernels, a fused
loss), or frees in another order, show up as requests one stream has and the other has not. This script
aligns the sequence of allocations and frees (by size, rounded as the allocator rounds them) of a real
snapshot (``benchmarks/gpu_truth.py --snapshots DIR``) with the estimate's own stream of the same step
(``batchfit.memory.snapshot.build_snapshot``) and prints every stretch where they differ, each request
with where it came from: the real one's innermost frame outside torch, the traced one's op and module.

Run: ``python benchmarks/stream_diff.py SNAPSHOT.pickle.gz [--case NAME --precision P --batch B]
[--top N]`` (the case, precision and batch default to those in a gpu_truth snapshot's file name).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from batchfit.memory.blocks import round_size  # noqa: E402

MiB = 2**20
Token = tuple[str, int]
"""``("alloc" | "free", rounded bytes)``: what the allocator sees of a request."""


def stream(snapshot: dict[str, Any], device: int = 0) -> list[tuple[Token, str]]:
    """The allocations and frees of a snapshot's trace, each with where it came from."""
    out = []
    for e in snapshot["device_traces"][device]:
        action = e.get("action")
        if action in ("alloc", "free_completed") and e.get("size"):
            kind = "alloc" if action == "alloc" else "free"
            out.append(((kind, round_size(int(e["size"]))), _where(e.get("frames") or [])))
    return out


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch (a real step's), or the op and module (a traced step's frames)."""
    for f in frames:
        name = str(f.get("filename", ""))
        if "/torch/" not in name and not name.startswith("batchfit"):
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '')}".strip()
    return str(frames[0].get("name", "?")) if frames else "?"


_KINDS = {"delete": "GPU only", "insert": "trace only", "replace": "both differ"}
"""``difflib``'s opcodes from the real stream to the traced one, in words."""


def differences(real: list[tuple[Token, str]], model: list[tuple[Token, str]]) -> list[dict[str, Any]]:
    """The stretches where the two streams differ (``difflib``'s non-equal opcodes), in order."""
    matcher = difflib.SequenceMatcher(None, [t for t, _ in real], [t for t, _ in model], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            out.append({"kind": _KINDS[tag], "real_at": i1, "model_at": j1, "real": real[i1:i2],
                        "model": model[j1:j2]})  # fmt: skip
    return out


def summary(diffs: list[dict[str, Any]]) -> tuple[Counter[Token], Counter[Token]]:
    """Requests only the GPU made and requests only the trace made, counted by (kind, size)."""
    only_real: Counter[Token] = Counter()
    only_model: Counter[Token] = Counter()
    for d in diffs:
        only_real.update(t for t, _ in d["real"])
        only_model.update(t for t, _ in d["model"])
    common = only_real & only_model  # moved, not missing
    return only_real - common, only_model - common


def _describe(tokens: list[tuple[Token, str]], limit: int = 4) -> str:
    shown = [f"{kind} {size / MiB:,.2f} MiB ({where})" for (kind, size), where in tokens[:limit]]
    more = f" and {len(tokens) - limit} more" if len(tokens) > limit else ""
    return "; ".join(shown) + more if shown else "nothing"


def _model_snapshot(case: str, precision: str, batch: int, gpu: str) -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_truth", ROOT / "benchmarks" / "gpu_truth.py")
    assert spec is not None and spec.loader is not None
    truth = importlib.util.module_from_spec(spec)
    sys.modules["gpu_truth"] = truth
    spec.loader.exec_module(truth)
    from batchfit.checkpointing import checkpoint_classes
    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import trace_for_device
    from batchfit.memory.snapshot import build_snapshot
    from batchfit.precision import policy_for

    c = truth.BY_NAME[case]
    wl, dev = c.make(), get_device(gpu)
    policy = policy_for(precision, bf16_supported=dev.bf16, device_name=dev.name)
    trace = trace_for_device(wl, batch, dev, policy, checkpoint_classes(c.blocks, wl.checkpoint_blocks))
    return build_snapshot(trace)


def main(argv: list[str] | None = None) -> int:
    from batchfit.memory.stream_replay import load_snapshot

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", help="a real step's snapshot (gpu_truth.py --snapshots)")
    parser.add_argument("--case", help="the gpu_truth case (default: from the file name)")
    parser.add_argument("--precision")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--gpu", help="the catalog GPU to trace for (default: the snapshot's, else H100-80GB)")
    parser.add_argument("--top", type=int, default=20, help="stretches to print (default 20)")
    args = parser.parse_args(argv)
    real_snapshot = load_snapshot(args.snapshot)
    named = re.match(r"snapshot-(.+)-(fp32|bf16|fp16|bf16-true)-(\d+)\.pickle", Path(args.snapshot).name)
    case = args.case or (named and named.group(1))
    precision = args.precision or (named and named.group(2))
    batch = args.batch or (named and int(named.group(3)))
    if not (case and precision and batch):
        print("stream_diff: give --case, --precision and --batch (the file name does not say them)")
        return 2
    gpu = args.gpu or (real_snapshot.get("recorded_with") or {}).get("gpu") or "H100-80GB"
    real, model = stream(real_snapshot), stream(_model_snapshot(case, precision, int(batch), gpu))
    diffs = differences(real, model)
    only_real, only_model = summary(diffs)
    print(f"{case} {precision} batch {batch} on {gpu}: {len(real)} real requests and frees, {len(model)} traced; "
          f"{len(diffs)} stretches differ")  # fmt: skip
    for d in diffs[: args.top]:
        print(f"  real #{d['real_at']} / traced #{d['model_at']} ({d['kind']}): GPU {_describe(d['real'])}; "
              f"trace {_describe(d['model'])}")  # fmt: skip
    for title, counts in (("only on the GPU", only_real), ("only in the trace", only_model)):
        top = ", ".join(f"{n} x {kind} {size / MiB:,.2f} MiB" for (kind, size), n in counts.most_common(8))
        print(f"{title}: {top or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
