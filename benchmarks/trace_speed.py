"""How fast the trace is: two training steps of Llama-2-7B (6.7B parameters) at batch 1, sequence 4096.

Both sides run the same two steps (same model built under ``FakeTensorMode``, same AdamW with foreach as a
CUDA device resolves it, same batch, bf16 autocast) in a fresh subprocess each, so that each peak RSS
(``resource.getrusage(...).ru_maxrss``) belongs to one tool only:

* ours: the trace ``batchfit.estimate`` runs for an A100-80GB in bf16 (``_trace_for_device``: the
  CUDA kernel model and emulation, host memory not counted), and the whole ``estimate()`` (trace +
  allocator replay, trace cache off) beside it; twice, in separate processes: every layer traced
  (``BATCHFIT_DEPTH_SYNTHESIS=0``), and depth synthesised (the default: the step traced with 4 of its
  32 layers, the full-depth trace written from it, ``memory/synthesis/depth.py``; the plan of the cut, a build on
  the meta device, made again for every run), whose trace must have the same peak;
* ``torch.distributed._tools.mem_tracker.MemTracker``, PyTorch's own tracker, used as its docstring
  says (``track_external`` before use, ``reset_mod_stats()`` between iterations);
* the floor: the same two steps on fake tensors with nothing watching them (what any fake-tensor
  tracer pays before it records a byte); ours' overhead is its time over the floor's.

Targets: ours, every layer traced, <= 4 s and <= 1.5 GiB RSS, and >= 15x faster than MemTracker on the same
full-depth step; depth synthesised, the goal is >= 100x faster than MemTracker (synthesised against traced:
MemTracker has no cut) with the same peak as every layer traced. The peaks of ours and MemTracker's
differ by design: ours includes the CUDA corrections (cuBLAS workspaces, CUDA's autocast fp32 list) that a
plain fake-CPU run does not have.

Run: ``.venv/bin/python benchmarks/trace_speed.py`` (a few minutes: MemTracker is the slow side).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PRESET = "hf-llama-7b"
BATCH_SIZE = 1
DEVICE = "A100-80GB"
PRECISION = "bf16"
RUNS = 3
"""Timed runs per tool (the median is reported); each tool also gets one untimed warm-up run."""
TARGET_SECONDS = 4.0
TARGET_RSS_GIB = 1.5
TARGET_SPEEDUP = 15.0
GOAL_SYNTHESISED_SPEEDUP = 100.0
GiB = 2**30


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _ours() -> dict[str, Any]:
    """Worker: our trace (as ``estimate`` runs it) and the full ``estimate``, timed (depth synthesis as
    ``BATCHFIT_DEPTH_SYNTHESIS`` says)."""
    import batchfit
    from batchfit import presets
    from batchfit.gpu.catalog import get_device
    from batchfit.memory.cache import no_cache
    from batchfit.memory.estimate import _trace_for_device, read_peak
    from batchfit.memory.synthesis import stackplan
    from batchfit.memory.synthesis.depth import STATS
    from batchfit.precision import policy_for

    workload = presets.get(PRESET)
    device = get_device(DEVICE)
    policy = policy_for(PRECISION, bf16_supported=device.bf16, device_name=device.name)

    def trace() -> Any:  # the trace exactly as estimate() runs it for this device (the cache aside)
        stackplan._PLANS.clear()  # each run plans its cut again, as a first trace of the workload does
        return _trace_for_device(workload, BATCH_SIZE, device, policy, ())

    trace()  # warm-up: imports, first-call caches
    trace_times, estimate_times = [], []
    for _ in range(RUNS):
        start = time.perf_counter()
        result = trace()
        trace_times.append(time.perf_counter() - start)
    for _ in range(RUNS):
        start = time.perf_counter()
        with no_cache():  # every estimate traces
            est = batchfit.estimate(workload, BATCH_SIZE, device=device, precision=PRECISION)
        estimate_times.append(time.perf_counter() - start)
    return {
        "trace_seconds": trace_times,
        "estimate_seconds": estimate_times,
        "peak_bytes": read_peak(result, rounded=False).peak_bytes,
        "estimate_peak_bytes": est.peak_allocated_bytes,
        "events": len(result.events),
        "max_rss_bytes": _max_rss_bytes(),
        "layers_traced": STATS.blocks_traced // max(STATS.traces_written, 1) if STATS.traces_written else None,
    }


def _fake_steps(tracked: bool) -> dict[str, Any]:
    """Worker: the same two steps on the same fake model, under PyTorch's ``MemTracker`` or bare."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from batchfit import presets
    from batchfit.memory.steps import run_steps
    from batchfit.memory.trace.compat import library_compat
    from batchfit.precision import policy_for
    from batchfit.workload import trainable_parameters

    workload = presets.get(PRESET)
    policy = policy_for(PRECISION)

    def run() -> int:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            model = workload.build_model()
            optimizer = workload.optimizer(trainable_parameters(model))
        model.train()
        for group in optimizer.param_groups:  # what a CUDA device resolves foreach=None to, as ours does
            group["foreach"] = True
        tracker = MemTracker() if tracked else None
        if tracker is not None:
            tracker.track_external(model, optimizer)

        def mark(phase: str, step: int) -> None:
            if tracker is not None and phase == "batch" and step > 0:
                tracker.reset_mod_stats()  # MemTracker's per-module stats are per iteration

        with library_compat(), fake_mode, tracker if tracker is not None else contextlib.nullcontext():
            run_steps(model, optimizer, lambda: workload.batch(BATCH_SIZE), workload.loss, steps=2,
                      autocast=policy.autocast("cpu"), mark=mark)  # fmt: skip
        if tracker is None:
            return 0
        peak = tracker.get_tracker_snapshot("peak")
        return max(snap["Total"] for snap in peak.values())

    run()  # warm-up, as for ours
    times, peak = [], 0
    for _ in range(RUNS):
        start = time.perf_counter()
        peak = run()
        times.append(time.perf_counter() - start)
    return {"seconds": times, "peak_bytes": peak, "max_rss_bytes": _max_rss_bytes()}


def _in_subprocess(worker: str, synthesis: bool = False) -> dict[str, Any]:
    env = {**os.environ, "BATCHFIT_DEPTH_SYNTHESIS": "1" if synthesis else "0"}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", worker],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    """Run both workers, print the table; 1 if a target is missed."""
    from rich.console import Console
    from rich.table import Table

    ours = _in_subprocess("ours")
    synth = _in_subprocess("ours", synthesis=True)
    theirs = _in_subprocess("memtracker")
    floor = _in_subprocess("floor")
    trace_s = statistics.median(ours["trace_seconds"])
    estimate_s = statistics.median(ours["estimate_seconds"])
    synth_s = statistics.median(synth["trace_seconds"])
    synth_estimate_s = statistics.median(synth["estimate_seconds"])
    mt_s = statistics.median(theirs["seconds"])
    floor_s = statistics.median(floor["seconds"])
    speedup = mt_s / trace_s

    table = Table(title=f"{PRESET}, batch {BATCH_SIZE}, two training steps on fake tensors ({PRECISION} autocast)")
    for col in ("tool", "median s", "runs (s)", "vs MemTracker", "x floor", "peak RSS GiB", "traced peak GiB"):
        table.add_column(col, justify="left" if col == "tool" else "right")
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    layers = f"{synth['layers_traced']} layers traced" if synth["layers_traced"] else "traced at full depth"
    for label, seconds, runs, rss, peak in (
        ("batchfit trace, every layer traced", trace_s, ours["trace_seconds"], ours["max_rss_bytes"],
         ours["peak_bytes"]),
        (f"batchfit trace, depth synthesised ({layers})", synth_s, synth["trace_seconds"], synth["max_rss_bytes"],
         synth["peak_bytes"]),
    ):  # fmt: skip
        table.add_row(label, f"{seconds:.2f}", fmt(runs), f"{mt_s / seconds:.1f}x faster", f"{seconds / floor_s:.2f}",
                      f"{rss / GiB:.2f}", f"{peak / GiB:.2f}")  # fmt: skip
    for label, seconds, runs, peak in (
        ("batchfit.estimate (trace + allocator), every layer", estimate_s, ours["estimate_seconds"],
         ours["estimate_peak_bytes"]),
        ("batchfit.estimate, depth synthesised", synth_estimate_s, synth["estimate_seconds"],
         synth["estimate_peak_bytes"]),
    ):  # fmt: skip
        table.add_row(label, f"{seconds:.2f}", fmt(runs), f"{mt_s / seconds:.1f}x faster", f"{seconds / floor_s:.2f}",
                      "(same process)", f"{peak / GiB:.2f} ({DEVICE}, rounded)")  # fmt: skip
    table.add_row("torch MemTracker", f"{mt_s:.2f}", fmt(theirs["seconds"]), "1.0x", f"{mt_s / floor_s:.2f}",
                  f"{theirs['max_rss_bytes'] / GiB:.2f}", f"{theirs['peak_bytes'] / GiB:.2f}")  # fmt: skip
    table.add_row("floor: fake-tensor steps, untracked", f"{floor_s:.2f}", fmt(floor["seconds"]),
                  f"{mt_s / floor_s:.1f}x faster", "1.00", f"{floor['max_rss_bytes'] / GiB:.2f}", "-")  # fmt: skip
    console = Console(width=150)
    console.print(table)
    checks = {
        f"trace <= {TARGET_SECONDS:.0f} s": trace_s <= TARGET_SECONDS,
        f"RSS <= {TARGET_RSS_GIB} GiB": ours["max_rss_bytes"] <= TARGET_RSS_GIB * GiB,
        f"traced >= {TARGET_SPEEDUP:.0f}x faster than MemTracker": speedup >= TARGET_SPEEDUP,
        f"synthesised >= {GOAL_SYNTHESISED_SPEEDUP:.0f}x faster than MemTracker traced": (
            mt_s / synth_s >= GOAL_SYNTHESISED_SPEEDUP
        ),
        "synthesised peak = traced peak": (synth["peak_bytes"], synth["estimate_peak_bytes"])
        == (ours["peak_bytes"], ours["estimate_peak_bytes"]),
    }
    console.print("  ".join(f"{name}: {'ok' if ok else '[red]missed[/red]'}" for name, ok in checks.items()))
    console.print(
        f"peaks differ by {abs(ours['peak_bytes'] - theirs['peak_bytes']) / GiB:.2f} GiB: ours models CUDA "
        "(cuBLAS workspaces, CUDA autocast's fp32 ops), MemTracker sees the fake-CPU kernels as they are."
    )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(_ours() if sys.argv[2] == "ours" else _fake_steps(tracked=sys.argv[2] == "memtracker")))
        sys.exit(0)
    sys.exit(main())
