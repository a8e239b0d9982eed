"""Tests of ``batchfit.fit``: the largest micro-batch, exact against the estimator, in a handful of trials.

The fitter's claim is exactness, not closeness: on a modelled device its answer ``b`` satisfies
``estimate(b).device_total_bytes <= capacity < estimate(b + 1).device_total_bytes``. The tests check
that inequality with independent calls to ``batchfit.estimate``, and on a ``SimulatedDevice`` they
check it with real training steps run by a loop written here, not the fitter's own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import torch
from real_steps import two_real_steps_fit

from batchfit import ConfigError, DoesNotFitError, SimulatedDevice, Workload, estimate, get_device, presets
from batchfit.gpu.catalog import Device
from batchfit.planning.fit import FitResult, fit

MLP = presets.get("mlp")
GPT = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
CNN = presets.get("cnn")
WORKLOADS = {"mlp": MLP, "gpt": GPT, "cnn": CNN}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Real steps here are tiny: one thread is as fast, and on a busy machine OpenMP's spinning threads are not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_exact(workload: Workload, result: FitResult, device: str | Device) -> None:
    """``estimate(b) <= capacity < estimate(b + 1)``, with the estimates computed afresh."""
    b = result.max_batch_size
    at_max = estimate(workload, b, device=device, precision=result.precision).device_total_bytes
    past_max = estimate(workload, b + 1, device=device, precision=result.precision).device_total_bytes
    assert at_max <= result.capacity_bytes < past_max, (b, at_max, result.capacity_bytes, past_max)
    # The result reports the estimate at its answer, not at some other batch size.
    assert result.estimate.batch_size == b
    assert result.estimate.device_total_bytes == at_max


def with_total(device: str, total_bytes: int) -> Device:
    """``device`` with exactly ``total_bytes`` of memory, to put the capacity on an estimate's edge."""
    return get_device(device).with_overrides(total_bytes=total_bytes)


# -- exactness against the estimator -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("preset", "device"),
    [("mlp", "1GiB"), ("mlp", "T4"), ("gpt", "1GiB"), ("cnn", "1GiB"), ("cnn", "2GiB")],
)
def test_fit_is_exact_against_the_estimator(preset: str, device: str) -> None:
    workload = WORKLOADS[preset]
    result = fit(workload, device)
    assert result.capacity_bytes == get_device(device).total_bytes
    assert_exact(workload, result, device)
    # Two traces draw the line, two verify the answer: the whole search costs at most four steps.
    assert result.trials <= 4
    assert result.trials == sum(a.kind != "predicted" for a in result.attempts)
    fitting = [a.batch_size for a in result.attempts if a.fits]
    failing = [a.batch_size for a in result.attempts if not a.fits]
    assert max(fitting) == result.max_batch_size
    assert failing == [result.max_batch_size + 1]


def test_fit_is_exact_with_a_margin_and_leaves_it_free() -> None:
    total = get_device("2GiB").total_bytes
    kept = fit(GPT, "2GiB", margin=0.25)
    assert kept.capacity_bytes == int(total * 0.75)
    # Exact against the estimate for a device of that capacity: the allocator model decides at the capacity
    # fit leaves it (releasing its cache there, as the GPU's allocator does at its own).
    assert_exact(GPT, kept, with_total("2GiB", kept.capacity_bytes))
    # The margin cost something: one item more would still fit in the whole device.
    assert estimate(GPT, kept.max_batch_size + 1, device="2GiB").device_total_bytes <= total


@pytest.mark.parametrize("preset", ["mlp", "gpt"])
def test_fit_with_autocast_is_exact_in_four_trials(preset: str) -> None:
    """Autocast frees its cache of low-precision weights in hash order, so the two traces that draw the line
    free the same storages in different orders; the line must still be drawn, or the search falls back to
    tracing at every size it tries."""
    workload = WORKLOADS[preset]
    result = fit(workload, "1GiB", precision="bf16")
    assert result.precision == "bf16"
    assert_exact(workload, result, "1GiB")
    assert result.trials <= 4


@pytest.mark.parametrize("batch_size", [1, 40])
def test_a_capacity_exactly_at_an_estimate_admits_that_batch(batch_size: int) -> None:
    """On the edge (capacity == estimate(b)) the fitter must still say b fits: ``<=``, not ``<``."""
    needed = estimate(GPT, batch_size, device="1GiB").device_total_bytes
    device = with_total("1GiB", needed)
    result = fit(GPT, device)
    assert result.max_batch_size >= batch_size
    assert_exact(GPT, result, device)


def test_a_capacity_below_batch_one_raises_a_one_line_error_naming_the_remedies() -> None:
    needed = estimate(GPT, 1, device="1GiB").device_total_bytes
    with pytest.raises(DoesNotFitError) as info:
        fit(GPT, with_total("1GiB", needed - 1))
    message = str(info.value)
    assert "\n" not in message
    for remedy in ("--precision", "--checkpointing", "--gpus", "larger GPU"):
        assert remedy in message
    # One byte more and batch size 1 fits.
    assert fit(GPT, with_total("1GiB", needed)).max_batch_size >= 1


def _bn_head() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


BN_HEAD = Workload(
    model=_bn_head,
    batch=lambda b: (torch.randn(b, 16), torch.randint(0, 4, (b,))),
    loss=lambda m, xy: torch.nn.functional.cross_entropy(m(xy[0]), xy[1]),
    name="bn-head",
)
"""BatchNorm on (batch, features): a step of one item raises, as it would on a GPU."""


@pytest.mark.parametrize("cap", [None, 2])
def test_a_step_that_cannot_run_on_one_item_and_does_not_fit_on_two_does_not_fit(cap: int | None) -> None:
    # Not the trace's error about one item: the batch does not fit, and the message says both.
    needed = estimate(BN_HEAD, 2, device="1GiB").device_total_bytes
    why = "even at batch size 2 .*a step of one item cannot run: .*value per channel"
    with pytest.raises(DoesNotFitError, match=why):
        fit(BN_HEAD, with_total("1GiB", needed - 1), max_batch_size=cap)
    assert fit(BN_HEAD, with_total("1GiB", needed), max_batch_size=cap).max_batch_size >= 2


def test_a_plan_moves_on_to_its_next_configuration_when_one_item_cannot_run() -> None:
    import dataclasses

    import batchfit

    def wide() -> torch.nn.Module:  # 8M parameters: bf16 weights and states save 64 MiB
        return torch.nn.Sequential(torch.nn.Linear(16, 4096), torch.nn.BatchNorm1d(4096), torch.nn.Linear(4096, 2048))

    wl = dataclasses.replace(BN_HEAD, model=wide, loss=lambda m, xy: m(xy[0]).float().pow(2).mean())
    device = with_total("1GiB", estimate(wl, 2, device="1GiB").device_total_bytes - 1)
    p = batchfit.plan(wl, 8, device=device)
    assert p.precision == "bf16-true" and p.micro_batch_size >= 2
    assert p.estimate.device_total_bytes <= device.total_bytes


def test_the_remedies_named_on_a_gpu_without_bf16_are_ones_it_supports() -> None:
    t4 = get_device("T4")
    needed = estimate(GPT, 1, device=t4).device_total_bytes
    with pytest.raises(DoesNotFitError) as info:
        fit(GPT, t4.with_overrides(total_bytes=needed - 1))
    assert "fp16" in str(info.value)
    assert "bf16" not in str(info.value)


# -- the simulated device: real steps ---------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["mlp", "gpt", "cnn"])
def test_fit_on_a_simulated_device_agrees_with_real_steps_and_with_the_trace(preset: str) -> None:
    workload = WORKLOADS[preset]
    capacity = "32MiB"  # small batches keep the real steps cheap: 4,096 MLP rows, 25 sequences, 8 images
    result = fit(workload, SimulatedDevice(capacity))
    b = result.max_batch_size
    assert result.trials <= 4
    assert [a.kind for a in result.attempts][-2:] == ["real", "real"]  # verified by running, not by tracing
    # A traced device whose allocator may reserve the same bytes (no CUDA context on top) agrees.
    reserved = SimulatedDevice(capacity).capacity_bytes
    same_allocator = get_device("1GiB").with_overrides(total_bytes=reserved, context_bytes=0)
    assert fit(workload, same_allocator).max_batch_size == b
    # And two real steps, run here, fit at the answer and run out of memory one item later.
    assert two_real_steps_fit(workload, b, capacity)
    assert not two_real_steps_fit(workload, b + 1, capacity)


def test_the_traced_answer_is_the_largest_that_runs_even_when_the_allocator_must_release_its_cache() -> None:
    capacity = "192MiB"
    reserved = SimulatedDevice(capacity).capacity_bytes
    same_allocator = get_device("1GiB").with_overrides(total_bytes=reserved, context_bytes=0)
    b = fit(MLP, same_allocator).max_batch_size
    assert two_real_steps_fit(MLP, b, capacity)
    assert not two_real_steps_fit(MLP, b + 1, capacity)


def test_a_simulated_device_too_small_for_one_item_raises() -> None:
    """The two cuBLAS workspaces alone (2 x 8,519,680 B) exceed 8 MiB: nothing can run."""
    with pytest.raises(DoesNotFitError, match="even at batch size 1"):
        fit(GPT, SimulatedDevice("8MiB"))


# -- bad input and the result's shape ---------------------------------------------------------------------
def test_a_device_without_capacity_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        fit(MLP, "cpu")
    assert "\n" not in str(info.value)
    assert "--device" in str(info.value)


@pytest.mark.parametrize("margin", [-0.1, 1.0, 1.5])
def test_a_margin_outside_zero_to_one_is_a_config_error(margin: float) -> None:
    with pytest.raises(ConfigError, match="margin"):
        fit(MLP, "1GiB", margin=margin)


def test_fit_result_to_dict_is_json() -> None:
    result = fit(MLP, "1GiB")
    d = json.loads(json.dumps(result.to_dict()))
    assert d["max_batch_size"] == result.max_batch_size
    assert d["trials"] == result.trials
    assert d["capacity_bytes"] == result.capacity_bytes
    assert d["estimate"]["batch_size"] == result.max_batch_size
    assert [a["batch_size"] for a in d["attempts"]] == [a.batch_size for a in result.attempts]


def test_a_plan_where_nothing_fits_and_one_item_cannot_run_says_two_items() -> None:
    import batchfit

    # More than two items' worth of memory in any configuration the plan has: nothing fits.
    device = with_total("1GiB", estimate(BN_HEAD, 2, device="1GiB", precision="bf16-true").device_total_bytes - 1)
    with pytest.raises(DoesNotFitError) as info:
        batchfit.plan(BN_HEAD, 8, device=device)
    message = str(info.value)
    assert "\n" not in message
    why = r"even with two items per GPU \(tried: .*; a step of one item cannot run: .*value per channel"
    assert re.search(why, message), message
    gpt_device = with_total("1GiB", estimate(GPT, 1, device="1GiB", precision="bf16-true").device_total_bytes - 1)
    with pytest.raises(DoesNotFitError) as info:
        batchfit.plan(GPT, 8, device=gpt_device)
    assert "even with one item per GPU" in str(info.value) and "cannot run" not in str(info.value)
