"""The fine-tuner's table: Llama-3.1-8B's published config on one 24 GB card, LoRA and QLoRA.

For each configuration (LoRA r=16 on q_proj+v_proj in bf16 weights, with and without activation
checkpointing; QLoRA r=16 on all linears, NF4 double-quantised base, bf16 autocast, checkpointed), each
with ``adamw_torch`` and ``paged_adamw_8bit``, at 2048 tokens on an RTX 4090:

* the largest micro-batch that fits (``fit``) and the memory per component at it;
* the longest sequence that fits at batch 1 (``fit(..., maximize="seq_len")``, multiples of 64).

The config is the published ``config.json`` of meta-llama/Llama-3.1-8B (``benchmarks/configs/``): nothing
is downloaded. No GPU runs here: every number is batchfit's estimate for the named card.

Run: ``.venv/bin/python benchmarks/finetune.py [--seq-len 2048] [--device RTX4090]`` (several minutes:
each configuration traces several 8B steps).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b"
ROWS = (
    ("LoRA r=16 q,v", "r=16,alpha=32,targets=q_proj+v_proj", "bf16-true", False),
    ("LoRA r=16 q,v + ckpt", "r=16,alpha=32,targets=q_proj+v_proj", "bf16-true", True),
    ("QLoRA r=16 all-linear + ckpt", "r=16,alpha=32,targets=all-linear,quant=nf4", "bf16", True),
)
OPTIMIZERS = ("adamw_torch", "paged_adamw_8bit")


def _row(label: str, lora: str, precision: str, checkpointing: bool, optimizer: str, seq_len: int,
         device: str) -> dict[str, Any]:  # fmt: skip
    import batchfit
    from batchfit.errors import DoesNotFitError

    start = time.perf_counter()
    wl = batchfit.sources.load(str(CONFIG), seq_len=seq_len, lora=lora, optimizer=optimizer)
    row: dict[str, Any] = {"config": label, "optimizer": optimizer, "precision": precision}
    try:
        fitted = batchfit.fit(wl, device, precision=precision, checkpointing=checkpointing)
        row["micro"] = fitted.max_batch_size
        est = fitted.estimate
    except DoesNotFitError:
        row["micro"] = 0
        est = batchfit.estimate(wl, 1, device=device, precision=precision, checkpointing=checkpointing)
    row.update({k: v for k, v in est.breakdown.items()})
    row["paged"] = est.paged_optimizer_bytes
    row["reserved"] = est.peak_reserved_bytes
    row["total"] = est.device_total_bytes
    try:
        longest = batchfit.fit(wl, device, precision=precision, checkpointing=checkpointing, maximize="seq_len",
                               batch_size=1, seq_multiple=64)  # fmt: skip
        row["longest"] = longest.max_seq_len
    except DoesNotFitError:
        row["longest"] = 0
    row["seconds"] = time.perf_counter() - start
    return row


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from batchfit.cli.quiet import third_party_output
    from batchfit.units import format_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device", default="RTX4090")
    args = parser.parse_args()
    table = Table(title=f"Llama-3.1-8B (published config) on {args.device}, seq {args.seq_len}: batchfit's estimates",
                  title_justify="left")  # fmt: skip
    columns = ("configuration", "optimizer", "micro", "params", "grads", "opt states", "paged", "activations",
               "temporaries", "reserved", "nvidia-smi", "longest @ b=1", "s")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("configuration", "optimizer") else "right")
    console = Console(width=200)
    for label, lora, precision, ck in ROWS:
        for optimizer in OPTIMIZERS:
            with third_party_output(verbose=False):
                r = _row(label, lora, precision, ck, optimizer, args.seq_len, args.device)
            sizes = ("parameters", "gradients", "optimizer_states", "paged", "activations", "temporaries", "reserved",
                     "total")  # fmt: skip
            table.add_row(r["config"], r["optimizer"], str(r["micro"]), *(format_bytes(r[k]) for k in sizes),
                          f"{r['longest']:,}", f"{r['seconds']:.0f}")  # fmt: skip
            console.print(f"done: {label} / {optimizer} in {r['seconds']:.0f} s")
    console.print(table)


if __name__ == "__main__":
    main()
