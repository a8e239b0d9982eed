"""How long a plan takes, with depth synthesis on and off: one estimate, a plan with an empty trace cache,
and the same plan again.

Three cases, each in fresh subprocesses so that every figure includes what a user's command pays, and
each twice in the same run with the same process settings, ``BATCHFIT_DEPTH_SYNTHESIS=1`` (the default:
stacks cut to four periods, the full depth written, ``memory/synthesis/depth.py``) and ``=0`` (every layer traced):

* ``hf-llama-7b`` (Llama-2-7B, 32 layers, seq 4096), global batch 64 on 8 x A100-80GB;
* Llama-3.1-70B's published config (``benchmarks/configs/llama-3.1-70b``: 80 layers, seq 4096, its decoder
  layers named as the blocks to checkpoint), global batch 64 on 64 x H100-80GB;
* ``gpt`` (GPT-2 small, 12 layers, seq 1024), global batch 512 on one V100-16GB.

For each: one ``estimate`` at batch 1 (no cache; the median of ``RUNS`` processes: the first estimate of a
fresh process, so it includes the process's one-time costs, such as fake-tensor dispatch caches filled and
the first CPU kernels run), the same estimate in a warm process (after one at batch 2, the trace cache
cleared: what each later estimate of a plan costs), the ``plan`` with
an empty cache ("cold": how many steps it traced and how many layers those steps ran), once fitting one
configuration at a time (``BATCHFIT_WORKERS=1``) and once as a user's command runs it (configurations
fitted ahead in as many processes as the machine has cores, ``planning/workers.py``), and the same
plan in a new process with the cache the cold one left ("warm": its time beyond the process's start-up,
the median of three processes that import batchfit and build the workload, no plan).

Targets, as ratios within the run: the 7B estimate >= 4x and the 70B estimate >= 8x faster synthesised
than at full depth; the 70B cold plan (synthesised) in less time than two full-depth 7B estimates; the
estimates identical to the byte (``Estimate.to_dict``) and the plans the same, synthesis on and off;
and, synthesised, a cold plan <= 3 estimates and a warm plan <= 1 s beyond start-up.

Then the longest plan a user waits for: Llama-3.1-70B at 32,768 tokens on 64 x H100-80GB, loaded as
``batchfit plan benchmarks/configs/llama-3.1-70b --seq-len 32768`` loads it (tensor and sequence parallel
layouts, FSDP, checkpointing), synthesised, with an empty cache, in one process pinned to one core
(``BATCHFIT_WORKERS=1``, one torch thread): the plan call's seconds against the target of 60 s, the load
beside it. ``--long-only`` measures that line alone (two minutes).

batchfit's modules are byte-compiled first (``_byte_compiled``), as an installed package's are.

Run: ``.venv/bin/python benchmarks/plan_speed.py`` (a quarter of an hour on two cores: the full-depth 70B
plan traces several 80-layer steps).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LLAMA_70B = str(Path(__file__).resolve().parent / "configs" / "llama-3.1-70b")
CASES = (
    ("hf-llama-7b", 64, "A100-80GB", 8),
    (LLAMA_70B, 64, "H100-80GB", 64),
    ("gpt", 512, "V100-16GB", 1),
)
LONG_70B = (f"{LLAMA_70B}@32768", 64, "H100-80GB", 64)
"""The 70B plan at 32k tokens, the config as the command line loads it (``_workload``)."""
TARGET_LONG_70B_SECONDS = 60.0
RUNS = 3
"""Estimate processes per case and setting (the median is reported)."""
STARTUP_RUNS = 3
"""Start-up reference runs per case (their median is subtracted from the warm plan's process time)."""
TARGET_7B_ESTIMATE = 4.0
TARGET_70B_ESTIMATE = 8.0
TARGET_COLD_ESTIMATES = 3.0
TARGET_WARM_SECONDS = 1.0


def _workload(name: str) -> Any:
    import dataclasses

    import batchfit

    if "@" in name:  # a config at a sequence length, as ``batchfit plan CONFIG --seq-len N`` loads it
        path, seq_len = name.rsplit("@", 1)
        return batchfit.sources.load(path, seq_len=int(seq_len))
    if name != LLAMA_70B:
        return batchfit.presets.get(name)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    # A model loaded from its config names no blocks to checkpoint; the plan may checkpoint the decoder
    # layers, as it may the hf-llama-7b preset's (without, a 70B step at 4096 tokens fits on no GPU). And
    # AdamW fused, as 70B runs use it: the multi-tensor (foreach) step's temporaries are whole-model sized,
    # and the FSDP model shards parameters, gradients and states only (memory/synthesis/sharding.py).
    return dataclasses.replace(batchfit.sources.load(name, seq_len=4096), checkpoint_blocks=(LlamaDecoderLayer,),
                               optimizer=_fused_adamw)  # fmt: skip


def _fused_adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def _layers(workload: Any) -> int:
    """Blocks in the model's stacks (what a full-depth trace runs)."""
    from batchfit.memory.synthesis.stacks import find_stacks
    from batchfit.memory.trace.fake_step import fake_model

    stacks, _ = find_stacks(fake_model(workload))
    return sum(s.length for s in stacks)


def _worker(kind: str, name: str, global_batch_size: int, device: str, gpus: int) -> dict[str, Any]:
    start = time.perf_counter()
    one_core = bool(os.environ.get("PLAN_SPEED_ONE_CORE"))
    if one_core:  # this process and its torch on one core (the first it may use)
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import batchfit
    from batchfit.memory.cache import CACHE
    from batchfit.memory.synthesis.depth import STATS

    workload = _workload(name)
    loaded = time.perf_counter() - start
    if one_core:
        import torch

        torch.set_num_threads(1)
    if kind == "startup":  # the same process up to the plan call: imports and the workload, no plan
        return {"seconds": time.perf_counter() - start}
    if kind == "warm-estimate":  # a process that has estimated this model once (another batch size)
        batchfit.estimate(workload, 2, device=device)
        CACHE.clear_memory()
        STATS.blocks_traced = STATS.traces_written = CACHE.misses = 0
    begin = time.perf_counter()
    if kind in ("estimate", "warm-estimate"):
        est = batchfit.estimate(workload, 1, device=device)
    else:
        p = batchfit.plan(workload, global_batch_size, device=device, gpus=gpus)
    end = time.perf_counter()
    traces = CACHE.misses
    full = traces - STATS.traces_written  # traced at full depth (synthesis off, or a model it refused)
    out = {"seconds": end - begin, "process_seconds": end - start, "load_seconds": loaded, "traces": traces,
           "layers": STATS.blocks_traced + (full * _layers(workload) if full else 0)}  # fmt: skip
    if kind in ("estimate", "warm-estimate"):
        out["estimate"] = hashlib.sha256(json.dumps(est.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
        out["peak"] = est.device_total_bytes
    else:
        out["plan"] = f"{p.micro_batch_size} x {p.accumulation_steps} x {p.gpus}, {p.precision}" + "".join(
            f", {r}" for r in p.remedies if "autocast" not in r
        )
    return out


def _run(kind: str, case: tuple, synthesis: bool, cache: str | None, workers: int | None = None,
         one_core: bool = False) -> dict[str, Any]:  # fmt: skip
    name, global_batch_size, device, gpus = case
    env = dict(os.environ)
    if one_core:
        env["PLAN_SPEED_ONE_CORE"] = "1"
        env["OMP_NUM_THREADS"] = "1"
    env["BATCHFIT_DEPTH_SYNTHESIS"] = "1" if synthesis else "0"
    if workers is not None:
        env["BATCHFIT_WORKERS"] = str(workers)
    if cache is None:
        env["BATCHFIT_CACHE"] = "0"
    else:
        env["BATCHFIT_CACHE_DIR"] = cache
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", kind, name, str(global_batch_size), device,
         str(gpus)],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - start
    return result


def _measure(case: tuple) -> dict[bool, dict[str, Any]]:
    """Every figure of ``case``, synthesis on and off taking turns (so that both see the machine alike)."""
    out: dict[bool, dict[str, Any]] = {True: {"estimates": []}, False: {"estimates": []}}
    for _ in range(RUNS):
        for synthesis in (True, False):
            out[synthesis]["estimates"].append(_run("estimate", case, synthesis, None))
            out[synthesis].setdefault("warm_estimates", []).append(_run("warm-estimate", case, synthesis, None))
    for kind, workers in (("serial", 1), ("cold", None)):
        for synthesis in (True, False):
            with tempfile.TemporaryDirectory() as cache:
                out[synthesis][kind] = _run("plan", case, synthesis, cache, workers=workers)
                if kind == "cold":
                    out[synthesis]["warm"] = _run("plan", case, synthesis, cache)
    for synthesis in (True, False):
        r = out[synthesis]
        runs = [_run("startup", case, synthesis, None)["wall_seconds"] for _ in range(STARTUP_RUNS)]
        r["beyond"] = r["warm"]["wall_seconds"] - statistics.median(runs)
        r["estimate"] = statistics.median(e["seconds"] for e in r["estimates"])
        r["warm_estimate"] = statistics.median(e["seconds"] for e in r["warm_estimates"])
        r["estimate_layers"] = r["estimates"][0]["layers"]
        r["digests"] = {e["estimate"] for e in r["estimates"] + r["warm_estimates"]}
    return out


def _byte_compiled() -> None:
    """batchfit's modules byte-compiled, as an installed wheel's are: with ``PYTHONDONTWRITEBYTECODE`` set
    (as on some machines) an editable install compiles every module it imports from source in every
    process, and the modules a trace imports lazily would be compiled inside the timed estimate."""
    import compileall

    import batchfit

    compileall.compile_dir(str(Path(batchfit.__file__).parent), quiet=1)


def _long_70b() -> tuple[str, bool]:
    """The 70B 32k-token plan, cold, synthesised, on one core: its line and whether it met the target."""
    with tempfile.TemporaryDirectory() as cache:
        r = _run("plan", LONG_70B, True, cache, workers=1, one_core=True)
    met = r["seconds"] <= TARGET_LONG_70B_SECONDS
    line = (f"Llama-3.1-70B at 32,768 tokens, G=64 on 64 x H100-80GB, cold, one core: plan {r['seconds']:.1f} s "
            f"(target <= {TARGET_LONG_70B_SECONDS:.0f} s: {'ok' if met else 'missed'}) after {r['load_seconds']:.1f} s "
            f"of imports and load; {r['traces']} steps traced, {r['layers']} layers; plan {r['plan']}")  # fmt: skip
    return line, met


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from batchfit.planning.workers import resolve_workers

    _byte_compiled()
    if sys.argv[1:] == ["--long-only"]:
        line, met = _long_70b()
        print(line)
        return 0 if met else 1
    workers = resolve_workers(None)
    table = Table(title="plan speed: fresh processes, depth synthesis on and off in the same run (traces counted "
                        "by the trace cache, layers by the traces)", title_justify="left")  # fmt: skip
    for col in ("case", "depth", f"estimate s (median of {RUNS})", "layers traced", "estimate s, warm process",
                "cold plan s, 1 process",
                f"cold plan s, {workers} processes", "/ estimate", "traces", "layers traced", "warm plan s",
                "warm beyond start-up s", "plan"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("case", "depth", "plan") else "right")
    results: dict[tuple[str, bool], dict[str, Any]] = {}
    for case in CASES:
        name, g, device, gpus = case
        label = f"{Path(name).name}, G={g} on {gpus} x {device}"
        measured = _measure(case)
        for synthesis in (True, False):
            r = results[(name, synthesis)] = measured[synthesis]
            table.add_row(label if synthesis else "", "synthesised" if synthesis else "traced",
                          f"{r['estimate']:.2f}", str(r["estimate_layers"]), f"{r['warm_estimate']:.2f}",
                          f"{r['serial']['seconds']:.1f}",
                          f"{r['cold']['seconds']:.1f}", f"{r['cold']['seconds'] / r['estimate']:.1f}x",
                          f"{r['serial']['traces']} / {r['cold']['traces']}",
                          f"{r['serial']['layers']} / {r['cold']['layers']}", f"{r['warm']['seconds']:.2f}",
                          f"{r['beyond']:.2f}", r["cold"]["plan"])  # fmt: skip
    console = Console(width=220)
    console.print(table)

    def ratio(name: str, figure: str = "estimate") -> float:
        return results[(name, False)][figure] / results[(name, True)][figure]

    seven, seventy = "hf-llama-7b", LLAMA_70B
    plan_70b, two_7b = results[(seventy, True)]["cold"]["seconds"], 2 * results[(seven, False)]["estimate"]
    console.print(f"7B estimate: {ratio(seven):.1f}x faster synthesised; 70B estimate: {ratio(seventy):.1f}x; 70B "
                  f"cold plan synthesised {plan_70b:.1f} s vs two full-depth 7B estimates {two_7b:.1f} s")  # fmt: skip
    warm_7b, warm_70b = ratio(seven, "warm_estimate"), ratio(seventy, "warm_estimate")
    console.print(f"in a warm process (the model estimated once before, at another batch size, as a plan's later "
                  f"estimates are): 7B {warm_7b:.1f}x, 70B {warm_70b:.1f}x; the targets are those of the first "
                  "estimate in a fresh process")  # fmt: skip
    checks = {
        f"7B estimate >= {TARGET_7B_ESTIMATE:.0f}x": ratio(seven) >= TARGET_7B_ESTIMATE,
        f"70B estimate >= {TARGET_70B_ESTIMATE:.0f}x": ratio(seventy) >= TARGET_70B_ESTIMATE,
        "70B cold plan < two full-depth 7B estimates": plan_70b < two_7b,
    }
    for case in CASES:
        name = Path(case[0]).name
        on, off = results[(case[0], True)], results[(case[0], False)]
        checks[f"{name}: estimates identical on and off"] = len(on["digests"] | off["digests"]) == 1
        checks[f"{name}: plans the same on and off"] = on["cold"]["plan"] == off["cold"]["plan"]
        checks[f"{name}: cold <= {TARGET_COLD_ESTIMATES:.0f} estimates"] = (
            on["cold"]["seconds"] <= TARGET_COLD_ESTIMATES * on["estimate"]
        )
        checks[f"{name}: warm <= {TARGET_WARM_SECONDS:.0f} s beyond start-up"] = on["beyond"] <= TARGET_WARM_SECONDS
    line, checks[f"70B 32k plan <= {TARGET_LONG_70B_SECONDS:.0f} s on one core"] = _long_70b()
    console.print(line)
    console.print("  ".join(f"{k}: {'ok' if v else '[red]missed[/red]'}" for k, v in checks.items()))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))))
        sys.exit(0)
    sys.exit(main())
