"""Naming the model a user has: hub ids, model directories and config files, file:function, LoRA adapters.

Everything runs offline on local config directories; the hub is never contacted (``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import batchfit
from batchfit.cli import main
from batchfit.errors import ConfigError, TraceError
from batchfit.gpu.catalog import get_device
from batchfit.memory.categories import Category
from batchfit.memory.estimate import trace_for_device
from batchfit.memory.steps import default_dtype
from batchfit.models import hf
from batchfit.precision import policy_for
from batchfit.sources import load, parse_lora
from batchfit.workload import model_tensors

pytestmark = pytest.mark.skipif(not hf.available(), reason="needs transformers")

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024)  # fmt: skip


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _config_dir(tmp_path: Path, name: str = "tiny-llama", **extra: object) -> Path:
    import transformers

    d = tmp_path / name
    cfg = transformers.LlamaConfig(**{**LLAMA, **extra})
    cfg.save_pretrained(d)
    return d


def test_a_config_dir_builds_the_head_its_architectures_name(tmp_path: Path) -> None:
    d = _config_dir(tmp_path, architectures=["LlamaForSequenceClassification"], num_labels=3)
    wl = load(str(d), seq_len=32)
    assert wl.config["task"] == "text-classification"
    assert type(wl.build_model()).__name__ == "LlamaForSequenceClassification"
    batch = wl.batch(2)
    assert batch["input_ids"].shape == (2, 32) and batch["labels"].shape == (2,)
    assert "(text-classification, 32 tokens)" in wl.name


def test_config_json_and_task_override(tmp_path: Path) -> None:
    d = _config_dir(tmp_path, architectures=["LlamaForCausalLM"])
    wl = load(str(d / "config.json"), task="text-classification", seq_len=16)
    assert wl.config["model_class"] == "LlamaForSequenceClassification"
    with pytest.raises(ConfigError, match="unknown task"):
        load(str(d), task="translation")


def test_hub_model_on_cpu_is_exact(tmp_path: Path) -> None:
    from batchfit.memory.measure import measure_cpu_peak

    wl = load(str(_config_dir(tmp_path, architectures=["LlamaForCausalLM"])), seq_len=32)
    torch.set_num_threads(1)
    assert batchfit.estimate(wl, 2, device="cpu").peak_allocated_bytes == measure_cpu_peak(wl, 2)


def test_config_fields_and_sequence_length_are_checked(tmp_path: Path) -> None:
    d = _config_dir(tmp_path, architectures=["LlamaForCausalLM"], max_position_embeddings=64)
    assert load(str(d), num_hidden_layers=1).build_model().config.num_hidden_layers == 1
    with pytest.raises(ConfigError, match="no field 'num_layers'"):
        load(str(d), num_layers=1)
    with pytest.raises(ConfigError, match="longer than the model's 64 positions"):
        load(str(d), seq_len=128)


def test_a_config_with_no_known_head_names_the_fix(tmp_path: Path) -> None:
    d = _config_dir(tmp_path, architectures=["LlamaForSomethingElse"])
    with pytest.raises(ConfigError, match="pass --task"):
        load(str(d))


def test_an_unknown_hub_id_offline_says_how_to_get_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError, match="huggingface-cli download meta-llama/Llama-3.1-8B config.json"):
        load("meta-llama/Llama-3.1-8B")


def test_an_unknown_single_name_suggests_presets() -> None:
    with pytest.raises(ConfigError, match="did you mean 'gpt'"):
        load("gtp")


def test_file_function_workloads(tmp_path: Path) -> None:
    f = tmp_path / "train.py"
    f.write_text(
        "import torch\nfrom torch import nn\nimport batchfit\n"
        "def make_workload(width=8):\n"
        "    return batchfit.Workload(model=lambda: nn.Linear(width, 2),\n"
        "        batch=lambda b: (torch.randn(b, width), torch.randint(0, 2, (b,))),\n"
        "        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))\n"
        "def broken():\n    raise RuntimeError('no data')\n"
    )
    wl = load(f"{f}:make_workload", width=4)
    assert batchfit.estimate(wl, 3, device="cpu").breakdown["parameters"] == (4 * 2 + 2) * 4
    with pytest.raises(ConfigError, match="raised RuntimeError: no data"):
        load(f"{f}:broken")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load(f"{f}:nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load(f"{tmp_path / 'missing.py'}:make_workload")


def test_parse_lora() -> None:
    spec = parse_lora("r=16,alpha=32,targets=q_proj+v_proj,dropout=0.05")
    assert (spec.r, spec.alpha, spec.targets, spec.dropout) == (16, 32.0, ("q_proj", "v_proj"), 0.05)
    assert parse_lora("r=4", targets="all-linear").targets == "all-linear"
    assert parse_lora("method=ia3").method == "ia3"
    bad_specs = (("r=0", "at least 1"), ("rank=4", "unknown --lora key"), ("r=four", "whole number"),
                 ("dropout=1.5", "dropout"), ("r", "KEY=VALUE"), ("method=dora", "unknown adapter"))  # fmt: skip
    for bad, fragment in bad_specs:
        with pytest.raises(ConfigError, match=fragment):
            parse_lora(bad)


def _alive_by_role(trace: object, phase: str, step: int) -> dict[Category, int]:
    """Bytes alive by role when ``phase`` of ``step`` starts."""
    start = next(i for i, p, s in trace.phases if (p, s) == (phase, step))
    alive: set[int] = set()
    for e in trace.events[:start]:
        (alive.add(e) if e >= 0 else alive.discard(~e))
    out: dict[Category, int] = {}
    for sid in alive:
        role = trace.role.get(sid, Category.TEMPORARIES)
        out[role] = out.get(role, 0) + trace.nbytes[sid]
    return out


@pytest.mark.parametrize("adapters", ["r=8,targets=q_proj+v_proj", "method=ia3,targets=k_proj+v_proj"])
def test_peft_adapters_in_bf16_true_train_only_the_adapters(tmp_path: Path, adapters: str) -> None:
    pytest.importorskip("peft")
    wl = load(str(_config_dir(tmp_path, architectures=["LlamaForCausalLM"])), seq_len=32, lora=adapters)
    with default_dtype(torch.bfloat16):
        real = wl.build_model()  # the same model, built for real, counted by hand
    trainable = [p for p in real.parameters() if p.requires_grad]
    assert 0 < sum(p.numel() for p in trainable) < sum(p.numel() for p in real.parameters()) // 10
    assert all(p.dtype == torch.bfloat16 for p in real.parameters() if not p.requires_grad)
    weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model_tensors(real)}.values())
    # peft keeps adapters in fp32 on a bf16 base (get_peft_model's autocast_adapter_dtype): count their own dtype
    grads = sum(p.numel() * p.element_size() for p in trainable)
    states = sum(2 * p.numel() * p.element_size() + 4 for p in trainable)  # AdamW: exp_avg, exp_avg_sq + fp32 step

    trace = trace_for_device(wl, 2, get_device("cpu"), policy_for("bf16-true"), ())
    at_step = _alive_by_role(trace, "optimizer", 1)
    assert at_step[Category.PARAMETERS] == weights
    assert at_step[Category.GRADIENTS] == grads
    assert at_step.get(Category.OPTIMIZER_STATES, 0) == states
    est = batchfit.estimate(wl, 2, device="L4", precision="bf16-true")
    assert est.fits
    # the closed form counts the adapters' gradients and moments only (no step counters), not the frozen base's
    assert (est.analytic["gradients"], est.analytic["optimizer_states"]) == (grads, 2 * grads)


def test_cli_estimates_a_local_config_with_lora(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("peft")
    d = _config_dir(tmp_path, architectures=["LlamaForCausalLM"])
    code = main(["estimate", str(d), "-b", "4", "--seq-len", "512", "--device", "L4", "--lora", "r=16"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "LoRA r=16" in out and "gradients" in out and "optimizer states" in out
    code = main(["estimate", str(d), "-b", "1", "--seq-len", "64", "--json", "--lora-targets", "all-linear"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["workload"].endswith("LoRA r=8 on all-linear")


def test_cli_unknown_hub_id_offline_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    code = main(["estimate", "meta-llama/Llama-3.1-8B", "-b", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("batchfit: error:") and "huggingface-cli download" in err


def test_a_factory_that_raises_and_a_step_that_fails_are_one_line(tmp_path: Path) -> None:
    from torch import nn

    def factory() -> nn.Module:
        raise ValueError("weights not found")

    bad_factory = batchfit.Workload(model=factory, batch=lambda b: torch.randn(b, 4), loss=lambda m, x: m(x).sum())
    with pytest.raises(ConfigError, match="model factory raised ValueError: weights not found"):
        batchfit.estimate(bad_factory, 2)
    mismatch = batchfit.Workload(model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Linear(9, 2)),
                                 batch=lambda b: torch.randn(b, 4), loss=lambda m, x: m(x).sum())  # fmt: skip
    with pytest.raises(TraceError, match=r"failed in Sequential\.1 at aten\..*mm.*would fail on a real device"):
        batchfit.estimate(mismatch, 2)
