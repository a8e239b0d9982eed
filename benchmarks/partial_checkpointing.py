"""Checkpointing only what the batch needs: the plan's choice against every block and no block, side by side.

For each case the same ``batchfit.plan`` is made three times: with checkpointing left to the plan (it keeps
the fewest first blocks its micro-batch needs, the others kept or checkpointed selectively, whichever its cost
model says is faster: NOTE [ Checkpointing only what the micro-batch needs ] in ``planning/partial.py``), with
every block checkpointed, and with none. Each row shows the micro-batch and
accumulation, the blocks recomputed, the memory per GPU and the predicted time per global batch
(``batchfit.planning.cost``), and the plan's time against every block's. No GPU runs here: every number is
batchfit's estimate for the named card.

Cases: the gpt preset on a 16 GB card; Llama-3.1-8B's published config (``benchmarks/configs/``), LoRA r=16
on q,v with bf16 weights, on one RTX 4090 at 2048 and 4096 tokens; the 7B Llama preset fine-tuned in full
(bf16 autocast) under FSDP on 8 A100-40GB and on 8 A100-80GB.

Run: ``.venv/bin/python benchmarks/partial_checkpointing.py [--only NAME]`` (a few minutes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b"


def _llama_lora(seq_len: int) -> Any:
    import batchfit

    return batchfit.sources.load(str(CONFIG), seq_len=seq_len, lora="r=16,alpha=32,targets=q_proj+v_proj")


def _preset(name: str, **knobs: Any) -> Callable[[], Any]:
    def make() -> Any:
        from batchfit import presets

        return presets.get(name, **knobs)

    return make


CASES: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
    "gpt, seq 1024, V100-16GB": (_preset("gpt", seq_len=1024), dict(global_batch_size=64, device="V100-16GB",
                                                                    precision="fp16")),
    "Llama-3.1-8B LoRA, seq 2048, RTX 4090": (lambda: _llama_lora(2048), dict(global_batch_size=16, device="RTX4090",
                                                                             precision="bf16-true")),
    "Llama-3.1-8B LoRA, seq 4096, RTX 4090": (lambda: _llama_lora(4096), dict(global_batch_size=16, device="RTX4090",
                                                                             precision="bf16-true")),
    "hf-llama-7b full, seq 4096, 8 x A100-40GB FSDP": (_preset("hf-llama-7b", seq_len=4096),
                                                        dict(global_batch_size=64, device="A100-40GB", gpus=8,
                                                             precision="bf16")),
    "hf-llama-7b full, seq 4096, 8 x A100-80GB FSDP": (_preset("hf-llama-7b", seq_len=4096),
                                                        dict(global_batch_size=64, device="A100-80GB", gpus=8,
                                                             precision="bf16")),
}  # fmt: skip


def _plan(wl: Any, checkpointing: Any, kwargs: dict[str, Any]) -> Any:
    import batchfit
    from batchfit.errors import DoesNotFitError

    try:
        return batchfit.plan(wl, checkpointing=checkpointing, **kwargs)
    except DoesNotFitError as e:
        return str(e)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from batchfit.cli.quiet import third_party_output
    from batchfit.units import format_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose name contains this")
    args = parser.parse_args()
    table = Table(title="checkpointing chosen by the plan vs every block vs none (batchfit's estimates)",
                  title_justify="left")  # fmt: skip
    for col in ("case", "checkpointing", "micro x accum", "blocks recomputed", "memory/GPU", "time/global batch",
                "vs every block", "s"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("case", "checkpointing") else "right")
    console = Console(width=200)
    for name, (make, kwargs) in CASES.items():
        if args.only and args.only not in name:
            continue
        with third_party_output(verbose=False):
            wl = make()
            rows = []
            for label, ck in (("chosen by the plan", None), ("every block", "blocks"), ("none", False)):
                start = time.perf_counter()
                rows.append((label, _plan(wl, ck, kwargs), time.perf_counter() - start))
        every = rows[1][1]
        for label, p, seconds in rows:
            if isinstance(p, str):
                table.add_row(name, label, "does not fit", "", "", "", "", f"{seconds:.0f}")
                continue
            from batchfit.planning.partial import block_count

            blocks = ("0" if not p.checkpointing else
                      f"{p.checkpointed_blocks if p.checkpointed_blocks is not None else block_count(wl)} of "
                      f"{block_count(wl)}" + (", the rest selectively" if p.selective_rest else ""))  # fmt: skip
            ratio = ""
            if not isinstance(every, str) and every.predicted_step_s and p.predicted_step_s:
                ratio = f"{every.predicted_step_s / p.predicted_step_s:.2f}x"
            table.add_row(name, label, f"{p.micro_batch_size} x {p.accumulation_steps}", blocks,
                          format_bytes(p.estimate.device_total_bytes), f"{p.predicted_step_s:.2f} s", ratio,
                          f"{seconds:.0f}")  # fmt: skip
        console.print(f"done: {name}")
    console.print(table)


if __name__ == "__main__":
    main()
