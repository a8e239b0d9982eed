"""The time model that ranks a plan's configurations (``batchfit.planning.cost``), on cases whose order is known."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import batchfit
from batchfit import presets
from batchfit.errors import ConfigError, TraceError
from batchfit.gpu.catalog import get_device
from batchfit.memory.estimate import trace_for_device
from batchfit.memory.states import state_bytes
from batchfit.planning.cost import Interconnect, link_gbps, predict_step_time, step_traffic
from batchfit.precision import policy_for

GPT = presets.get("gpt", n_layer=2, n_embd=256, n_head=4, vocab_size=512, seq_len=256)
A100 = get_device("A100-40GB")


def _trace(wl: batchfit.Workload, b: int, precision: str = "fp32", checkpointing: bool = False):  # noqa: ANN202
    classes = wl.checkpoint_blocks if checkpointing else ()
    return trace_for_device(wl, b, A100, policy_for(precision), classes)


def _time(precision: str = "fp32", checkpointing: bool = False, micro: int = 4, micro_batches: int = 2, **kw) -> float:
    states = state_bytes(GPT, policy_for(precision).param_dtype).as_tuple()
    trace = _trace(GPT, micro, precision, checkpointing)
    return predict_step_time(trace, A100, precision=precision, micro_batches=micro_batches, state_bytes=states,
                             **kw).total_s  # fmt: skip


def test_flops_are_what_torch_flop_counter_counts() -> None:
    """The trace counts FLOPs with torch's own formulas: equal to FlopCounterMode on the same step."""
    from torch.utils.flop_counter import FlopCounterMode

    wl = presets.get("cnn", image_size=16, width=8, stages=2, blocks=1)
    trace = trace_for_device(wl, 4, get_device("cpu"), policy_for("fp32"), ())
    traced = trace.flops[("forward", 1)] + trace.flops[("backward", 1)]
    torch.manual_seed(0)
    model = wl.build_model()
    counter = FlopCounterMode(display=False)
    with counter:
        loss = wl.loss(model, wl.batch(4))
        loss.backward()
    assert traced == counter.get_total_flops() > 0


def test_checkpointing_costs_time_at_equal_micro_batches() -> None:
    plain, recomputed = _time(checkpointing=False), _time(checkpointing=True)
    flops_plain = step_traffic(_trace(GPT, 4))[0]
    flops_ckpt = step_traffic(_trace(GPT, 4, checkpointing=True))[0]
    assert flops_ckpt > flops_plain  # the recomputed forward is counted
    assert recomputed > plain


def test_an_accumulating_trace_predicts_the_time_of_its_micro_batches_not_twice_that() -> None:
    """A plan fits a share of several micro-batches on a trace of the accumulating step (two
    micro-batches per optimizer step); the time model counts one micro-batch's work from it."""
    from batchfit.memory.estimate import with_accumulation

    plain = step_traffic(_trace(GPT, 4))
    accumulating = step_traffic(_trace(with_accumulation(GPT, 2), 4))
    assert accumulating == plain and plain[0] > 0


def test_autocast_is_faster_than_fp32_on_tensor_cores() -> None:
    assert _time("bf16") < _time("fp32")


def test_more_micro_batches_take_longer() -> None:
    assert _time(micro_batches=4) > _time(micro_batches=2)


def _step(gpus: int, sharded: bool, state: int, micro_batches: int = 2, interconnect: str = "nvlink"):  # noqa: ANN202
    """The predicted step of GPT's trace at 4 items with ``state`` bytes each of parameters and gradients."""
    trace = _trace(GPT, 4)
    return predict_step_time(trace, A100, precision="fp32", micro_batches=micro_batches, gpus=gpus, sharded=sharded,
                             interconnect=interconnect, state_bytes=(state, state, 2 * state))  # fmt: skip


def test_data_parallel_communication_hides_behind_the_compute_it_runs_beside() -> None:
    """NOTE [ Communication behind compute ]: a few kB of gradients cross the link while the backward runs,
    sharded or not, and cost nothing; gigabytes outlast it."""
    for sharded in (False, True):
        assert _step(8, sharded, 4096).communication_s == 0.0
        assert _step(8, sharded, 4 << 30).communication_s > 0.0


def test_fsdp_pays_per_micro_batch_what_its_gathers_and_reduce_scatter_outlast() -> None:
    """Parameters far larger than the step's work: each micro-batch pays two gathers and a reduce-scatter of
    (n - 1) / n of them, less its own forward and backward, which they ran beside."""
    state, link = 4 << 30, link_gbps(A100, "nvlink") * 1e9
    for micro_batches in (2, 4):
        t = _step(8, True, state, micro_batches)
        one_micro_batch = (t.compute_s + t.memory_s) / micro_batches
        expected = micro_batches * (3 * 7 / 8 * state / link - one_micro_batch)
        assert t.communication_s == pytest.approx(expected, rel=1e-12)
    assert _step(8, True, state, interconnect="pcie").communication_s > _step(8, True, state).communication_s


def test_ddp_all_reduces_once_per_optimizer_step_behind_the_last_backward() -> None:
    state = 4 << 30
    two, four = _step(8, False, state, 2), _step(8, False, state, 4)
    assert two.communication_s == four.communication_s > 0  # not per micro-batch
    assert two.communication_s < 2 * 7 / 8 * state / (link_gbps(A100, "nvlink") * 1e9)  # the backward hid some
    assert _step(8, False, state, interconnect="pcie").communication_s > two.communication_s


def test_data_parallel_communication_grows_with_the_gpu_count_share() -> None:
    state = 4 << 30
    assert _step(1, False, state).communication_s == 0.0
    assert _step(8, False, state).communication_s > _step(2, False, state).communication_s > 0  # (n - 1) / n


def test_interconnects_by_generation_and_bad_names() -> None:
    assert link_gbps(get_device("H100-80GB"), "nvlink") > link_gbps(A100, "nvlink") > link_gbps(A100, "pcie")
    assert link_gbps(A100, Interconnect.ib) == 25.0
    with pytest.raises(ConfigError, match="nvlink, pcie or ib"):
        link_gbps(A100, "ethernet")
    with pytest.raises(ConfigError, match="nvlink, pcie or ib"):
        batchfit.plan(GPT, 8, device="A100-40GB", interconnect="ethernet")


def test_state_bytes_are_exact() -> None:
    wl = presets.get("mlp")
    n = sum(p.numel() for p in wl.build_model().parameters())
    adamw = state_bytes(wl, None)
    assert (adamw.parameters, adamw.gradients) == (4 * n, 4 * n)
    assert adamw.optimizer_states == 2 * 4 * n + 4 * len(list(wl.build_model().parameters()))  # + fp32 steps
    sgd = state_bytes(presets.get("mlp", optimizer="sgd"), None)
    assert sgd.optimizer_states == 4 * n  # one momentum buffer
    assert state_bytes(wl, torch.bfloat16).parameters == 2 * n


def test_state_bytes_of_lazy_modules_are_those_of_the_materialised_model() -> None:
    """Lazy layers get their shapes from a first batch: the state count runs it, as a trace does (and a
    plan's lower bound on such a model does not crash on the uninitialised parameters)."""
    from torch import nn

    from batchfit import Workload

    def model() -> nn.Module:
        return nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.LazyLinear(5))

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 24), torch.randint(0, 5, (b,))

    def loss(m: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(xy[0]), xy[1])

    wl = Workload(model=model, batch=batch, loss=loss, name="lazy")
    real = model()
    real(torch.randn(1, 24))
    n = sum(p.numel() for p in real.parameters())  # 24*64 + 64 + 64*5 + 5
    states = state_bytes(wl, None)
    assert (states.parameters, states.gradients, states.optimizer_states) == (4 * n, 4 * n, 2 * 4 * n + 4 * 4)
    p = batchfit.plan(wl, 8, device="A100-80GB", gpus=2)
    assert (p.micro_batch_size, p.accumulation_steps, p.gpus) == (4, 1, 2)
    # An optimizer that cannot step as a training loop steps it: one clear error, not its traceback.
    lbfgs = dataclasses.replace(wl, optimizer=lambda params: torch.optim.LBFGS(params))
    with pytest.raises(TraceError, match="optimizer's step on zero gradients: TypeError"):
        state_bytes(lbfgs, None)


def test_a_model_too_large_for_one_gpu_is_sharded_with_fp32_master_weights() -> None:
    """What the 7B plan on 8 GPUs must do: keep fp32 weights and states, sharded, when that fits."""
    wl = presets.get("gpt", n_layer=4, n_embd=1024, n_head=8, vocab_size=8192, seq_len=64)  # ~1 GB of state
    total = state_bytes(wl, None).total
    device = dataclasses.replace(A100, name="small", total_bytes=A100.context_bytes + int(0.6 * total))
    p = batchfit.plan(wl, 16, device=device, gpus=8)
    assert (p.precision, p.sharded) == ("fp32", True)  # no autocast needed, no bf16 weights
    assert not p.changes_numerics and p.remedies == ("FSDP sharding",)
    assert p.estimate.device_total_bytes <= device.total_bytes
