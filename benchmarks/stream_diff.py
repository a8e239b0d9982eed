"""Where a traced step's requests differ from a real GPU's: the two allocator streams aligned, op by op.

The allocator model can only reproduce the GPU's reserved memory when it is fed the GPU's requests.
Kernels that allocate on CUDA and not on the CPU (cuBLAS/cuDNN workspaces, attention kernels, a fused
loss), or frees in another order, show up as requests one stream has and the other has not. This script
aligns the sequence of allocations and frees (by size, rounded as the allocator rounds them) of a real
snapshot (``benchmarks/gpu_truth.py --snapshots DIR``) with the estimate's own stream of the same step
(``batchfit.memory.allocator.snapshot.build_snapshot``) and prints every stretch where they differ, each request
with where it came from: the real one's innermost frame outside torch, the traced one's op and module.

``--workspaces`` replays the traced step twice instead, as traced and with the GPU's own size for each cuDNN
workspace (``real_workspaces``), and prints both reserved peaks beside the GPU's: what is left of the error
once cuDNN's choice of engines is known.

Run: ``python benchmarks/stream_diff.py SNAPSHOT.pickle.gz [--case NAME --precision P --batch B]
[--top N] [--workspaces]`` (the case, precision and batch default to those in a gpu_truth snapshot's file
name).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from batchfit.memory.allocator.blocks import round_size  # noqa: E402
from batchfit.memory.kernels.cudnn import WORKSPACE  # noqa: E402

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


def _model_trace(case: str, precision: str, batch: int, gpu: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_truth", ROOT / "benchmarks" / "gpu_truth.py")
    assert spec is not None and spec.loader is not None
    truth = importlib.util.module_from_spec(spec)
    sys.modules["gpu_truth"] = truth
    spec.loader.exec_module(truth)
    from batchfit.activation_checkpointing import checkpoint_classes
    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import trace_for_device
    from batchfit.precision import policy_for

    c = truth.BY_NAME[case]
    wl, dev = c.make(), get_device(gpu)
    policy = policy_for(precision, bf16_supported=dev.bf16, device_name=dev.name)
    return trace_for_device(wl, batch, dev, policy, checkpoint_classes(c.blocks, wl.checkpoint_blocks))


# -- the GPU's own workspaces in the trace ------------------------------------------------------------
_CONV_BACKWARD = "aten.convolution_backward.default"
Request = tuple[bool, Any, int]
"""``(is_alloc, key, bytes)``: one allocator call of either stream (the key pairs a free with its alloc)."""


def real_calls(snapshot: dict[str, Any], device: int = 0) -> list[Request]:
    """A real stream's allocations and frees as ``replay`` takes them, keyed by address."""
    return [(e["action"] == "alloc", e["addr"], int(e["size"])) for e in snapshot["device_traces"][device]
            if e.get("action") in ("alloc", "free_completed") and e.get("size")]  # fmt: skip


def real_workspaces(snapshot: dict[str, Any], trace: Any, label: str = WORKSPACE) -> tuple[dict[int, int], int]:
    """The GPU's size of each workspace the trace took (storage id -> bytes; 0 where the GPU took none).

    A workspace is a transient: allocated and freed by the next call. Each stream is split into its other
    calls, each carrying the transients that follow it; the two sequences of other calls are aligned by
    size (``difflib``), and the transients after two aligned calls are the same kernels' workspaces. The
    trace lists a convolution's backward outputs before both workspaces, while cuDNN computes the input's
    gradient (with its workspace) before it allocates the weight's (``cudnn_convolution_backward``), so
    the trace's backward-data workspace is moved after the op's first output first.

    Returns:
        The sizes, and how many aligned calls had workspaces in a number the GPU's did not match (those
        keep the model's sizes). Transients of the GPU's where the trace has none (a workspace the model
        does not take, a kernel it does not know) are left out: the trace has no request to resize.
    """
    real = real_calls(snapshot)
    model = [(a, sid, n) for a, sid, n in _gpu_order(trace) if n > 0]
    ours = [_split(real), _split(model)]
    matcher = difflib.SequenceMatcher(None, ours[0][0], ours[1][0], autojunk=False)
    sizes, unmatched = {}, 0
    for tag, i1, _, j1, j2 in matcher.get_opcodes():
        for k in range(j2 - j1 if tag == "equal" else 0):
            gpu, traced = ours[0][1][i1 + k], ours[1][1][j1 + k]
            traced = [(sid, n) for sid, n in traced if str(trace.op.get(sid, "")).startswith(label)]
            if len(traced) == len(gpu) or not gpu:
                sizes.update((sid, gpu[i][1] if gpu else 0) for i, (sid, _) in enumerate(traced))
            elif traced:
                unmatched += 1
    return sizes, unmatched


def _gpu_order(trace: Any) -> list[Request]:
    """The trace's allocator calls with each convolution backward's input-gradient workspace right after the
    op's first output, where cuDNN takes it (``real_workspaces``)."""
    calls = list(trace.allocations())
    i = 0
    while i < len(calls) - 1:
        is_alloc, sid, _ = calls[i]
        if is_alloc and trace.op.get(sid) == f"{WORKSPACE} (backward data)" and calls[i + 1][1] == sid:
            first = i
            while first > 0 and calls[first - 1][0] and trace.op.get(calls[first - 1][1]) == _CONV_BACKWARD:
                first -= 1
            if first < i - 1:
                calls[first + 1 : first + 1] = [calls.pop(i), calls.pop(i)]
        i += 1
    return calls


def _split(calls: list[Request]) -> tuple[list[Token], list[list[tuple[Any, int]]]]:
    """The calls that are not transients, as allocator tokens, and the transients (key, bytes) after each."""
    tokens: list[Token] = []
    after: list[list[tuple[Any, int]]] = [[]]
    i = 0
    while i < len(calls):
        is_alloc, key, nbytes = calls[i]
        if is_alloc and i + 1 < len(calls) and not calls[i + 1][0] and calls[i + 1][1] == key:
            after[-1].append((key, nbytes))
            i += 2
            continue
        tokens.append(("alloc" if is_alloc else "free", round_size(nbytes)))
        after.append([])
        i += 1
    return tokens, after[1:]


def with_real_workspaces(snapshot: dict[str, Any], trace: Any) -> dict[str, Any]:
    """Peaks of the trace replayed as traced and with the GPU's own workspace sizes, beside the GPU's own."""
    from batchfit.memory.allocator.caching import replay
    from batchfit.memory.allocator.stream_replay import replay_snapshot

    sizes, unmatched = real_workspaces(snapshot, trace)
    nbytes = trace.nbytes
    traced = replay(trace.allocations())
    real_sizes = replay((a, sid, sizes.get(sid, nbytes[sid])) for a, sid, _ in trace.allocations())
    return {"real": replay_snapshot(snapshot).real_peak_reserved_bytes, "traced": traced.peak_reserved_bytes,
            "with_real_workspaces": real_sizes.peak_reserved_bytes, "workspaces": len(sizes),
            "unmatched": unmatched}  # fmt: skip


def _error(estimate: int, real: int) -> str:
    return f"{estimate / MiB:,.0f} MiB ({(estimate - real) / real:+.2%})"


def main(argv: list[str] | None = None) -> int:
    from batchfit.memory.allocator.stream_replay import load_snapshot

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", help="a real step's snapshot (gpu_truth.py --snapshots)")
    parser.add_argument("--case", help="the gpu_truth case (default: from the file name)")
    parser.add_argument("--precision")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--gpu", help="the catalog GPU to trace for (default: the snapshot's, else H100-80GB)")
    parser.add_argument("--top", type=int, default=20, help="stretches to print (default 20)")
    parser.add_argument(
        "--workspaces",
        action="store_true",
        help="replay the trace with the GPU's own cuDNN workspace sizes instead (reserved peaks)",
    )
    args = parser.parse_args(argv)
    real_snapshot = load_snapshot(args.snapshot)
    named = re.match(r"snapshot-(.+)-(fp32|bf16|fp16|bf16-true)-(\d+)(-cap\d+)?\.pickle", Path(args.snapshot).name)
    case = args.case or (named and named.group(1))
    precision = args.precision or (named and named.group(2))
    batch = args.batch or (named and int(named.group(3)))
    if not (case and precision and batch):
        print("stream_diff: give --case, --precision and --batch (the file name does not say them)")
        return 2
    gpu = args.gpu or (real_snapshot.get("recorded_with") or {}).get("gpu") or "H100-80GB"
    from batchfit.memory.allocator.snapshot import build_snapshot

    if args.workspaces:  # at full depth: the written trace frees some workspaces after other frees
        os.environ["BATCHFIT_DEPTH_SYNTHESIS"] = os.environ["BATCHFIT_CACHE"] = "0"
    trace = _model_trace(case, precision, int(batch), gpu)
    if args.workspaces:
        peaks = with_real_workspaces(real_snapshot, trace)
        real_peak = peaks["real"]
        print(
            f"{case} {precision} batch {batch} on {gpu}: reserved peak {real_peak / MiB:,.0f} MiB on the GPU; "
            f"traced {_error(peaks['traced'], real_peak)}, with the GPU's {peaks['workspaces']} workspaces "
            f"{_error(peaks['with_real_workspaces'], real_peak)} ({peaks['unmatched']} calls not matched)"
        )
        return 0
    real, model = stream(real_snapshot), stream(build_snapshot(trace))
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
