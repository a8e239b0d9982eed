"""Presets: published parameter counts, real and fake training steps, deterministic items, overrides, load."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from batchfit import ConfigError, UnknownNameError, Workload, presets
from batchfit.batching import batch_size_of, iter_tensors
from batchfit.models import hf
from batchfit.models.gpt import IGNORE_INDEX, token_loss

ROOT = Path(__file__).resolve().parents[1]
HAS_HF = hf.available()
needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")

TINY_TEXT = dict(vocab_size=256, seq_len=16)
TINY: dict[str, dict] = {
    "mlp": dict(hidden=16),
    "cnn": dict(image_size=16, width=4, stages=2, blocks=1),
    "gpt": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32),
    "hf-gpt2": dict(layers=1, n_embd=32, n_head=2, **TINY_TEXT),
    "hf-bert-large": dict(layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, **TINY_TEXT),
    "hf-llama-7b": dict(layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64, **TINY_TEXT),
    "hf-llama3-8b": dict(
        layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        **TINY_TEXT,
    ),
    "hf-vit-base": dict(
        layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=16, patch_size=8
    ),
    "hf-resnet50": dict(layers=1, embedding_size=8, hidden_sizes=[8, 16, 16, 32], image_size=16),
}


def with_marks(names: list[str]) -> list:
    """The preset names as test parameters, the hf-* ones skipped without transformers."""
    return [pytest.param(n, marks=needs_hf) if n.startswith("hf-") else n for n in names]


ALL = with_marks(list(TINY))

# Published parameter counts of the full-size shapes (the hf ones match the model cards' checkpoints).
FULL_SIZE = {
    "mlp": (32 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10),  # 6,922
    "cnn": 175_258,  # our own ResNet: width 16, 3 stages of 2 basic blocks, 10 classes
    "gpt": 124_439_808,  # GPT-2 small, lm_head tied to wte
    "hf-gpt2": 124_439_808,
    "hf-bert-large": 335_141_888 + 1024 * 2 + 2,  # bert-large-uncased with pooler + a 2-way classifier
    "hf-llama-7b": 6_738_415_616,
    "hf-llama3-8b": 8_030_261_248,
    "hf-vit-base": 86_567_656,
    "hf-resnet50": 25_557_032,
}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters count once


def mean_loss(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out[0] / out[1] if isinstance(out, tuple) else out


@pytest.fixture
def bf16_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("name", with_marks(list(FULL_SIZE)))
def test_full_size_parameter_count_on_fake_tensors(name: str) -> None:
    wl = presets.get(name)
    with FakeTensorMode():
        model = wl.build_model()
    assert isinstance(next(model.parameters()), FakeTensor)
    assert n_params(model) == FULL_SIZE[name]
    assert any(isinstance(m, wl.checkpoint_blocks) for m in model.modules())


def test_gpt_arithmetic_and_tied_weights() -> None:
    v, c, t, n_layer = 50257, 768, 1024, 12
    block = 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c)
    assert FULL_SIZE["gpt"] == v * c + t * c + n_layer * block + 2 * c
    with FakeTensorMode():
        model = presets.get("gpt").build_model()
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("name", ALL)
def test_one_real_training_step(name: str) -> None:
    torch.manual_seed(0)
    wl = presets.get(name, **TINY[name])
    model = wl.build_model()
    opt = wl.optimizer([p for p in model.parameters() if p.requires_grad])
    batch = wl.items(torch.arange(4), 0)
    assert batch_size_of(batch) == 4
    before = [p.detach().clone() for p in model.parameters()]
    loss = mean_loss(wl.loss(model, batch))
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("name", ALL)
def test_one_fake_training_step(name: str) -> None:
    wl = presets.get(name, **TINY[name])
    with FakeTensorMode():
        model = wl.build_model()
        batch = wl.batch(3)
        assert batch_size_of(batch) == 3
        assert all(isinstance(t, FakeTensor) for t in iter_tensors(batch))
        loss = mean_loss(wl.loss(model, batch))
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    assert all(g.shape == p.shape for g, p in zip(grads, model.parameters(), strict=True))


@pytest.mark.parametrize("name", ALL)
def test_items_are_deterministic_per_item(name: str) -> None:
    wl = presets.get(name, **TINY[name])
    whole = wl.items(torch.tensor([1, 2, 3, 4]), 0)
    part = wl.items(torch.tensor([3, 4]), 0)
    for a, b in zip(iter_tensors(whole), iter_tensors(part), strict=True):
        assert torch.equal(a[2:], b)
    other = wl.items(torch.tensor([3, 4]), 1)
    assert not all(torch.equal(a, b) for a, b in zip(iter_tensors(part), iter_tensors(other), strict=True))
    assert batch_size_of(wl.items(torch.tensor([], dtype=torch.long), 0)) == 0


@pytest.mark.parametrize("name", ALL)
def test_bf16_default_dtype_gives_bf16_parameters_and_inputs(name: str, bf16_default: None) -> None:
    wl = presets.get(name, **TINY[name])
    model = wl.build_model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    floats = [t for t in iter_tensors(wl.batch(2)) if t.is_floating_point()]
    assert all(t.dtype == torch.bfloat16 for t in floats)
    floats = [t for t in iter_tensors(wl.items(torch.tensor([0, 1]), 0)) if t.is_floating_point()]
    assert all(t.dtype == torch.bfloat16 for t in floats)


@needs_hf
def test_full_size_llama_builds_bf16_on_fake_tensors(bf16_default: None) -> None:
    with FakeTensorMode():
        model = presets.get("hf-llama-7b").build_model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_gpt_token_loss_counts_only_unpadded_targets() -> None:
    wl = presets.get("gpt", **TINY["gpt"], pad=True)
    idx, targets = wl.items(torch.arange(8), 0)
    n_real = int((targets != IGNORE_INDEX).sum())
    assert 8 <= n_real < targets.numel()  # every item has at least one token, some have padding
    model = wl.build_model()
    loss_sum, count = wl.loss(model, (idx, targets))
    assert int(count) == n_real
    logits = model(idx)
    keep = targets != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
    torch.testing.assert_close(loss_sum, expected)
    plain_idx, plain_targets = presets.get("gpt", **TINY["gpt"]).items(torch.arange(8), 0)
    assert torch.equal(plain_targets[keep], targets[keep]) and (plain_targets != IGNORE_INDEX).all()
    assert torch.equal(token_loss(logits, plain_targets)[1], torch.tensor(plain_targets.numel()))


def test_mlp_items_are_learnable() -> None:
    torch.manual_seed(0)
    wl = presets.get("mlp", lr=3e-3)
    model = wl.build_model()
    opt = wl.optimizer(model.parameters())
    losses = []
    for step in range(150):
        loss = wl.loss(model, wl.items(torch.arange(32 * step, 32 * step + 32), 0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.6 * sum(losses[:20]) / 20


def test_optimizer_choices_and_config() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw = presets.get("mlp").optimizer(params)
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults["lr"] == 1e-3 and adamw.defaults["weight_decay"] == 0.01
    sgd = presets.get("mlp", optimizer="sgd", lr=0.05).optimizer(params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 0.05
    assert type(presets.get("mlp", optimizer="adam").optimizer(params)) is torch.optim.Adam
    wl = presets.get("gpt", **TINY["gpt"])
    assert wl.config["seq_len"] == 32 and wl.config["optimizer"] == "adamw" and wl.config["lr"] == 1e-3
    assert wl.tokens_per_item == 32 and wl.config["dropout"] == 0.0
    assert presets.get("cnn", image_size="24").config["image_size"] == 24  # CLI strings are parsed
    with pytest.raises(ConfigError, match=r"unknown optimizer 'lamb'.*valid: adamw, adam, sgd, adamw_torch"):
        presets.get("mlp", optimizer="lamb")


@pytest.mark.parametrize("name", ALL)
def test_workloads_pickle(name: str) -> None:
    wl = pickle.loads(pickle.dumps(presets.get(name, **TINY[name])))
    assert isinstance(wl, Workload) and batch_size_of(wl.batch(2)) == 2


def test_unknown_preset_suggests_close_name() -> None:
    with pytest.raises(UnknownNameError) as info:
        presets.get("gtp")
    assert "gpt" in info.value.close_matches
    assert "'gpt'" in str(info.value)


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("gpt", dict(n_layers=2), "unknown override n_layers .*valid: n_layer"),
        ("gpt", dict(n_embd=65, n_head=2), "divisible"),
        ("gpt", dict(seq_len=64, block_size=32), "exceeds block_size"),
        ("mlp", dict(hidden="wide"), "not a valid int"),
        ("mlp", dict(depth=0), "at least 1"),
        ("cnn", dict(dropout=1.5), r"\[0, 1\)"),
        ("mlp", dict(lr=-1.0), "positive"),
    ],
)
def test_bad_overrides(name: str, overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        presets.get(name, **overrides)


@needs_hf
def test_hf_overrides() -> None:
    wl = presets.get("hf-gpt2", **TINY["hf-gpt2"], dropout=0.0)
    assert wl.config["n_layer"] == 1 and "layers" not in wl.config
    model = wl.build_model()
    assert (model.config.resid_pdrop, model.config.attn_pdrop, model.config.use_cache) == (0.0, 0.0, False)
    assert model.config._attn_implementation == "sdpa"
    assert presets.get("hf-gpt2").config["dropout"] == 0.1  # the published value is kept by default
    assert presets.get("hf-gpt2", seq_len=2048).config["n_positions"] == 2048
    assert presets.get("hf-resnet50", layers=2).config["depths"] == [2, 2, 2, 2]
    assert presets.get("hf-llama3-8b").tokens_per_item == 8192
    assert presets.get("hf-llama-7b", num_attention_heads=8).config["num_key_value_heads"] == 8  # stays MHA
    assert presets.get("hf-llama3-8b", num_attention_heads=16).config["num_key_value_heads"] == 8  # GQA kept
    with pytest.raises(ConfigError, match="divisible by num_key_value_heads"):
        presets.get("hf-llama3-8b", num_attention_heads=4)
    with pytest.raises(ConfigError, match="unknown override"):
        presets.get("hf-resnet50", dropout=0.1)
    with pytest.raises(ConfigError, match="not both"):
        presets.get("hf-gpt2", layers=1, n_layer=2)
    with pytest.raises(ConfigError, match="patch_size"):
        presets.get("hf-vit-base", image_size=100)
    with pytest.raises(ConfigError, match="exceeds"):
        presets.get("hf-bert-large", seq_len=1024, max_position_embeddings=512)


def test_hf_presets_need_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "available", lambda: False)
    assert presets.names() == ["mlp", "cnn", "gpt"]
    assert [n for n, _ in presets.describe()] == presets.names()
    with pytest.raises(ConfigError, match=r"install batchfit\[hf\]"):
        presets.get("hf-gpt2")


def test_names_and_describe() -> None:
    assert presets.names()[:3] == ["mlp", "cnn", "gpt"]
    assert [n for n, _ in presets.describe()] == presets.names()
    assert all(desc and "\n" not in desc for _, desc in presets.describe())
    assert ("hf-llama-7b" in presets.names()) == HAS_HF


def test_importing_presets_does_not_import_transformers() -> None:
    code = "import sys, batchfit.sources.presets; print('transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
    )
    assert out.stdout.strip() == "False"


def test_load_user_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    wl = presets.load("tests.user_workload:make", width=6)
    assert wl.name == "user-linear" and wl.config == {"width": 6}
    assert wl.build_model().in_features == 6
    assert presets.load("tests.user_workload:WORKLOAD").config == {"width": 4}
    assert presets.load("gpt", **TINY["gpt"]).name == "gpt"


@pytest.mark.parametrize(
    "spec, overrides, match",
    [
        ("tests.no_such_module:make", {}, "cannot import"),
        ("tests.user_workload:nope", {}, "no attribute 'nope'"),
        ("tests.user_workload:not_a_workload", {}, "returned int, not a batchfit.Workload"),
        ("tests.user_workload:NUMBER", {}, r"is not callable \(int\)"),
        ("tests.user_workload:make", dict(depth=3), "does not accept"),
        ("tests.user_workload:WORKLOAD", dict(width=3), "takes no overrides"),
        (":make", {}, "malformed"),
        ("gtp", {}, "did you mean 'gpt'"),
    ],
)
def test_load_errors(monkeypatch: pytest.MonkeyPatch, spec: str, overrides: dict, match: str) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    with pytest.raises(ConfigError, match=match):
        presets.load(spec, **overrides)
