"""QLoRA and 8-bit optimizer estimates against the bf16 LoRA estimate of the same model, side by side.

Llama-3.1-8B's published config (``benchmarks/configs/llama-3.1-8b``), 2048 tokens, batch 1, bf16 weights, every
decoder layer checkpointed, on an RTX 4090: LoRA r=16 on every linear layer with AdamW, the same with 4-bit
(nf4) base weights (QLoRA), and the LoRA with bitsandbytes' 8-bit AdamW. Each estimate is the first of a fresh
process with an empty trace cache (the median of ``RUNS`` processes), as a user's ``batchfit estimate`` runs
it; the figure is the estimate's own time, the process's imports and the model's config read aside.

Targets, as ratios within the run: the QLoRA estimate <= 2x the LoRA one, the 8-bit one <= 1.5x; every one
written at full depth from the cut model (no "traced at full depth" note).

Run: ``.venv/bin/python benchmarks/quantized_speed.py`` (two or three minutes on two cores).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = str(Path(__file__).resolve().parent / "configs" / "llama-3.1-8b")
CASES = {
    "LoRA r=16 all-linear, AdamW": ("r=16,targets=all-linear", None),
    "QLoRA (nf4) r=16 all-linear, AdamW": ("r=16,targets=all-linear,quant=nf4", None),
    "LoRA r=16 all-linear, 8-bit AdamW": ("r=16,targets=all-linear", "adamw_8bit"),
}
RUNS = 3
TARGET_QLORA = 2.0
TARGET_8BIT = 1.5

_CODE = """
import json, sys, time
import batchfit
from batchfit.cli.quiet import third_party_output
from batchfit.sources import load
config, lora, optimizer = sys.argv[1], sys.argv[2], sys.argv[3] or None
with third_party_output(verbose=False):
    wl = load(config, seq_len=2048, lora=lora, optimizer=optimizer)
    start = time.perf_counter()
    est = batchfit.estimate(wl, 1, device="RTX-4090", precision="bf16-true", checkpointing="blocks")
    seconds = time.perf_counter() - start
full = [n for n in est.notes if n.startswith("traced at full depth")]
print(json.dumps({"seconds": seconds, "bytes": est.device_total_bytes, "full_depth": full}))
"""


def _one(lora: str, optimizer: str | None) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**__import__("os").environ, "BATCHFIT_CACHE_DIR": cache}
        run = subprocess.run([sys.executable, "-c", _CODE, CONFIG, lora, optimizer or ""], capture_output=True,
                             text=True, env=env, timeout=900)  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    rows = {}
    for name, (lora, optimizer) in CASES.items():
        runs = [_one(lora, optimizer) for _ in range(RUNS)]
        rows[name] = (statistics.median(r["seconds"] for r in runs), runs[0])
    base = rows["LoRA r=16 all-linear, AdamW"][0]
    ok = True
    print(f"{'case':40} {'estimate':>9} {'vs LoRA':>8} {'device total':>13}  written at full depth")
    for name, (seconds, run) in rows.items():
        written = "yes" if not run["full_depth"] else f"no: {run['full_depth'][0]}"
        print(f"{name:40} {seconds:8.2f}s {seconds / base:7.2f}x {run['bytes'] / 2**30:10.2f} GiB  {written}")
        ok &= not run["full_depth"]
    qlora = rows["QLoRA (nf4) r=16 all-linear, AdamW"][0] / base
    eight = rows["LoRA r=16 all-linear, 8-bit AdamW"][0] / base
    ok &= qlora <= TARGET_QLORA and eight <= TARGET_8BIT
    print(f"targets: QLoRA <= {TARGET_QLORA}x ({qlora:.2f}x), 8-bit <= {TARGET_8BIT}x ({eight:.2f}x), all written: "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
