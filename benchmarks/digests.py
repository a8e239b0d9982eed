"""Digests of estimates across the presets, the zoo and the hub configs: proof that a change kept behaviour.

Each row traces one configuration of one workload and prints two digests: of the ``Estimate`` (every
field, as ``to_dict``) and of its trace (every event in order, storages numbered by birth, with each
one's bytes, role, module, op and rows; the phases, FLOPs, gradient hand-overs and notes). A refactor
that changes no behaviour leaves every digest as it was (but a trace whose order is random, as the zoo's
``index-add-moe``, whose estimate is not):

    .venv/bin/python benchmarks/digests.py > before.txt
    ... change ...
    .venv/bin/python benchmarks/digests.py > after.txt && diff before.txt after.txt

Then fits and plans, each digested whole (``to_dict``, or the error it ends with): the ladder of
remedies, accumulation, several GPUs, tensor parallelism and a plan where nothing fits.

Rows: every preset (small knobs where a preset takes them), every zoo entry (``tests/zoo.py``), and the
hub configs in ``benchmarks/configs`` (full size: the synthesised depth, LoRA and bf16-true with
checkpointing), on the CPU (exact) and an H100 (the CUDA kernel model and the allocator), plus
settings that take other paths: autocast, accumulation, tensor/sequence parallelism and FSDP2, and
expandable segments. Run with a fresh trace cache (``BATCHFIT_CACHE_DIR`` is set to a temporary
directory), so every row is traced by the code under test.

Run: ``.venv/bin/python benchmarks/digests.py [substring ...]`` (a few minutes on one core).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def _rows() -> Iterator[tuple[str, Callable[[], Any], int, dict[str, Any]]]:
    """``(name, make workload, batch size, estimate keyword arguments)`` for every row."""
    from functools import partial

    from batchfit import ParallelLayout, presets

    small_gpt = partial(presets.get, "gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
    for name in presets.names():
        make = small_gpt if name == "gpt" else partial(presets.get, name)
        size = 2 if name.startswith("hf-") or name == "gpt" else 8
        if name in ("hf-llama-7b", "hf-llama3-8b", "hf-bert-large"):
            big = {"device": "H100", "precision": "bf16-true", "checkpointing": "blocks"}
            yield f"preset {name} H100 bf16-true ckpt", make, size, big
            continue
        yield f"preset {name} cpu", make, size, {"device": "cpu"}
        yield f"preset {name} H100", make, size, {"device": "H100"}
    yield "gpt H100 bf16 autocast", small_gpt, 4, {"device": "H100", "precision": "bf16"}
    yield "gpt H100 accumulation 3", small_gpt, 4, {"device": "H100", "accumulation_steps": 3}
    yield "gpt H100 expandable", small_gpt, 4, {"device": "H100", "expandable_segments": True}
    yield "gpt H100 ckpt", small_gpt, 4, {"device": "H100", "checkpointing": "blocks"}
    tp = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
    tp_sp = ParallelLayout(tensor_parallel=2, sequence_parallel=True)
    yield "gpt H100 tp2 sp", lambda: tp, 4, {"device": "H100", "parallel": tp_sp}
    yield "gpt H100 fsdp4", lambda: tp, 4, {"device": "H100", "parallel": ParallelLayout(fsdp=4)}

    from zoo import ZOO

    for entry in ZOO:
        yield f"zoo {entry.name} cpu", entry.make, entry.batch_size, {"device": "cpu"}
        yield f"zoo {entry.name} H100", entry.make, entry.batch_size, {"device": "H100"}

    from batchfit.sources.hub import load_config, workload_from_config
    from batchfit.sources.lora import LoraSpec

    def hub(path: Path, **kw: Any) -> Any:
        return workload_from_config(load_config(str(path)), **kw)

    lora = LoraSpec(r=16, targets=("q_proj", "v_proj"))
    for config in sorted((HERE / "configs").iterdir()):
        yield f"hub {config.name} H100 lora bf16-true ckpt", partial(hub, config, seq_len=2048, lora=lora), 2, {
            "device": "H100", "precision": "bf16-true", "checkpointing": "blocks"}  # fmt: skip
    yield "hub llama-3.1-8b H100 full bf16-true", partial(hub, HERE / "configs" / "llama-3.1-8b", seq_len=1024), 1, {
        "device": "H100", "precision": "bf16-true"}  # fmt: skip


def _answers() -> Iterator[tuple[str, Callable[[], Any]]]:
    """``(name, call)`` of fits and plans (their whole result, or the error they end with)."""
    from batchfit import fit, plan, presets

    def gpt(**kw: Any) -> Any:
        return presets.get("gpt", n_layer=4, n_embd=256, n_head=4, vocab_size=8192, seq_len=256, **kw)

    yield "fit gpt 1GiB", lambda: fit(gpt(), "1GiB")
    yield "fit gpt 1GiB bf16 ckpt", lambda: fit(gpt(), "1GiB", precision="bf16", checkpointing="blocks")
    yield "fit gpt 1GiB accumulation 2", lambda: fit(gpt(), "1GiB", accumulation_steps=2)
    yield "plan mlp 300 on 3 x 1GiB", lambda: plan("mlp", 300, device="1GiB", gpus=3)
    yield "plan gpt 256 on 900MiB", lambda: plan(gpt(), 256, device="900MiB")
    yield "plan gpt 256 on 2 x 700MiB", lambda: plan(gpt(), 256, device="700MiB", gpus=2)
    yield "plan gpt 64 on 4 x 600MiB tp 2", lambda: plan(gpt(), 64, device="600MiB", gpus=4, tensor_parallel=2)
    yield "plan gpt 8 on 500MiB", lambda: plan(gpt(), 8, device="500MiB")


def _answer_digest(call: Callable[[], Any]) -> str:
    try:
        value = call().to_dict()
    except Exception as e:  # noqa: BLE001 - an answer that is an error is compared as its message
        value = f"{type(e).__name__}: {e}"
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _trace_digest(trace: Any) -> str:
    """Of everything the estimate reads of a trace, as the suite compares traces (``tests/trace_compare.py``):
    storages numbered by birth, runs of frees as sets (the order Python drops a graph's tensors in is not
    the step's behaviour; the allocator's state after the run is the same)."""
    from trace_compare import everything

    return hashlib.sha256(repr(everything(trace)).encode()).hexdigest()[:16]


def digest(make: Callable[[], Any], batch_size: int, kwargs: dict[str, Any]) -> tuple[str, str]:
    """The estimate's and its trace's digests (the trace is the one ``estimate`` finished)."""
    import importlib

    import batchfit

    module = importlib.import_module(batchfit.estimate.__module__)  # where the public estimate finishes its trace

    traces: list[Any] = []
    finish = module.finish_estimate

    def recording(trace: Any, *args: Any, **kw: Any) -> Any:
        traces.append(trace)
        return finish(trace, *args, **kw)

    module.finish_estimate = recording
    try:
        est = module.estimate(make(), batch_size, **kwargs)
    finally:
        module.finish_estimate = finish
    fields = json.dumps(est.to_dict(), sort_keys=True, default=str).replace(str(HERE.parent), "<repository>")
    return hashlib.sha256(fields.encode()).hexdigest()[:16], _trace_digest(traces[-1])


def main(filters: list[str]) -> int:
    import torch

    torch.set_num_threads(1)
    failed = 0
    for name, make, batch_size, kwargs in _rows():
        if filters and not any(f in name for f in filters):
            continue
        start = time.perf_counter()
        try:
            est, trace = digest(make, batch_size, kwargs)
        except Exception as e:  # noqa: BLE001 - a failing row is printed, and the run exits 1
            failed += 1
            est, trace = "FAILED", f"{type(e).__name__}: {str(e)[:80]}"
        print(f"{name:<48} estimate {est}  trace {trace}", flush=True)
        print(f"  {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    for name, call in _answers():
        if filters and not any(f in name for f in filters):
            continue
        print(f"{name:<48} answer {_answer_digest(call)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Some traces free storages in set order (a ModernBERT step's events change with the hash seed,
        # its estimate does not): one seed makes every run's digests comparable.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    os.environ["BATCHFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="batchfit-digests-")
    sys.exit(main(sys.argv[1:]))
