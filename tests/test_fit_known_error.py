"""fit's decision on a modelled GPU: the measured error of a model's family kept free, and expandable
segments offered where the allocator's fragmentation, not the tensors, stops the next batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchfit
from batchfit import Workload
from batchfit.gpu.catalog import get_device
from batchfit.memory.estimate import trace_for_device
from batchfit.planning.known_error import KNOWN_ERRORS, families, known_error_for
from batchfit.precision import policy_for
from batchfit.runtime.simulated import SimulatedDevice


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class Convolutional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


@pytest.fixture(autouse=True)
def _measured_errors_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user has it (the suite turns it off elsewhere: ``conftest.py``)."""
    monkeypatch.setenv("BATCHFIT_KNOWN_ERRORS", "1")


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


RNN = Workload(model=Recurrent, batch=lambda b: (torch.randn(b, 12, 16), torch.randint(0, 4, (b,))), loss=_ce,
               name="rnn")  # fmt: skip
CNN = Workload(model=Convolutional, batch=lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 4, (b,))), loss=_ce,
               name="cnn")  # fmt: skip
MLP = Workload(model=lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)),
               batch=lambda b: (torch.randn(b, 16), torch.randint(0, 4, (b,))), loss=_ce, name="mlp")  # fmt: skip


def _trace(wl: Workload):
    dev = get_device("A100-40GB")
    return trace_for_device(wl, 2, dev, policy_for("fp32", device_name=dev.name), ())


def test_a_step_is_placed_in_a_family_by_the_kernels_it_runs() -> None:
    assert families(_trace(RNN)) == {"recurrent"}
    assert families(_trace(CNN)) == {"convolutional"}
    assert families(_trace(MLP)) == set()  # a cross-entropy's log_softmax is not attention
    assert families(_trace(batchfit.presets.get("gpt", n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                seq_len=16))) == {"attention"}  # fmt: skip
    assert known_error_for(_trace(RNN)) is KNOWN_ERRORS["recurrent"]
    assert known_error_for(_trace(MLP)) is None


def test_a_step_training_adapters_is_its_own_family() -> None:
    """LoRA on a transformer: attention kernels, but the adapters' measured rows decide (none was low)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from zoo import BY_NAME

    trace = _trace(BY_NAME["lora-llama"].make())
    assert families(trace) == {"attention", "adapters"}
    assert known_error_for(trace) is None


@pytest.mark.parametrize(("wl", "family"), [(RNN, "recurrent"), (CNN, "convolutional")])
def test_fit_keeps_the_family_error_free_and_says_why(wl: Workload, family: str, monkeypatch) -> None:
    known, total = KNOWN_ERRORS[family], get_device("1GiB").total_bytes
    r = batchfit.fit(wl, "1GiB")
    kept = int(total * known.fraction)
    assert (r.known_error_bytes, r.capacity_bytes) == (kept, total - kept)
    assert r.known_error == known.describe(kept) and known.evidence in r.known_error
    budget = get_device("1GiB").with_overrides(total_bytes=r.capacity_bytes)  # the device less what is kept
    assert r.estimate.device_total_bytes <= r.capacity_bytes
    assert not batchfit.estimate(wl, r.max_batch_size + 1, device=budget).fits
    assert r.to_dict()["known_error_bytes"] == kept
    assert batchfit.fit(wl, "1GiB", known_error=False).max_batch_size > r.max_batch_size
    monkeypatch.setenv("BATCHFIT_KNOWN_ERRORS", "0")
    assert batchfit.fit(wl, "1GiB").known_error is None


def test_a_plan_follows_the_switch_of_the_measured_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's configurations are kept with the traces: one fitted with the measured errors kept free is not the
    answer once ``BATCHFIT_KNOWN_ERRORS=0`` turns them off (nor the other way), in one process with one cache."""
    kept = batchfit.plan(CNN, 65536, device="1GiB", precision="fp32", checkpointing=False)
    monkeypatch.setenv("BATCHFIT_KNOWN_ERRORS", "0")
    alone = batchfit.plan(CNN, 65536, device="1GiB", precision="fp32", checkpointing=False)
    assert alone.max_micro_batch_size > kept.max_micro_batch_size
    (why,) = [w for w in kept.warnings if w.startswith("kept")] or [None]
    assert why is not None and not any(w.startswith("kept") for w in alone.warnings)


def test_a_family_without_a_measured_error_and_a_verified_fit_keep_nothing() -> None:
    mlp = batchfit.fit(MLP, "1GiB")
    assert (mlp.known_error, mlp.known_error_bytes, mlp.capacity_bytes) == (None, 0, get_device("1GiB").total_bytes)
    sim = SimulatedDevice(64 * 2**20, policy=policy_for("fp32"))  # real steps verify: nothing to keep
    assert batchfit.fit(RNN, sim, max_batch_size=64).known_error is None


def test_expandable_segments_are_offered_where_fragmentation_stops_the_next_batch() -> None:
    wl = batchfit.presets.get("mlp")
    r = batchfit.fit(wl, "2GiB")
    assert r.expandable_max_batch_size is not None and r.expandable_max_batch_size > r.max_batch_size
    mapped = batchfit.fit(wl, "2GiB", expandable_segments=True)  # traced at the answer and the next batch
    assert mapped.max_batch_size == r.expandable_max_batch_size and mapped.expandable_max_batch_size is None
    # the tensors themselves stop the next batch: nothing to offer
    alive = batchfit.estimate(wl, r.expandable_max_batch_size + 1, device="2GiB", expandable_segments=True)
    assert alive.device_total_bytes > r.capacity_bytes


def test_a_plan_that_accumulates_names_the_free_remedy_and_ranks_it() -> None:
    import re

    wl = batchfit.presets.get("mlp")
    r = batchfit.fit(wl, "2GiB", precision="fp32")
    p = batchfit.plan(wl, 3 * r.max_batch_size, device="2GiB", precision="fp32", checkpointing=False)
    assert p.accumulation_steps > 1
    (advice,) = [w for w in p.warnings if "expandable_segments" in w]
    larger = int(re.search(r"micro-batch (\d+) fits instead of (\d+)", advice).group(1))
    assert f"instead of {p.max_micro_batch_size} (predicted)" in advice and larger > p.max_micro_batch_size
    # with gradients alive through the later micro-batches, as the plan runs it
    est = batchfit.estimate(wl, larger, device="2GiB", precision="fp32", accumulation_steps=p.accumulation_steps,
                            expandable_segments=True)  # fmt: skip
    assert est.device_total_bytes <= r.capacity_bytes
    setting = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert not [o for o in p.alternatives if setting in o.remedies]  # 3 micro-batches either way: no option
    # where it cuts the micro-batches per step: ranked with the other options by its time
    q = batchfit.plan(wl, 2 * larger, device="2GiB", precision="fp32", checkpointing=False)
    (option,) = [o for o in q.alternatives if setting in o.remedies]
    assert (option.max_micro_batch_size, option.remedies) == (larger, (*q.remedies, setting))
    assert (option.accumulation_steps, q.accumulation_steps) == (2, 3)
    assert option.predicted_step_s < q.predicted_step_s
