"""Fused linear cross-entropy losses (Liger, cut cross-entropy): no logits materialised, exact on the CPU,
and found in a user's own loss."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

import batchfit
from batchfit.errors import ConfigError
from batchfit.gpu.catalog import get_device
from batchfit.memory.estimate import trace_for_device
from batchfit.memory.kernels.fused_loss import liger_loss
from batchfit.memory.measure import measure_cpu_peak
from batchfit.models import hf
from batchfit.precision import policy_for

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not hf.available(), reason="needs transformers"),
]

VOCAB, SEQ, BATCH = 4096, 128, 4


def _workload(fused: str | None, lora: str | None = None, vocab: int = VOCAB) -> batchfit.Workload:
    import transformers

    from batchfit.sources.fused import with_fused_loss
    from batchfit.sources.hub import workload_from_config
    from batchfit.sources.lora import parse_lora

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=SEQ)  # fmt: skip
    wl = workload_from_config(config, task="causal-lm", seq_len=SEQ, lora=parse_lora(lora) if lora else None)
    return with_fused_loss(wl, fused) if fused else wl


@pytest.mark.parametrize("fused", ["liger", "cce"])
@pytest.mark.parametrize("precision", ["bf16", "bf16-true"])
@pytest.mark.parametrize("lora", [None, "r=4"])
def test_fused_losses_are_exact_on_the_cpu(fused: str, precision: str, lora: str | None) -> None:
    wl = _workload(fused, lora, vocab=256)
    est = batchfit.estimate(wl, 2, device="cpu", precision=precision)
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, 2, precision=precision)


def test_liger_in_fp32_is_exact_on_the_cpu_and_cut_cross_entropy_refuses_it() -> None:
    wl = _workload("liger", vocab=256)
    assert batchfit.estimate(wl, 2, device="cpu").peak_allocated_bytes == measure_cpu_peak(wl, 2)
    with pytest.raises(ConfigError, match="16-bit hidden states.*--precision bf16"):
        batchfit.estimate(_workload("cce", vocab=256), 2, device="cpu")


@pytest.mark.parametrize("precision", ["bf16", "bf16-true"])
def test_no_storage_holds_the_logits_with_a_fused_loss(precision: str) -> None:
    tokens = BATCH * SEQ
    gpu, policy = get_device("A100-80GB"), policy_for(precision)
    largest = {}
    for fused in (None, "liger", "cce"):
        trace = trace_for_device(_workload(fused), BATCH, gpu, policy, ())
        # storages of the step (kernel scratch, the cuBLAS workspace among it, has ids from 1 << 40)
        largest[fused] = max(n for s, n in trace.nbytes.items() if trace.op.get(s) != "param" and s < 1 << 40)
    assert largest[None] >= tokens * VOCAB * 4  # the default loss upcasts the logits to fp32
    chunk = 8  # Liger: next_power_of_2(ceil(512 / ceil(4096 / 64)))
    assert largest["liger"] < tokens * VOCAB  # never a whole logits tensor, even in 16 bits
    assert largest["cce"] < tokens * VOCAB
    assert largest["liger"] >= chunk * VOCAB * 2 or largest["liger"] == VOCAB * 64 * 4  # a chunk, or a weight
    fused = batchfit.estimate(_workload("liger"), BATCH, device="A100-80GB", precision=precision)
    plain = batchfit.estimate(_workload(None), BATCH, device="A100-80GB", precision=precision)
    assert fused.peak_allocated_bytes < plain.peak_allocated_bytes


def test_a_torch_whose_fake_mode_lacks_the_mixed_dtype_addmm_traces_the_same_liger_step(monkeypatch) -> None:
    """torch 2.11 has CUDA's ``addmm`` with an fp32 ``out_dtype`` but no fake kernel for it: Liger's fp32 weight
    gradient is still written in place, allocating nothing, so the step is the one a torch with the fake
    kernel traces, event for event (compared where this torch's fake mode has the form, as 2.13's has; where it
    has not, the step traces)."""
    from batchfit.memory import estimate as memory_estimate
    from batchfit.memory.kernels import fused_loss

    legs = (False, True) if fused_loss._fake_dtype_addmm() else (False,)
    calls = []
    addmm_into = fused_loss._addmm_into
    monkeypatch.setattr(fused_loss, "_addmm_into", lambda out, a, b: calls.append(out.dtype != a.dtype)
                        or addmm_into(out, a, b))  # fmt: skip
    gpu, policy = get_device("A100-80GB"), policy_for("bf16")
    traces = []
    for fake_kernel in legs:
        monkeypatch.setattr(fused_loss, "_fake_dtype_addmm", lambda fake_kernel=fake_kernel: fake_kernel)
        traces.append(memory_estimate._trace_for_device(_workload("liger"), BATCH, gpu, policy, ()))
    assert any(calls)  # the mixed-dtype form was asked for: bf16 activations, an fp32 weight gradient
    without, *with_kernel = traces
    assert all(without.events == t.events and without.nbytes == t.nbytes for t in with_kernel)


class _NeedsTriton(torch.autograd.Function):
    """Liger's autograd function as far as a machine without Triton can run it: not at all."""

    @staticmethod
    def forward(ctx, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN205
        raise RuntimeError("Liger's kernels need Triton on a GPU")

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN002, ANN205
        raise RuntimeError("Liger's kernels need Triton on a GPU")


def test_a_users_own_liger_loss_is_found_and_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("liger_kernel.ops.fused_linear_cross_entropy")
    module.LigerFusedLinearCrossEntropyFunction = _NeedsTriton
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_cross_entropy", module)

    def model() -> nn.Module:
        return nn.ModuleDict({"body": nn.Embedding(256, 32), "head": nn.Linear(32, 1024, bias=False)})

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 256, (b, 16)), torch.randint(0, 1024, (b, 16))

    def own(m: nn.ModuleDict, data: tuple) -> torch.Tensor:  # a training script calling Liger by hand
        hidden = m["body"](data[0]).view(-1, 32)
        return module.LigerFusedLinearCrossEntropyFunction.apply(hidden, m["head"].weight, data[1].view(-1))[0]

    def reference(m: nn.ModuleDict, data: tuple) -> torch.Tensor:
        return liger_loss(m["body"](data[0]), m["head"].weight, data[1], shift=False)

    est = batchfit.estimate(batchfit.Workload(model=model, batch=batch, loss=own), 4, device="A100-80GB")
    ref = batchfit.estimate(batchfit.Workload(model=model, batch=batch, loss=reference), 4, device="A100-80GB")
    assert est.peak_allocated_bytes == ref.peak_allocated_bytes
    assert any("Liger" in n for n in est.notes)
    assert module.LigerFusedLinearCrossEntropyFunction.forward is _NeedsTriton.forward  # put back after the trace


def test_fused_loss_input_is_checked(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    import transformers

    from batchfit.sources import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="unknown fused loss 'flash'; use one of liger, cce"):
        _workload("flash")
    d = tmp_path / "classifier"
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             vocab_size=64, architectures=["LlamaForSequenceClassification"]).save_pretrained(d)
    with pytest.raises(ConfigError, match="applies to causal language models; this workload trains text-class"):
        load(str(d), fused_loss="liger")
    for name in ("mlp", "hf-vit-base"):
        with pytest.raises(ConfigError, match="needs a transformers causal language model"):
            batchfit.estimate(load(name, fused_loss="liger"), 2, device="A100-80GB")


def test_the_gpt_preset_and_an_hf_preset_take_a_fused_loss() -> None:
    from batchfit.sources import load

    for name in ("hf-gpt2",):
        wl = load(name, fused_loss="liger", n_layer=2, seq_len=64, n_embd=64, n_head=4, vocab_size=512)
        assert wl.config["fused_loss"] == "liger"
        assert batchfit.estimate(wl, 2, device="cpu").peak_allocated_bytes == measure_cpu_peak(wl, 2)


LIGER = "Liger fused linear cross-entropy"


def test_a_plan_held_back_by_its_logits_shows_the_fused_loss_beside_it() -> None:
    """NOTE [ A fused loss beside a plan held back by memory ]: 4096-token vocabulary logits cost 7 MiB an item; on
    a 500 MiB GPU the model's own loss runs 16 items in several micro-batches, the fused loss in one, faster. The
    plan stays the user's step; the fused one is shown beside it with what turns it on."""
    p = batchfit.plan(_workload(None), 16, device="500MiB", precision="bf16", checkpointing=False)
    assert p.accumulation_steps > 1 and LIGER not in p.remedies
    fused = [o for o in p.alternatives if o.remedies[:1] == (LIGER,)]
    assert len(fused) == 1 and (fused[0].micro_batch_size, fused[0].accumulation_steps) == (16, 1)
    assert fused[0].predicted_step_s < p.predicted_step_s
    # the share was fitted as an accumulating step (planning/options.py): its memory is that step's
    est = batchfit.estimate(_workload("liger"), 16, device="500MiB", precision="bf16", accumulation_steps=2)
    assert fused[0].device_total_bytes == est.device_total_bytes <= 500 << 20
    (line,) = [w for w in p.warnings if w.startswith(f"with the {LIGER}")]
    assert "16 x 1 micro-batches" in line and "apply_liger_kernel_to_<model>(fused_linear_cross_entropy=True)" in line


def test_a_plan_that_fits_only_with_a_fused_loss_names_it() -> None:
    """NOTE [ A fused loss when nothing else fits ]: one item of the model's own loss exceeds a 430 MiB GPU, the
    fused loss's step fits: the plan is made with it, and says so."""
    with pytest.raises(batchfit.DoesNotFitError):
        batchfit.fit(_workload(None), "430MiB", precision="bf16")
    p = batchfit.plan(_workload(None), 4, device="430MiB", precision="bf16", checkpointing=False)
    assert p.remedies[0] == LIGER and sum(p.splits[0]) == 4
    est = batchfit.estimate(_workload("liger"), p.micro_batch_size, device="430MiB", precision="bf16",
                            accumulation_steps=p.accumulation_steps)  # fmt: skip
    assert p.estimate.device_total_bytes == est.device_total_bytes <= 430 << 20
    assert any(w.startswith(f"the plan needs the {LIGER}") for w in p.warnings)


def test_a_fit_without_a_line_probes_where_the_totals_meet_the_budget() -> None:
    """Liger's chunk count follows the batch, so the steps at 2 and 3 items differ and no line is drawn
    (``planning/search.py``, ``_on_traces``). Their totals are equal (one allocator segment), so the next probe
    doubles; the line through 3 and 6 meets the budget past the cap (a plan's share), which fits: four traces,
    where doubling and then bisecting took seven (2, 3, 6, 12, 14, 15, 16)."""
    wl = _workload("liger")
    r = batchfit.fit(wl, "500MiB", precision="bf16", max_batch_size=16)
    assert r.line is None and (r.max_batch_size, r.capped) == (16, True)
    assert [a.batch_size for a in r.attempts] == [2, 3, 6, 16]
    at_16 = batchfit.estimate(wl, 16, device="500MiB", precision="bf16")
    assert r.estimate.device_total_bytes == at_16.device_total_bytes <= r.capacity_bytes


def test_a_fused_loss_offer_checkpoints_the_fewest_blocks_its_step_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ A fused loss beside a plan held back by memory ], with checkpointing the plan's to choose: on a 476 MiB
    GPU the model's own loss needs the first 7 of 8 blocks checkpointed at one item; with the loss fused two items
    fit with the first 6, and the offer is that (fewer blocks recomputed and a larger micro-batch: faster), at the
    memory of that very step (with torch 2.13's allocator, whichever torch is installed: this GPU is so small that
    the allocator's tie order decides)."""
    import transformers

    monkeypatch.setenv("BATCHFIT_ALLOCATOR_TORCH", "2.13")

    from batchfit.sources.fused import with_fused_loss
    from batchfit.sources.hub import workload_from_config

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                      max_position_embeddings=512)  # fmt: skip
    wl = workload_from_config(config, task="causal-lm", seq_len=512)
    p = batchfit.plan(wl, 16, device="476MiB", precision="bf16")
    assert (p.micro_batch_size, p.checkpointed_blocks, p.selective_rest) == (1, 7, False)
    (offer,) = [o for o in p.alternatives if o.remedies[:1] == (LIGER,)]
    assert (offer.micro_batch_size, offer.checkpointed_blocks) == (2, 6) and not offer.selective_rest
    assert offer.predicted_step_s < p.predicted_step_s
    fused = with_fused_loss(wl, "liger")
    at = {k: batchfit.estimate(fused, 2, device="476MiB", precision="bf16", checkpointing=k, accumulation_steps=2)
          for k in (5, 6)}  # fmt: skip
    assert offer.device_total_bytes == at[6].device_total_bytes <= 476 << 20 < at[5].device_total_bytes
