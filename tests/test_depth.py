"""Depth synthesis (``memory/synthesis/depth.py``): the trace written from a step with its stacks cut to four
periods is the traced full-depth step, event for event (bytes, roles, modules, ops, rows, phases, FLOPs,
gradient hand-overs and notes), across the zoo and with checkpointing, autocast, accumulation, LoRA
and FSDP; a model that does not repeat as assumed is traced at full depth and its estimate says why."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from trace_compare import canonical, everything
from zoo import BY_NAME, deeper

import batchfit
from batchfit import presets
from batchfit.gpu.catalog import get_device
from batchfit.memory.estimate import _trace_for_device, finish_estimate, with_accumulation
from batchfit.memory.measure import measure_cpu_peak
from batchfit.memory.synthesis.accumulation import accumulating_trace
from batchfit.memory.synthesis.depth import STATS
from batchfit.memory.synthesis.sharding import shard_trace
from batchfit.memory.synthesis.stacks import find_stacks
from batchfit.memory.trace.fake_step import fake_model
from batchfit.models import hf
from batchfit.precision import policy_for
from batchfit.sources import as_workload

A100 = get_device("A100-80GB")
V100 = get_device("V100-16GB")
CPU = get_device("cpu")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU traces measure kernels: the same thread count for every trace
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _trace(wl: Any, synthesis: bool, device: Any = A100, precision: str = "fp32", classes: tuple = (),
           batch_size: int = 2) -> Any:  # fmt: skip
    policy = policy_for(precision, bf16_supported=device.bf16 or device.exact, device_name=device.name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", "1" if synthesis else "0")
        return _trace_for_device(wl, batch_size, device, policy, classes)


def _both(wl: Any, **kw: Any) -> tuple[Any, Any, int]:
    """The traced full-depth trace, the written one, and how many blocks the written one stands for."""
    before = STATS.blocks_written
    written = _trace(wl, True, **kw)  # first: it warms torch's dispatch caches for the other
    return _trace(wl, False, **kw), written, STATS.blocks_written - before


def _blocks(wl: Any) -> tuple[type, ...]:
    """The class of every stack's blocks (what checkpointing wraps here)."""
    model = fake_model(wl)
    stacks, _ = find_stacks(model)
    return tuple({type(model.get_submodule(s.path)[s.start]) for s in stacks})


# -- the zoo -------------------------------------------------------------------------------------------
DEPTH = {
    # every zoo model with a stack, at six layers (ten or twelve where layers alternate in pairs and
    # five periods are needed)
    **dict.fromkeys(["gpt2", "llama-gqa", "mistral-swa", "qwen2", "phi3", "falcon", "gpt-neox", "opt", "bloom-alibi",
                     "gpt-bigcode-mqa", "starcoder2", "mamba-ssm", "mixtral-moe", "qwen2-moe", "olmoe",
                     "granite-moe", "bert", "roberta-mlm", "distilbert", "electra-tokens", "deberta-v2", "t5",
                     "bart", "vit", "dinov2", "whisper", "wav2vec2-ctc", "clip", "torch-encoder",
                     "torch-encoder-prenorm", "torch-decoder", "lora-llama", "lora-all-linear-llama", "ia3-llama",
                     "lora-bert-modules-to-save", "adalora-llama", "prompt-tuning-llama"], 6),  # fmt: skip
    "gemma2": 10,
    "modernbert": 12,
}
SLOW = {"t5", "whisper", "mamba-ssm", "clip", "bart", "gemma2", "deberta-v2", "lora-all-linear-llama", "qwen2-moe"}


def _zoo(name: str) -> Any:
    return as_workload(deeper(BY_NAME[name].make, DEPTH[name])())


@pytest.mark.skipif(not hf.available(), reason="the zoo's transformers models need transformers")
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in DEPTH])
def test_the_written_trace_is_the_traced_one_across_the_zoo(name: str) -> None:
    real, written, blocks = _both(_zoo(name))
    assert blocks > 0, written.notes  # written, not traced again at full depth
    assert everything(written) == everything(real)


# -- the same step, other ways -------------------------------------------------------------------------
GPT = presets.get("gpt", n_layer=7, n_embd=64, n_head=4, vocab_size=256, seq_len=32)


def _llama() -> Any:
    return _zoo("llama-gqa")


VARIANTS = {
    "gpt, checkpointed": dict(wl=lambda: GPT, checkpointing=True),
    "gpt, bf16 autocast": dict(wl=lambda: GPT, precision="bf16"),
    "gpt, bf16 weights and states": dict(wl=lambda: GPT, precision="bf16-true"),
    "gpt, fp16 autocast on a V100": dict(wl=lambda: GPT, precision="fp16", device=V100),
    "gpt, gradients kept by zero_grad": dict(wl=lambda: dataclasses.replace(GPT, set_grads_to_none=False)),
    "llama, checkpointed in bf16": dict(wl=_llama, precision="bf16", checkpointing=True),
    "llama on the CPU": dict(wl=_llama, device=CPU),
    "bart, checkpointed in bf16": dict(wl=lambda: _zoo("bart"), precision="bf16", checkpointing=True),
    "gpt, paged 32-bit AdamW": dict(wl=lambda: _paged_gpt()),
    "llama, QLoRA (nf4, all-linear) in bf16 weights": dict(wl=lambda: _qlora_llama(), precision="bf16-true"),
    "gpt, 8-bit AdamW (states sharing the quantisation maps)": dict(wl=lambda: _optimized_gpt("adamw_8bit")),
    "gpt, gradients clipped (norms stacked)": dict(wl=lambda: _clipping_gpt(foreach=False)),
    "gpt, gradients clipped with foreach, on the CPU": dict(wl=lambda: _clipping_gpt(foreach=True), device=CPU),
}


def _clipping_gpt(foreach: bool) -> Any:
    """``clip_grad_norm_`` before each step, as the Hugging Face Trainer does: one norm per parameter, stacked
    into one tensor whose size grows with the depth (NOTE [ Labelling a trace by block ])."""

    def clipping_adamw(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        step = optimizer.step

        def clipped(closure: Any = None) -> Any:
            grads = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, 1.0, foreach=foreach)
            return step(closure)

        optimizer.step = clipped  # type: ignore[method-assign]
        return optimizer

    return dataclasses.replace(GPT, optimizer=clipping_adamw)


def _qlora_llama() -> Any:
    """4-bit base weights: each matmul dequantises into scratch buffers alive together inside the op
    (``memory/kernels/quantized.py``), freed one by one as it returns."""
    pytest.importorskip("bitsandbytes")
    import tempfile

    from hf_tiny import llama_config_dir

    from batchfit.sources import load

    config = llama_config_dir(Path(tempfile.mkdtemp()), num_hidden_layers=6)
    return load(str(config), seq_len=16, lora="r=4,targets=all-linear,quant=nf4")


def _optimized_gpt(name: str) -> Any:
    """bitsandbytes' 8-bit states of every weight of 4096 values or more point at the optimizer's two quantisation
    maps: one storage held by every block's states."""
    pytest.importorskip("bitsandbytes")
    from batchfit.sources import optimizer_factory

    return dataclasses.replace(GPT, optimizer=optimizer_factory(name))


def _paged_gpt() -> Any:
    """Feed-forward weights of 160 x 640 = 102,400 values: bitsandbytes pages their states on a GPU."""
    pytest.importorskip("bitsandbytes")
    from batchfit.sources import optimizer_factory

    wl = presets.get("gpt", n_layer=6, n_embd=160, n_head=4, vocab_size=256, seq_len=16)
    return dataclasses.replace(wl, optimizer=optimizer_factory("paged_adamw_32bit"))


@pytest.mark.skipif(not hf.available(), reason="the zoo's transformers models need transformers")
@pytest.mark.parametrize("case", list(VARIANTS), ids=list(VARIANTS))
def test_the_written_trace_is_the_traced_one_with_checkpointing_autocast_and_on_the_cpu(case: str) -> None:
    spec = dict(VARIANTS[case])
    wl = spec.pop("wl")()
    classes = _blocks(wl) if spec.pop("checkpointing", False) else ()
    real, written, blocks = _both(wl, classes=classes, **spec)
    assert blocks > 0, written.notes
    assert everything(written) == everything(real)
    if case == "gpt, paged 32-bit AdamW":
        assert len(written.paged) >= 2 * 2 * 6  # two states of two feed-forward weights in each of six blocks


def test_a_cpu_estimate_written_at_full_depth_is_the_allocators_peak() -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", "1")
        before = STATS.blocks_written
        est = batchfit.estimate(GPT, 2, device="cpu")
        assert STATS.blocks_written - before == 7
    assert est.peak_allocated_bytes == measure_cpu_peak(GPT, 2)


def test_an_accumulating_step_is_written_from_the_written_plain_step() -> None:
    """On a GPU the accumulating step is written from the plain one (``memory/synthesis/accumulation.py``), here a
    written one; on the CPU it is traced, cut, and written at full depth like any step."""
    policy = policy_for("fp32", bf16_supported=True, device_name=A100.name)
    _, plain, _ = _both(GPT)
    real = _trace_for_device(with_accumulation(GPT, 2), 2, A100, policy, ())
    written = accumulating_trace(plain)
    assert written is not None
    assert canonical(written) == canonical(real)
    real, written, blocks = _both(with_accumulation(GPT, 2), device=CPU)
    assert blocks == 7
    assert everything(written) == everything(real)


def test_fsdp_shards_of_the_written_trace_are_those_of_the_traced_one() -> None:
    real, written, _ = _both(GPT)
    assert canonical(shard_trace(written, 8)) == canonical(shard_trace(real, 8))
    policy = policy_for("fp32", bf16_supported=True, device_name=A100.name)
    ours = finish_estimate(shard_trace(written, 8), GPT, 2, A100, policy, ())
    traced = finish_estimate(shard_trace(real, 8), GPT, 2, A100, policy, ())
    assert ours == traced


def test_estimates_are_the_same_to_the_byte_with_synthesis_on_and_off() -> None:
    def estimate(on: bool) -> dict:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", "1" if on else "0")
            return batchfit.estimate(GPT, 3, device="A100-80GB", precision="bf16").to_dict()

    assert estimate(True) == estimate(False)


# -- alternating layers ----------------------------------------------------------------------------------
class _Dense(nn.Module):
    def __init__(self, width: int, wide: bool) -> None:
        super().__init__()
        hidden = 4 * width if wide else width
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Indexed(_Dense):
    """A block whose forward depends on its index (set as ``index``), not by a period: block 2 doubles."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x * 2.0 if self.index == 2 else x


class _Stack(nn.Module):
    """An embedding, a stack of blocks of width 16 and a head."""

    def __init__(self, blocks: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Alternating(_Stack):
    """Blocks of one class whose width alternates with period ``period`` (every ``period``-th is wide)."""

    def __init__(self, layers: int, period: int) -> None:
        super().__init__(_Dense(16, i % period == 0) for i in range(layers))


def _ids(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 64, (b, 8)), torch.randint(0, 64, (b, 8))


def _lm(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


def _workload(model: Any) -> batchfit.Workload:
    return batchfit.Workload(model=model, batch=_ids, loss=_lm)


@pytest.mark.parametrize(("layers", "period"), [(10, 2), (17, 3)])
def test_alternating_layers_repeat_with_their_period(layers: int, period: int) -> None:
    wl = _workload(lambda: _Alternating(layers, period))
    stacks, _ = find_stacks(fake_model(wl))
    assert [(s.period, s.kept) for s in stacks] == [(period, 4 * period)]
    real, written, blocks = _both(wl)
    assert blocks == stacks[0].length
    assert everything(written) == everything(real)


# -- work of the loop between the blocks ------------------------------------------------------------------
class _Looped(nn.Module):
    """Six blocks, and work of the loop between them: ``kind`` picks which."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(_Dense(16, False) for _ in range(6))
        self.probe = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64)
        self.layerdrop = 0.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            if self.kind == "layer drop":
                # a draw before each block, whatever the probability, as transformers 5.17's BART, OPT,
                # Whisper and wav2vec2 draw in training (dropping the draw before it)
                p = torch.rand([])
                if self.training and p < self.layerdrop:
                    continue
            if self.kind == "a product":  # a product made and dropped before each block: FLOPs of the loop
                self.probe(x.detach()).sum()
            x = block(x)
        return self.head(x)


def test_a_draw_of_the_loop_before_each_block_is_written_with_each_block() -> None:
    real, written, blocks = _both(_workload(lambda: _Looped("layer drop")))
    assert blocks == 6, written.notes
    assert everything(written) == everything(real)


def test_floating_point_work_of_the_loop_between_blocks_is_traced_at_full_depth() -> None:
    real, written, blocks = _both(_workload(lambda: _Looped("a product")))
    assert blocks == 0
    assert [n for n in written.notes if "allocates outside its turn" in n], written.notes
    assert everything(written)[:5] == everything(real)[:5]


# -- what is traced at full depth ---------------------------------------------------------------------
class _Stack(nn.Module):
    """Six like blocks, with a twist: ``kind`` picks how the model is not a plain stack."""

    def __init__(self, kind: str = "") -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(64, 16)
        block = _Indexed if kind == "by-index" else _Dense
        self.blocks = nn.ModuleList(block(16, kind == "shapes" and i % 3 == 1) for i in range(6))
        for i, block in enumerate(self.blocks):
            block.index = i  # type: ignore[assignment]
        if kind == "shared":
            self.blocks[4].up = self.blocks[2].up
        if kind == "listed":
            self.listed = list(self.blocks)  # the blocks reached outside their container
        self.head = nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        outputs = []
        blocks = self.listed if self.kind == "listed" else self.blocks
        for i in range(6) if self.kind == "indexed" else range(len(blocks)):
            x = blocks[i](x)
            if self.kind == "between" and i == 2:  # an op between two blocks
                x = x * 2.0
            outputs.append(x)
        if self.kind == "summed":  # one tensor from every block's output: its size is the depth's
            x = torch.stack(outputs).mean(0)
        return self.head(x)


FULL_DEPTH = {
    "indexed": "the step failed with its stacks cut",
    "listed": "the step failed with its stacks cut (BlockCalledAfterCut",
    "by-index": "two blocks between the ends of a stack do not repeat",
    "between": "allocates outside its turn in a sweep over the blocks",
    "summed": "an op outside the blocks computed one tensor from",
    "shapes": "blocks: no run of its blocks repeats 5 times",
    "shared": "blocks: its blocks share parameters or buffers",
}


@pytest.mark.parametrize("kind", list(FULL_DEPTH))
def test_what_does_not_repeat_is_traced_at_full_depth_and_noted(kind: str) -> None:
    wl = _workload(lambda: _Stack(kind))
    real, written, blocks = _both(wl)
    assert blocks == 0
    assert [n for n in written.notes if FULL_DEPTH[kind] in n], written.notes
    assert everything(written)[:5] == everything(real)[:5]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", "1")
        est = batchfit.estimate(wl, 2, device="A100-80GB")
    assert any(n.startswith("traced at full depth (no depth synthesis)") for n in est.notes)


def test_a_plain_stack_is_written_and_a_model_without_one_is_traced_without_a_note() -> None:
    real, written, blocks = _both(_workload(lambda: _Stack()))
    assert blocks == 6 and not written.notes
    assert everything(written) == everything(real)
    mlp = presets.get("mlp")
    real, written, blocks = _both(mlp)
    assert blocks == 0 and not written.notes


class _Counted(_Dense):
    built = 0

    def __init__(self, width: int, wide: bool) -> None:
        super().__init__(width, wide)
        type(self).built += 1


class _Reading(nn.Module):
    """Eight blocks; with ``read``, the constructor reads a block the cut drops (it is then built whole)."""

    def __init__(self, read: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(_Counted(16, False) for _ in range(8))
        self.width = self.blocks[4].up.out_features if read else 16
        self.head = nn.Linear(self.width, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize(("read", "built"), [(False, 4), (True, 8)])
def test_the_blocks_a_cut_drops_are_not_built_unless_the_constructor_reads_them(read: bool, built: int) -> None:
    wl = _workload(lambda: _Reading(read))
    real, written, blocks = _both(wl)  # the first trace of the workload also builds it on meta, whole
    assert blocks == 8
    assert everything(written) == everything(real)
    _Counted.built = 0
    _trace(wl, True)
    assert _Counted.built == built


def test_off_traces_every_block_and_the_cache_keeps_the_two_apart() -> None:
    from batchfit.memory.cache import trace_key

    policy = policy_for("fp32", bf16_supported=True, device_name=A100.name)
    keys = {}
    for on in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", on)
            before = STATS.blocks_traced
            _trace_for_device(GPT, 2, A100, policy, ())
            keys[on] = (trace_key(GPT, 2, A100, policy, ()), STATS.blocks_traced - before)
    assert keys["1"][1] == 4 and keys["0"][1] == 0
    assert keys["1"][0] != keys["0"][0]
    assert os.environ.get("BATCHFIT_DEPTH_SYNTHESIS") is None


def test_the_state_bytes_of_a_model_built_cut_are_the_whole_models() -> None:
    from batchfit.memory.states import _state_bytes

    counted = {}
    for on in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", on)
            counted[on] = _state_bytes(GPT, torch.bfloat16)
    assert counted["1"] == counted["0"]
    assert counted["1"].gradients == sum(p.numel() * 2 for p in fake_model(GPT).parameters())


# -- traces that do not depend on what the process ran before ------------------------------------------
def _scripted_scale() -> Any:
    """A fresh TorchScript function (a new one each call: its executor starts cold), as some models'
    attention scales its scores (transformers 5.17's DeBERTa-v2 does)."""

    def scale(x: torch.Tensor, factor: int) -> torch.Tensor:
        return torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * factor)

    return torch.jit.script(scale)


class _ScriptedBlock(_Dense):
    def __init__(self, width: int, scale: Any) -> None:
        super().__init__(width, False)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.scale(x, 2)


class _Scripted(_Stack):
    def __init__(self, scale: Any) -> None:
        super().__init__(_ScriptedBlock(16, scale) for _ in range(6))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_torchscript_function_traces_alike_on_its_first_calls_and_later_ones() -> None:
    """TorchScript's profiling executor runs a function's first call through another plan than the later
    ones, which frees its temporaries in another order: the first trace of a process (here the cut one,
    written at full depth) and a later one (the traced full depth) would differ in their first block."""
    scale = _scripted_scale()
    wl = _workload(lambda: _Scripted(scale))
    real, written, blocks = _both(wl)
    assert blocks == 6, written.notes
    assert everything(written) == everything(real)
    assert everything(_trace(wl, True)) == everything(written)


def test_the_meta_build_writes_no_values_and_leaves_real_tensors_initialised() -> None:
    """The stacks are found on a ``meta`` build (``memory/synthesis/stackplan.py``), where initialisers write
    nothing: they are skipped there, and only there."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from batchfit.memory.synthesis.stackplan import _values_not_written

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def built(skip: bool) -> tuple[nn.Module, list[str]]:
        with torch.device("meta"), Ops() as ops, _values_not_written() if skip else contextlib.nullcontext():
            model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Embedding(5, 16))
            nn.init.trunc_normal_(model[2].weight, std=0.02)
        return model, ops.seen

    plain, plain_ops = built(False)
    skipped, skipped_ops = built(True)
    assert {"uniform_.default", "normal_.default"} <= set(plain_ops)
    assert not {op for op in skipped_ops if op.endswith(("uniform_.default", "normal_.default", "fill_.Scalar"))}
    assert [(k, p.shape, p.dtype, p.is_meta) for k, p in skipped.named_parameters()] == [
        (k, p.shape, p.dtype, p.is_meta) for k, p in plain.named_parameters()
    ]
    real = torch.zeros(1000)
    with _values_not_written():
        nn.init.uniform_(real, 1.0, 2.0)
    assert bool((real >= 1.0).all())  # a tensor with values is initialised as ever
