"""Activation checkpointing of models named by hub id, directory or config: their layers, checkpointed as
transformers itself checkpoints them (``gradient_checkpointing_enable``), exact on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from zoo import HF_ENTRIES, PEFT_ENTRIES, Entry

import batchfit
from batchfit.activation_checkpointing import UseReentrant, apply_checkpointing, checkpoint_classes, model_layers
from batchfit.cli import main
from batchfit.errors import ConfigError
from batchfit.memory.measure import measure_cpu_peak
from batchfit.models import hf

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not hf.available(), reason="needs transformers"),
]

# The families whose transformers models have repeated layers (CNNs' stages are not layers transformers checkpoints).
LAYERED = ("decoder", "moe", "encoder", "encoder-decoder", "vit", "audio", "multimodal")


def _layered() -> list:
    return [pytest.param(e, id=e.name, marks=[pytest.mark.slow] if e.slow else []) for e in HF_ENTRIES
            if e.family in LAYERED]  # fmt: skip


@pytest.mark.parametrize("entry", _layered())
def test_a_named_model_checkpoints_its_layers_exactly(entry: Entry) -> None:
    wl = entry.make()
    if not wl.build_model().supports_gradient_checkpointing:  # ALBERT: transformers cannot checkpoint it either
        assert wl.checkpoint_blocks == ()
        return
    assert wl.checkpoint_blocks, f"{entry.name} names no layers to checkpoint"
    plain = batchfit.estimate(wl, entry.batch_size, device="cpu")
    est = batchfit.estimate(wl, entry.batch_size, device="cpu", checkpointing=True)
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, entry.batch_size, checkpointing=True)
    assert est.checkpointing and est.peak_allocated_bytes <= plain.peak_allocated_bytes


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.name) for e in PEFT_ENTRIES if "lora" in e.name])
@pytest.mark.parametrize("checkpointing", [True, "reentrant"])
def test_adapters_on_checkpointed_layers_are_exact_reentrant_or_not(entry: Entry, checkpointing: object) -> None:
    pytest.importorskip("peft")
    wl = entry.make()
    est = batchfit.estimate(wl, entry.batch_size, device="cpu", checkpointing=checkpointing)
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, entry.batch_size, checkpointing=checkpointing)


def _bert_with_lora() -> nn.Module:
    import peft

    wl = next(e for e in HF_ENTRIES if e.name == "bert").make()
    model = peft.get_peft_model(wl.build_model(), peft.LoraConfig(r=4, target_modules=["query", "value"]))
    return model, wl


def test_a_transformers_model_is_checkpointed_by_its_own_switch() -> None:
    """transformers' switch also makes the embeddings' output require grad (frozen weights then save
    what a bare block wrapper would not): the layers are flagged, not wrapped, and that hook runs."""
    pytest.importorskip("peft")
    model, wl = _bert_with_lora()
    layers = model_layers(model)
    assert [c.__name__ for c in layers] == ["BertLayer"]
    assert apply_checkpointing(model, layers) == 2
    flagged = [m for m in model.modules() if isinstance(m, layers)]
    assert all(m.gradient_checkpointing for m in flagged)
    assert all("forward" not in vars(m) for m in flagged)  # not wrapped by batchfit
    model.train()
    outputs: list[torch.Tensor] = []
    embeddings = model.get_base_model().get_input_embeddings()
    embeddings.register_forward_hook(lambda m, i, o: outputs.append(o))
    wl.loss(model, wl.batch(2)).backward()
    assert outputs and outputs[0].requires_grad


def test_other_classes_are_wrapped_and_a_reentrant_marker_is_carried() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)))
    assert apply_checkpointing(model, (nn.Linear, UseReentrant)) == 2
    assert isinstance(model[0].forward, __import__("functools").partial)
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None
    assert checkpoint_classes("reentrant", (nn.Linear,)) == (nn.Linear, UseReentrant)
    assert checkpoint_classes(True, (nn.Linear,)) == (nn.Linear,)
    with pytest.raises(ConfigError, match="names no blocks"):
        checkpoint_classes("reentrant", ())
    with pytest.raises(ConfigError, match="'blocks', 'reentrant'"):
        checkpoint_classes("every-other", (nn.Linear,))


def _config_dir(tmp_path: Path) -> Path:
    import transformers

    d = tmp_path / "tiny-llama"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096,
                             architectures=["LlamaForCausalLM"]).save_pretrained(d)  # fmt: skip
    return d


def test_fit_checkpoints_a_model_named_by_its_directory(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = _config_dir(tmp_path)
    args = ["fit", str(d), "--seq-len", "2048", "--device", "512MiB", "--precision", "bf16-true", "--json"]
    assert main([*args, "--lora", "r=4,targets=q_proj+v_proj", "--checkpointing"]) == 0
    checkpointed = json.loads(capsys.readouterr().out)
    assert main([*args, "--lora", "r=4,targets=q_proj+v_proj"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert checkpointed["max_batch_size"] > plain["max_batch_size"] >= 1


def test_a_plan_of_a_named_model_tries_checkpointing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    wl = batchfit.sources.load(str(_config_dir(tmp_path)), seq_len=1024)
    one = batchfit.estimate(wl, 1, device="4GiB", precision="bf16-true")
    ck = batchfit.estimate(wl, 1, device="4GiB", precision="bf16-true", checkpointing=True)
    assert ck.device_total_bytes < one.device_total_bytes
    between = (ck.device_total_bytes + one.device_total_bytes) / 2 / 2**20  # room for a checkpointed item only
    p = batchfit.plan(wl, 4, device=f"{between:.2f}MiB", precision="bf16-true")
    assert p.checkpointing and p.micro_batch_size * p.accumulation_steps * p.gpus == 4


def test_the_trainers_reentrant_checkpointing_is_what_its_workload_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from batchfit.integrations._hf_workload import trainer_workload

    model = next(e for e in HF_ENTRIES if e.name == "llama-gqa").make().build_model()
    plain = TrainingArguments(str(tmp_path), report_to=[], gradient_checkpointing=True)
    reentrant = TrainingArguments(str(tmp_path), report_to=[], gradient_checkpointing=True,
                                  gradient_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
    assert UseReentrant not in trainer_workload(model, plain, seq_len=16).checkpoint_blocks
    blocks = trainer_workload(model, reentrant, seq_len=16).checkpoint_blocks
    assert UseReentrant in blocks and [c.__name__ for c in blocks if c is not UseReentrant] == ["LlamaDecoderLayer"]
