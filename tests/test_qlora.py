"""QLoRA: a base quantised by bitsandbytes (4-bit NF4 / FP4) as a QLoRA script loads it, traced for real.

Everything runs on the CPU: bitsandbytes' CPU backend quantises and steps the real model the profiler
measures, and the same code runs on fake tensors for the estimate.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import batchfit
from batchfit.errors import ConfigError
from batchfit.gpu.catalog import get_device
from batchfit.memory.estimate import trace_for_device
from batchfit.memory.measure import measure_cpu_peak
from batchfit.memory.trace.fake_step import fake_model
from batchfit.models import hf
from batchfit.precision import policy_for
from batchfit.sources.lora import parse_lora
from batchfit.sources.quant import QuantSpec, quantized_weight_bytes

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not hf.available(), reason="needs transformers"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip


def _workload(lora: str = "r=4,quant=nf4,targets=all-linear", seq_len: int = 16) -> batchfit.Workload:
    import transformers

    from batchfit.sources.hub import workload_from_config

    return workload_from_config(transformers.LlamaConfig(**LLAMA), task="causal-lm", seq_len=seq_len,
                                lora=parse_lora(lora))  # fmt: skip


def _storages(weight: torch.Tensor) -> dict[str, int]:
    state = weight.quant_state
    out = {"packed": weight.untyped_storage().nbytes(), "code": state.code.untyped_storage().nbytes()}
    out["absmax"] = state.absmax.untyped_storage().nbytes()
    if state.nested:
        out["offset"] = state.offset.untyped_storage().nbytes()
        out["absmax2"] = state.state2.absmax.untyped_storage().nbytes()
        out["code2"] = state.state2.code.untyped_storage().nbytes()
    return out


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_a_4bit_linears_storages_are_the_bitsandbytes_formula(double_quant: bool, fake: bool) -> None:
    wl = _workload(f"r=4,quant=nf4,double_quant={str(double_quant).lower()},targets=all-linear")
    model = fake_model(wl) if fake else wl.build_model()
    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * 7  # q, k, v, o, gate, up, down in each layer; lm_head stays unquantised
    spec = QuantSpec("nf4", double_quant=double_quant)
    for m in linears:
        n = m.in_features * m.out_features
        parts = _storages(m.weight)
        blocks = math.ceil(n / 64)
        expected = {"packed": math.ceil(n / 2), "code": 16 * 4}
        if double_quant:
            expected.update(absmax=blocks, offset=4, absmax2=4 * math.ceil(blocks / 256), code2=256 * 4)
        else:
            expected.update(absmax=4 * blocks)
        assert parts == expected
        assert sum(parts.values()) == quantized_weight_bytes(n, spec)
    lm_head = model.get_base_model().lm_head
    assert type(lm_head) is torch.nn.Linear and lm_head.weight.dtype == torch.float32  # prepared: fp32


def test_the_estimate_counts_the_quantised_weights_and_the_fp32_cast_of_the_rest() -> None:
    wl = _workload()
    model = fake_model(wl)
    est = batchfit.estimate(wl, 2, device="cpu")
    from batchfit.workload import model_tensors

    weights = sum(t.untyped_storage().nbytes() for t in model_tensors(model))
    assert est.breakdown["parameters"] == weights
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.float32 and not p.requires_grad for p in norms)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("lora", ["r=4,quant=nf4,targets=all-linear", "r=4,quant=fp4,double_quant=false"])
def test_qlora_on_the_cpu_is_exact(precision: str, checkpointing: bool, lora: str) -> None:
    wl = _workload(lora)
    est = batchfit.estimate(wl, 2, device="cpu", precision=precision, checkpointing=checkpointing)
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, 2, precision=precision, checkpointing=checkpointing)


def test_on_a_gpu_the_4bit_matmul_dequantises_each_weight_in_forward_and_backward() -> None:
    wl = _workload("r=4,quant=nf4,targets=q_proj+v_proj", seq_len=32)
    trace = trace_for_device(wl, 2, get_device("A100-80GB"), policy_for("bf16"), ())
    dequantised = [s for s, op in trace.op.items() if op == "bitsandbytes 4-bit weight, dequantised"]
    # 14 linears, once per forward, two steps (backward's dequantisation is an op of its own)
    assert len(dequantised) == 14 * 2
    sizes = sorted({trace.nbytes[s] for s in dequantised})
    assert sizes == sorted({2 * 64 * 64, 2 * 64 * 32, 2 * 128 * 64})  # bf16 [out, in]: q/o, k/v, gate/up/down
    # In backward only where the input needs a gradient: not layer 0's q, k and v, whose input (the
    # normed output of the frozen embeddings) does not require grad.
    backward = [s for s, op in trace.op.items() if "dequantize_4bit" in op]
    assert len(backward) == (14 - 3) * 2


def test_bad_quantisation_input_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="unknown quantisation 'nf3'; use one of nf4, fp4, int8"):
        parse_lora("r=4,quant=nf3")
    with pytest.raises(ConfigError, match="add quant=nf4"):
        parse_lora("r=4,double_quant=false")
    with pytest.raises(ConfigError, match="unknown compute dtype"):
        parse_lora("r=4,quant=nf4,compute=int4")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed
    with pytest.raises(ConfigError, match=r"pip install 'batchfit\[qlora\]'"):
        batchfit.estimate(_workload(), 1, device="cpu")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_8bit_base_is_exact_on_the_cpu_and_takes_the_cuda_branch_on_a_gpu(precision: str) -> None:
    wl = _workload("r=4,quant=int8")
    assert "outlier columns assumed none" in wl.name
    model = fake_model(wl)
    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(linears) == 14
    for m in linears:  # NOTE [ A 4-bit weight's storages ]: int8 [out, in] and fp32 row scales
        assert m.weight.dtype == torch.int8 and m.weight.untyped_storage().nbytes() == m.in_features * m.out_features
        assert m.weight.SCB.dtype == torch.float32 and m.weight.SCB.numel() == m.out_features
    est = batchfit.estimate(wl, 2, device="cpu", precision=precision)
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, 2, precision=precision)
    trace = trace_for_device(wl, 2, get_device("A100-80GB"), policy_for(precision), ())
    ops = set(trace.op.values())
    assert any("int8_scaled_mm" in op for op in ops)  # LLM.int8()'s CUDA matmul, not the CPU's dequantise-then-matmul
    cpu = trace_for_device(wl, 2, get_device("cpu"), policy_for(precision), ())
    assert not any("int8_scaled_mm" in op for op in set(cpu.op.values()))


def test_a_fake_quantisation_first_leaves_bitsandbytes_caches_real() -> None:
    """bitsandbytes caches its 8-bit code on first use: an estimate (fake tensors) before any real model
    must not leave a fake code there for the real quantisation after it."""
    import subprocess

    code = (
        "import sys, torch; sys.path.insert(0, 'tests'); torch.set_num_threads(1)\n"
        "import batchfit\n"
        "from test_qlora import _workload\n"
        "from batchfit.memory.measure import measure_cpu_peak\n"
        "wl = _workload()\n"
        "est = batchfit.estimate(wl, 2, device='cpu').peak_allocated_bytes\n"
        "print(est == measure_cpu_peak(wl, 2), est)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split()[:1] == ["True"], done.stdout + done.stderr


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_a_quantised_model_is_planned_on_meta_and_built_without_the_blocks_the_cut_drops(quant: str) -> None:
    """Depth synthesis builds a deep model on ``meta`` first to know its stacks, then builds on fake tensors only the
    blocks it keeps (``memory/synthesis/stackplan.py``); quantising meta weights follows the kernels' shape rules,
    as fake ones do, so a QLoRA model is planned too and its dropped blocks are never built or quantised."""
    import dataclasses

    import transformers

    from batchfit.memory.synthesis.stackplan import plan_cut
    from batchfit.sources.hub import workload_from_config

    config = transformers.LlamaConfig(**{**LLAMA, "num_hidden_layers": 6})
    wl = workload_from_config(config, task="causal-lm", seq_len=16,
                              lora=parse_lora(f"r=4,quant={quant},targets=all-linear"))  # fmt: skip
    plan = plan_cut(wl, torch.bfloat16)
    assert plan is not None and [dataclasses.astuple(s)[1:] for s in plan.stacks] == [(6, 0, 6, 1, 0)]
    assert [sorted(ordinals) for _, ordinals in plan.skip] == [[3, 4]]  # blocks 3 and 4 are written, not built
    written = batchfit.estimate(wl, 2, device="A100-80GB", precision="bf16-true")
    assert not any("full depth" in n for n in written.notes)
    assert plan_cut(wl, torch.bfloat16) is plan  # the fake build went as planned (else the plan is dropped)
