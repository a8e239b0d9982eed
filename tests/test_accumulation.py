"""An accumulating step's trace written from the plain step's (``memory/synthesis/accumulation.py``) is the trace
of the accumulating step itself: event for event, with every storage's bytes, role, module and op."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from trace_compare import canonical

import batchfit
from batchfit import presets
from batchfit.gpu.catalog import get_device
from batchfit.memory.cache import CACHE
from batchfit.memory.categories import Category
from batchfit.memory.estimate import _trace_for_device, finish_estimate, trace_for_device, with_accumulation
from batchfit.memory.synthesis.accumulation import accumulating_trace
from batchfit.precision import policy_for
from batchfit.sources import as_workload

A100 = get_device("A100-80GB")
V100 = get_device("V100-16GB")
GPT = presets.get("gpt", n_layer=2, n_embd=64, n_head=4, vocab_size=256, seq_len=32)


def _traces(wl: Any, device: Any = A100, precision: str = "fp32", checkpointing: bool = False) -> tuple:
    policy = policy_for(precision, bf16_supported=device.bf16, device_name=device.name)
    classes = wl.checkpoint_blocks if checkpointing else ()
    _trace_for_device(wl, 2, device, policy, classes)  # torch's dispatch cache warm, as for the others
    plain = _trace_for_device(wl, 2, device, policy, classes)
    real = _trace_for_device(with_accumulation(wl, 2), 2, device, policy, classes)
    return plain, real, policy, classes


CASES = {
    "gpt": dict(wl=GPT),
    "gpt bf16 autocast, checkpointed": dict(wl=GPT, precision="bf16", checkpointing=True),
    "gpt fp16 with a grad scaler on a V100": dict(wl=GPT, device=V100, precision="fp16"),
    "gpt bf16 weights and states": dict(wl=GPT, precision="bf16-true"),
    "gpt, gradients kept by zero_grad": dict(wl=dataclasses.replace(GPT, set_grads_to_none=False)),
    "cnn with BatchNorm, bf16": dict(wl=presets.get("cnn", image_size=16, width=8), precision="bf16"),
    "mlp": dict(wl=presets.get("mlp")),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_written_trace_is_the_traced_one(case: str) -> None:
    plain, real, policy, classes = _traces(**CASES[case])
    written = accumulating_trace(plain)
    assert written is not None
    assert canonical(written) == canonical(real)
    # Micro-batch 2's backward outputs are temporaries (added into the .grad), not gradients.
    roles = [written.role[e] for e in written.events if e >= 0]
    assert roles.count(Category.GRADIENTS) == [real.role[e] for e in real.events if e >= 0].count(Category.GRADIENTS)
    wl = CASES[case]["wl"]
    device = CASES[case].get("device", A100)
    accumulating = with_accumulation(wl, 2)
    ours = finish_estimate(written, accumulating, 2, device, policy, classes)
    traced = finish_estimate(real, accumulating, 2, device, policy, classes)
    assert ours.device_total_bytes == traced.device_total_bytes
    assert ours.peak_allocated_bytes == traced.peak_allocated_bytes


ZOO_CASES = [
    # One of each family and of each trait the writing reads: tied weights (gpt2), grouped attention,
    # experts, a state-space scan, encoder-decoders, BatchNorm, a per-resolution cache made in the first
    # forward (beit), recurrent and packed sequences, conv 1-3d, a bag, a lazy layer, a late buffer,
    # adapters (frozen bases, a prefix).
    "gpt2", "llama-gqa", "mixtral-moe", "mamba-ssm", "t5", "bert", "resnet", "efficientnet", "beit-relpos",
    "whisper", "lstm-bi", "lstm-packed", "convs-1d-2d-3d", "embedding-bag", "lazy-mlp", "late-buffer",
    "lora-llama", "prefix-tuning-gpt2",
]  # fmt: skip


@pytest.mark.parametrize("name", ZOO_CASES)
def test_the_written_trace_is_the_traced_one_across_the_zoo(name: str) -> None:
    """Models whose sizes do not depend on the batch's values: a model routing tokens by their ids has
    sizes of the batches drawn, and a written micro-batch repeats the plain step's second batch."""
    from zoo import BY_NAME

    plain, real, _, _ = _traces(as_workload(BY_NAME[name].make()))
    written = accumulating_trace(plain)
    assert written is not None
    assert canonical(written) == canonical(real)


def test_an_accumulating_estimate_traces_nothing_beyond_the_plain_step() -> None:
    wl = presets.get("gpt", n_layer=1, n_embd=32, n_head=2, vocab_size=97, seq_len=16)  # this test's own
    batchfit.estimate(wl, 3, device="A100-80GB")
    before = CACHE.misses
    est = batchfit.estimate(wl, 3, device="A100-80GB", accumulation_steps=4)
    assert CACHE.misses == before
    assert est.accumulation_steps == 4
    # What a real trace of the accumulating step gives.
    policy = policy_for("fp32", bf16_supported=True, device_name=A100.name)
    real = _trace_for_device(with_accumulation(wl, 2), 3, A100, policy, ())
    traced = finish_estimate(real, with_accumulation(wl, 4), 3, A100, policy, ())
    assert (est.peak_allocated_bytes, est.device_total_bytes) == (
        traced.peak_allocated_bytes,
        traced.device_total_bytes,
    )


def test_a_lifetime_it_does_not_model_leaves_the_step_to_a_real_trace() -> None:
    plain, _, _, _ = _traces(GPT)
    assert accumulating_trace(plain) is not None
    # A storage of the second micro-batch freed by the optimizer: not one of the lifetimes modelled.
    optimizer = next(i for i, name, step in plain.phases if (name, step) == ("optimizer", 1))
    start = next(i for i, name, step in plain.phases if (name, step) == ("batch", 1))
    kept = next(e for e in plain.events[start:optimizer] if e >= 0 and ~e in plain.events[start:optimizer])
    events = [e for e in plain.events if e != ~kept]
    events.insert(optimizer, ~kept)
    assert accumulating_trace(dataclasses.replace(plain, events=events)) is None
    # Phases of a trace that is not two plain steps.
    assert accumulating_trace(dataclasses.replace(plain, phases=plain.phases[:-1])) is None
    # A gradient that is not one dense storage (a sparse one: its accumulation makes new storages).
    index, _, copied, made_in = plain.grads[0]
    assert (
        accumulating_trace(dataclasses.replace(plain, grads=[(index, None, copied, made_in), *plain.grads[1:]])) is None
    )


class _ConcatenatedParameter(torch.nn.Module):
    """A learned row concatenated with activations: backward hands the parameter a view of the
    concatenation's gradient, which lives as long as the other branch needs its part."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Parameter(torch.zeros(1, 64))
        self.body = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.extra, self.body(x)], 0)
        return self.head(torch.tanh(h))[1:]


def test_a_gradient_kept_as_a_view_of_a_larger_buffer_is_traced_for_real() -> None:
    wl = batchfit.Workload(
        model=_ConcatenatedParameter,
        batch=lambda b: (torch.randn(b, 64), torch.randint(0, 3, (b,))),
        loss=lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1]),
    )
    plain, real, policy, _ = _traces(wl)
    assert accumulating_trace(plain) is None
    traced = trace_for_device(with_accumulation(wl, 2), 2, A100, policy, ())
    assert canonical(traced) == canonical(real)
