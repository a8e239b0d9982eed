"""The fine-tuning recipe said as options (NOTE [ The fine-tuning recipe, said ] in ``sources/lora.py``):
kbit preparation, the adapters' dtype, a quantised head and reentrant checkpointing, each changing the
model exactly as the recipe does, and the CPU estimate exact for each."""

from __future__ import annotations

import pytest
import torch

import batchfit
from batchfit.activation_checkpointing import NonReentrant, UseReentrant, apply_checkpointing, checkpoint_classes
from batchfit.errors import ConfigError
from batchfit.memory.measure import measure_cpu_peak
from batchfit.memory.steps import build_for_steps
from batchfit.models import hf
from batchfit.sources.lora import LoraSpec, parse_lora
from batchfit.sources.quant import QuantSpec

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not hf.available(), reason="needs transformers"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
pytest.importorskip("peft")

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip


def _workload(lora: str, seq_len: int = 16) -> batchfit.Workload:
    import transformers

    from batchfit.sources.hub import workload_from_config

    return workload_from_config(transformers.LlamaConfig(**LLAMA), task="causal-lm", seq_len=seq_len,
                                lora=parse_lora(lora))  # fmt: skip


def _dtypes(lora: str, param_dtype: torch.dtype | None) -> dict[str, set[torch.dtype]]:
    """Trainable and frozen floating parameters' dtypes of the model as training builds it."""
    model, _ = build_for_steps(_workload(lora), param_dtype, ())
    out: dict[str, set[torch.dtype]] = {"trainable": set(), "norms": set()}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out["trainable"].add(p.dtype)
        elif "norm" in name:
            out["norms"].add(p.dtype)
    return out


def test_adapters_are_what_peft_makes_them_unless_said() -> None:
    assert _dtypes("r=4", torch.bfloat16)["trainable"] == {torch.float32}  # peft's autocast_adapter_dtype
    assert _dtypes("r=4", None)["trainable"] == {torch.float32}
    assert _dtypes("r=4,adapter_dtype=bf16", torch.bfloat16)["trainable"] == {torch.bfloat16}  # model.to(bf16)
    assert _dtypes("r=4,adapter_dtype=bf16", None)["trainable"] == {torch.bfloat16}


def test_fp32_adapters_on_a_bf16_base_cost_what_their_casts_cost_and_the_estimate_is_exact() -> None:
    """Under bf16-true, fp32 adapters cast every adapted layer's input to fp32 (peft's ``_cast_input_dtype``):
    more memory than bf16 adapters, and the CPU estimate is the CPU allocator's peak either way."""
    peaks = {}
    for lora in ("r=4,targets=all-linear,adapter_dtype=bf16", "r=4,targets=all-linear"):
        wl = _workload(lora)
        est = batchfit.estimate(wl, 2, device="cpu", precision="bf16-true")
        assert est.peak_allocated_bytes == measure_cpu_peak(wl, 2, precision="bf16-true")
        peaks[lora] = est
    cast, kept = peaks.values()
    adapters = sum(p.numel() for p in build_for_steps(_workload("r=4,targets=all-linear"), torch.bfloat16, ())[0]
                   .parameters() if p.requires_grad)  # fmt: skip
    # each adapter weight takes 4 bytes instead of 2 (the peak, elsewhere in the step, also holds its casts)
    assert kept.breakdown["parameters"] - cast.breakdown["parameters"] == 2 * adapters
    assert kept.peak_allocated_bytes > cast.peak_allocated_bytes


@pytest.mark.parametrize("lora", ["r=4,quant=nf4,targets=all-linear",
                                  "r=4,quant=nf4,targets=all-linear,kbit_prep=false",
                                  "r=4,quant=nf4,quantize_head=true"])  # fmt: skip
def test_a_quantised_recipe_is_exact_on_the_cpu(lora: str) -> None:
    pytest.importorskip("bitsandbytes")
    wl = _workload(lora)
    est = batchfit.estimate(wl, 2, device="cpu", precision="bf16-true", checkpointing=True)
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, 2, precision="bf16-true", checkpointing=True)


def test_kbit_preparation_casts_the_unquantised_weights_to_fp32_and_without_it_they_keep_the_load_dtype() -> None:
    pytest.importorskip("bitsandbytes")
    assert _dtypes("r=4,quant=nf4", torch.bfloat16)["norms"] == {torch.float32}
    assert _dtypes("r=4,quant=nf4,kbit_prep=false", torch.bfloat16)["norms"] == {torch.bfloat16}
    prepared = batchfit.estimate(_workload("r=4,quant=nf4"), 2, device="cpu", precision="bf16-true")
    kept = batchfit.estimate(_workload("r=4,quant=nf4,kbit_prep=false"), 2, device="cpu", precision="bf16-true")
    assert prepared.breakdown["parameters"] > kept.breakdown["parameters"]


def test_the_head_is_quantised_when_said_and_a_tied_head_never_is() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    model, _ = build_for_steps(_workload("r=4,quant=nf4,quantize_head=true"), None, ())
    assert isinstance(model.get_base_model().lm_head, bnb.nn.Linear4bit)
    model, _ = build_for_steps(_workload("r=4,quant=nf4"), None, ())
    assert type(model.get_base_model().lm_head) is torch.nn.Linear
    import transformers

    from batchfit.sources.hub import workload_from_config

    tied = workload_from_config(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True), task="causal-lm",
                                seq_len=16, lora=parse_lora("r=4,quant=nf4,quantize_head=true"))  # fmt: skip
    model, _ = build_for_steps(tied, None, ())
    assert not isinstance(model.get_base_model().lm_head, bnb.nn.Linear4bit)


@pytest.mark.parametrize(("flag", "marker", "use_reentrant"), [("true", UseReentrant, True),
                                                              ("false", NonReentrant, False)])  # fmt: skip
def test_reentrant_checkpointing_is_said_in_the_recipe(flag: str, marker: type, use_reentrant: bool) -> None:
    wl = _workload(f"r=4,reentrant={flag}")
    classes = checkpoint_classes("blocks", wl.checkpoint_blocks)
    assert marker in classes
    model = wl.build_model()
    assert apply_checkpointing(model, classes) == 2
    layer = model.get_base_model().model.layers[0]
    assert layer._gradient_checkpointing_func.keywords["use_reentrant"] is use_reentrant
    est = batchfit.estimate(wl, 2, device="cpu", checkpointing=True)
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, 2, checkpointing=True)


def test_the_recipe_is_said_in_the_estimate_and_bad_values_are_one_line() -> None:
    spec = parse_lora("r=8,quant=nf4,kbit_prep=false,adapter_dtype=BF16,reentrant=yes,quantize_head=1")
    assert spec == LoraSpec(r=8, quant=QuantSpec("nf4", quantize_head=True), kbit_prep=False, adapter_dtype="bf16",
                            reentrant=True)  # fmt: skip
    assert spec.describe() == ("QLoRA r=8 on default (nf4 double-quant base, bf16 compute, head quantised); "
                               "no kbit prep, bf16 adapters, reentrant")  # fmt: skip
    prepared = "QLoRA r=8 on default (nf4 double-quant base, bf16 compute); kbit prep"
    assert parse_lora("r=8,quant=nf4").describe() == prepared
    assert parse_lora("r=8").describe() == "LoRA r=8 on default"
    for bad, words in [("r=8,kbit_prep=false", "kbit_prep applies to quantised bases"),
                       ("r=8,quantize_head=true", "quantize_head apply to quantised bases"),
                       ("r=8,adapter_dtype=fp8", "unknown adapter dtype 'fp8'"),
                       ("r=8,reentrant=maybe", "reentrant must be true or false")]:  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            parse_lora(bad)


def test_the_hugging_face_recipe_is_a_precision_bf16_weights_under_autocast_with_peft_s_adapters() -> None:
    """``bf16-true-autocast``: a model loaded in bf16 and trained with ``TrainingArguments(bf16=True)``. The
    base is built in bf16, peft's adapters stay fp32, the forward runs under autocast; exact on the CPU."""
    from batchfit.precision import Precision, policy_for

    policy = policy_for("bf16-true-autocast")
    assert (policy.precision, policy.param_dtype, policy.autocast_dtype) == (
        Precision.BF16_TRUE_AUTOCAST, torch.bfloat16, torch.bfloat16)  # fmt: skip
    dtypes = _dtypes("r=4,targets=all-linear", policy.param_dtype)
    assert dtypes == {"trainable": {torch.float32}, "norms": {torch.bfloat16}}
    wl = _workload("r=4,targets=all-linear")
    recipe = batchfit.estimate(wl, 2, device="cpu", precision="bf16-true-autocast")
    assert recipe.precision == "bf16-true-autocast"
    assert recipe.peak_allocated_bytes == measure_cpu_peak(wl, 2, precision="bf16-true-autocast")
    true = batchfit.estimate(wl, 2, device="cpu", precision="bf16-true")
    mixed = batchfit.estimate(wl, 2, device="cpu", precision="bf16")
    assert recipe.breakdown["parameters"] == true.breakdown["parameters"]  # bf16 base, fp32 adapters: the same
    assert recipe.breakdown["parameters"] < mixed.breakdown["parameters"]  # not fp32 weights
    with pytest.raises(ConfigError, match="no native bf16"):
        policy_for("bf16-true-autocast", bf16_supported=False, device_name="V100-16GB")


def test_a_gpu_estimate_and_fit_take_the_new_precision() -> None:
    est = batchfit.estimate(batchfit.presets.get("gpt", n_layer=1, n_embd=32, n_head=2, vocab_size=64, seq_len=16),
                            2, device="A100-40GB", precision="bf16-true-autocast")  # fmt: skip
    assert est.precision == "bf16-true-autocast" and est.analytic
    with pytest.raises(ConfigError, match="bf16-true-autocast"):
        batchfit.estimate("gpt", 2, device="cpu", precision="bf16-autocast-true")
