"""cuDNN convolution workspaces (``memory/kernels/cudnn.py``): one test per rule of its NOTE, with exact bytes.

The traced tests run tiny convolution models through ``trace_for_device`` as ``estimate`` does; the
selection rules (which convolutions reach cuDNN) are checked on meta tensors, which cost nothing even
at the sizes that need 64-bit indexing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchfit
from batchfit import Workload
from batchfit.gpu.catalog import ConvWorkspace, get_device
from batchfit.memory.estimate import trace_for_device
from batchfit.memory.kernels import cudnn
from batchfit.memory.kernels.cudnn import BACKWARD_DATA, BACKWARD_FILTER, FORWARD, CudnnFlags, workspaces
from batchfit.memory.trace.fake_step import MemoryTrace
from batchfit.precision import policy_for

F32 = 4
HEUR, BENCH = cudnn.HEURISTIC_WORKSPACE, cudnn.BENCHMARK_WORKSPACE
ON = CudnnFlags()


def _trace(workload: Workload, device: str = "A100-40GB", batch: int = 2, **device_fields) -> MemoryTrace:
    import dataclasses

    dev = dataclasses.replace(get_device(device), **device_fields)
    policy = policy_for("fp32", bf16_supported=dev.bf16 or dev.exact, device_name=dev.name)
    return trace_for_device(workload, batch, dev, policy, ())


def _phase(t: MemoryTrace, phase: str, step: int = 1) -> tuple[int, int]:
    start = next(i for i, p, s in t.phases if (p, s) == (phase, step))
    later = [i for i, _, _ in t.phases if i > start]
    return start, min(later) if later else len(t.events)


def _conv_scratch(t: MemoryTrace, phase: str) -> list[tuple[str, int]]:
    """``(direction, bytes)`` of every cuDNN workspace allocated in ``phase`` of the second step, in order."""
    start, end = _phase(t, phase)
    out = []
    for e in t.events[start:end]:
        if e >= 0 and t.op[e].startswith("cuDNN workspace"):
            out.append((t.op[e].removeprefix("cuDNN workspace (").removesuffix(")"), t.nbytes[e]))
    return out


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def _workload(*layers: nn.Module, shape: tuple[int, ...]) -> Workload:
    return Workload(model=lambda: nn.Sequential(*layers), batch=lambda b: torch.randn(b, *shape), loss=_loss)


# conv1: x (2,4,16,16) 8192 B, w (8,4,3,3) 1152 B, y (2,8,16,16) 16384 B; conv2: 8->8, w 2304 B.
CONV1 = 8192 + 1152 + 16384
CONV2 = 16384 + 2304 + 16384


def _two_convs() -> Workload:
    return _workload(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                     shape=(4, 16, 16))  # fmt: skip


# -- 2 and 4: engines per direction, heuristic sizes ------------------------------------------------
def test_each_convolution_call_gets_a_workspace_of_its_operands() -> None:
    t = _trace(_two_convs())
    assert _conv_scratch(t, "forward") == [(FORWARD, CONV1), (FORWARD, CONV2)]
    # Backward runs conv2 first: the input's gradient (backward data), then the weight's (backward
    # filter); conv1's input is the batch, which needs no gradient: only backward filter.
    assert _conv_scratch(t, "backward") == [(BACKWARD_DATA, CONV2), (BACKWARD_FILTER, CONV2), (BACKWARD_FILTER, CONV1)]


def test_the_cpu_trace_has_no_cudnn_workspace() -> None:
    t = _trace(_two_convs(), device="cpu")
    assert not any(op.startswith("cuDNN") for op in t.op.values())


# -- 3: transient, right after the op's outputs ------------------------------------------------------
def test_a_workspace_is_freed_at_once_after_the_output_is_made() -> None:
    t = _trace(_two_convs())
    start, end = _phase(t, "forward")
    events = t.events[start:end]
    for i, e in enumerate(events):
        if e >= 0 and t.op[e].startswith("cuDNN workspace"):
            assert events[i + 1] == ~e  # freed before anything else happens
            assert t.op[events[i - 1]] == "aten.convolution.default"  # allocated after the output


def test_the_estimate_reports_the_largest_workspace_and_counts_it_in_the_peak() -> None:
    wl = _two_convs()
    est = batchfit.estimate(wl, 2, device="A100-40GB")
    assert est.cudnn_workspace_bytes == 35328  # CONV2 = 35072 B, rounded up to the allocator's 512 B
    with torch.backends.cudnn.flags(enabled=False):
        without = batchfit.estimate(wl, 2, device="A100-40GB")
    assert without.cudnn_workspace_bytes == 0
    assert est.peak_allocated_bytes > without.peak_allocated_bytes


# -- 4a: pointwise convolutions are one GEMM per image ------------------------------------------------
def test_a_pointwise_convolution_takes_no_workspace_but_for_its_weights_gradient() -> None:
    # conv1 as above, then a 1x1 8->8: x (2,8,16,16) 16384 B, w 256 B, y 16384 B.
    wl = _workload(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.Conv2d(8, 8, 1, bias=False), shape=(4, 16, 16))
    pointwise = 16384 + 256 + 16384
    t = _trace(wl)
    assert _conv_scratch(t, "forward") == [(FORWARD, CONV1)]
    assert _conv_scratch(t, "backward") == [(BACKWARD_FILTER, pointwise), (BACKWARD_FILTER, CONV1)]


def test_only_a_plain_1x1_convolution_counts_as_pointwise() -> None:
    x, w = _meta(8, 16, 32, 32), _meta(32, 16, 1, 1)
    operands = (8 * 16 * 32 * 32 + 32 * 16 + 8 * 32 * 32 * 32) * F32
    assert _forward(x, w) == [cudnn.ConvCall(FORWARD, 0)]
    assert _forward(x, _meta(16, 16, 1, 1)) == [cudnn.ConvCall(FORWARD, 0)]
    strided = (8 * 16 * 32 * 32 + 32 * 16 + 8 * 32 * 16 * 16) * F32
    assert _forward(x, w, stride=2) == [cudnn.ConvCall(FORWARD, strided)]  # a strided gather: not one GEMM
    padded = (8 * 16 * 32 * 32 + 32 * 16 + 8 * 32 * 34 * 34) * F32
    assert _forward(x, w, padding=1) == [cudnn.ConvCall(FORWARD, padded)]
    grouped = (8 * 16 * 32 * 32 + 32 * 8 + 8 * 32 * 32 * 32) * F32
    assert _forward(x, _meta(32, 8, 1, 1), groups=2) == [cudnn.ConvCall(FORWARD, grouped)]
    assert _forward(_meta(8, 16, 32, 32, channels_last=True), w) == [cudnn.ConvCall(FORWARD, operands)]
    assert _forward(x, w, flags=CudnnFlags(benchmark=True)) == [
        cudnn.ConvCall(FORWARD, cudnn.workspace_bytes(FORWARD, operands, HEUR))
    ]  # the ratios passed in: benchmark mode times every engine, and the fastest may transpose
    assert _forward(_meta(8, 16, 100), _meta(32, 16, 1)) == [cudnn.ConvCall(FORWARD, 0)]  # 1-d as well


# -- transposed convolutions ------------------------------------------------------------------------
def test_a_transposed_convolution_runs_the_backward_data_engine_forward() -> None:
    # conv (2,4,8,8) -> convT 4->8, kernel 2, stride 2: x 2048 B, w (4,8,2,2) 512 B, y (2,8,16,16) 16384 B.
    wl = _workload(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.ConvTranspose2d(4, 8, 2, stride=2, bias=False),
                   shape=(4, 8, 8))  # fmt: skip
    conv, convt = 2048 + 576 + 2048, 2048 + 512 + 16384
    t = _trace(wl)
    assert _conv_scratch(t, "forward") == [(FORWARD, conv), (BACKWARD_DATA, convt)]
    assert _conv_scratch(t, "backward") == [(FORWARD, convt), (BACKWARD_FILTER, convt), (BACKWARD_FILTER, conv)]


# -- 5: benchmark ------------------------------------------------------------------------------------
def test_benchmark_assumes_twice_the_operands() -> None:
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False):
        t = _trace(_two_convs())
    assert _conv_scratch(t, "forward") == [(FORWARD, 2 * CONV1), (FORWARD, 2 * CONV2)]
    t = _trace(_two_convs(), cudnn_benchmark=True)  # --cudnn-benchmark marks the device instead
    assert _conv_scratch(t, "forward") == [(FORWARD, 2 * CONV1), (FORWARD, 2 * CONV2)]


# -- measured ratios from a device profile --------------------------------------------------------------
def test_a_profiles_measured_ratios_replace_the_assumption() -> None:
    measured = ConvWorkspace(forward=0.25, backward_data=0.5, backward_filter=0.0)
    t = _trace(_two_convs(), conv_workspace=measured, conv_workspace_benchmark=ConvWorkspace(3.0, 3.0, 3.0))
    assert _conv_scratch(t, "forward") == [(FORWARD, CONV1 // 4), (FORWARD, CONV2 // 4)]
    assert _conv_scratch(t, "backward") == [(BACKWARD_DATA, CONV2 // 2)]  # a measured 0 adds nothing
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False):
        t = _trace(_two_convs(), conv_workspace=measured, conv_workspace_benchmark=ConvWorkspace(3.0, 3.0, 3.0))
    assert _conv_scratch(t, "forward") == [(FORWARD, 3 * CONV1), (FORWARD, 3 * CONV2)]


def test_workspace_bytes_round_up() -> None:
    assert cudnn.workspace_bytes(FORWARD, 10, ConvWorkspace(0.15, 0.0, 0.0)) == 2


# -- 1: which convolutions reach cuDNN -------------------------------------------------------------------
def _meta(*shape: int, dtype: torch.dtype = torch.float32, channels_last: bool = False) -> torch.Tensor:
    t = torch.empty(shape, device="meta", dtype=dtype)
    if channels_last:
        t = t.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    return t


def _forward(x: torch.Tensor, w: torch.Tensor, *, stride: int = 1, padding: int = 0, dilation: int = 1,
             groups: int = 1, flags: CudnnFlags = ON, transposed: bool = False, output_padding: int = 0
             ) -> list[cudnn.ConvCall]:  # fmt: skip
    k = x.dim() - 2
    args = (x, w, None, [stride] * k, [padding] * k, [dilation] * k, transposed, [output_padding] * k, groups)
    return workspaces(torch.ops.aten.convolution.default, args, {}, HEUR, flags)


def test_cudnn_disabled_means_no_workspace() -> None:
    x, w = _meta(8, 16, 32, 32), _meta(16, 16, 3, 3)
    assert [c.direction for c in _forward(x, w)] == [FORWARD]
    assert _forward(x, w, flags=CudnnFlags(enabled=False)) == []


def test_the_operands_are_input_weight_and_output() -> None:
    x, w = _meta(8, 16, 32, 32), _meta(16, 16, 3, 3)  # output (8, 16, 30, 30)
    expected = (8 * 16 * 32 * 32 + 16 * 16 * 9 + 8 * 16 * 30 * 30) * F32
    assert _forward(x, w) == [cudnn.ConvCall(FORWARD, expected)]
    x16, w16 = _meta(8, 16, 32, 32, dtype=torch.float16), _meta(16, 16, 3, 3, dtype=torch.float16)
    half = (8 * 16 * 32 * 32 + 16 * 16 * 9 + 8 * 16 * 15 * 15) * 2  # output (8, 16, 15, 15), fp16
    assert _forward(x16, w16, stride=2) == [cudnn.ConvCall(FORWARD, half)]


def test_depthwise_fp32_runs_pytorchs_own_kernel() -> None:
    x, w = _meta(8, 64, 32, 32), _meta(64, 1, 3, 3)
    assert _forward(x, w, padding=1, groups=64) == []
    # a multiplier of 2 (128 outputs from 64 groups) is still depthwise
    assert _forward(x, _meta(128, 1, 3, 3), padding=1, groups=64) == []
    # channels-last always goes to cuDNN
    xc, wc = _meta(8, 64, 32, 32, channels_last=True), _meta(64, 1, 3, 3, channels_last=True)
    assert len(_forward(xc, wc, padding=1, groups=64)) == 1
    # a grouped (not depthwise) convolution goes to cuDNN
    assert len(_forward(x, _meta(64, 32, 3, 3), padding=1, groups=2)) == 1


def test_depthwise_fp16_uses_cudnn_where_pytorchs_heuristic_says() -> None:
    h = torch.float16

    def dw(batch: int, channels: int, width: int, kernel: int, stride: int) -> bool:
        x, w = _meta(batch, channels, width, width, dtype=h), _meta(channels, 1, kernel, kernel, dtype=h)
        return bool(_forward(x, w, stride=stride, padding=kernel // 2, groups=channels))

    assert dw(8, 64, 32, 3, 1)  # stride 1, square 1/3/5 filter, width >= 7
    assert not dw(8, 16, 32, 3, 1)  # fewer than 32 channels
    assert not dw(8, 64, 6, 3, 1)  # narrower than 7
    assert not dw(8, 64, 32, 7, 1)  # 7x7 filter
    assert dw(1, 64, 32, 3, 2)  # batch 1, 3x3, stride 2
    assert dw(1, 64, 28, 1, 2) and not dw(1, 64, 56, 1, 2)  # batch 1, 1x1: width <= 28
    assert dw(8, 256, 28, 3, 2) and not dw(8, 256, 14, 3, 2) and dw(8, 512, 14, 3, 2)
    assert dw(16, 128, 7, 1, 2) and not dw(32, 128, 7, 1, 2)
    # 1-d: viewed as (N, C, 1, L), stride 1 always
    assert _forward(_meta(4, 64, 100, dtype=h), _meta(64, 1, 9, dtype=h), padding=4, groups=64) != []
    assert _forward(_meta(4, 64, 100), _meta(64, 1, 9), padding=4, groups=64) == []  # fp32: native


def test_dilated_deterministic_nchw_avoids_cudnn() -> None:
    x, w = _meta(4, 16, 32, 32), _meta(16, 16, 3, 3)
    det = CudnnFlags(deterministic=True)
    assert _forward(x, w, dilation=2, flags=det) == []
    assert len(_forward(x, w, dilation=2)) == 1
    xc = _meta(4, 16, 32, 32, channels_last=True)
    assert len(_forward(xc, w, dilation=2, flags=det)) == 1  # channels-last bypasses the check


def test_output_padding_not_below_stride_avoids_cudnn() -> None:
    x, w = _meta(2, 8, 16, 16), _meta(8, 4, 3, 3)  # transposed: weight (in, out, k, k)
    assert [c.direction for c in _forward(x, w, stride=2, output_padding=1, transposed=True)] == [BACKWARD_DATA]
    assert _forward(x, w, stride=1, dilation=2, output_padding=1, transposed=True) == []


def test_tensors_that_need_64_bit_indexing_avoid_cudnn() -> None:
    # One item of 2**31 elements cannot be split along the batch: native kernels.
    assert _forward(_meta(2, 2, 32768, 32768), _meta(2, 2, 1, 1)) == []
    assert len(_forward(_meta(4, 2, 16384, 16384), _meta(2, 2, 1, 1))) == 1  # 2**29 per item: split, cuDNN


def test_one_value_stands_for_every_spatial_dimension() -> None:
    x, w = _meta(2, 4, 16, 16), _meta(8, 4, 3, 3)  # "valid": output (2, 8, 14, 14)
    args = (x, w, None, [1], [0], [1], False, [0], 1)
    expected = (2 * 4 * 256 + 8 * 4 * 9 + 2 * 8 * 14 * 14) * F32
    assert workspaces(torch.ops.aten.convolution.default, args, {}, HEUR, ON) == [cudnn.ConvCall(FORWARD, expected)]
    same = _trace(_workload(nn.Conv2d(4, 8, 3, padding="same", bias=False), shape=(4, 16, 16)))
    assert _conv_scratch(same, "forward") == [(FORWARD, CONV1)]


def test_empty_batches_make_no_call() -> None:
    assert _forward(_meta(0, 8, 16, 16), _meta(8, 8, 3, 3)) == []


def test_backward_directions_follow_the_output_mask() -> None:
    x, w, gy = _meta(2, 8, 16, 16), _meta(8, 8, 3, 3), _meta(2, 8, 14, 14)
    op = torch.ops.aten.convolution_backward.default

    def call(mask: list[bool], transposed: bool = False) -> list[str]:
        args = (gy, x, w, None, [1, 1], [0, 0], [1, 1], transposed, [0, 0], 1, mask)
        return [c.direction for c in workspaces(op, args, {}, HEUR, ON)]

    assert call([True, True, True]) == [BACKWARD_DATA, BACKWARD_FILTER]  # the bias gradient is no cuDNN call
    assert call([False, True, False]) == [BACKWARD_FILTER]
    assert call([True, False, False]) == [BACKWARD_DATA]
    assert call([False, False, True]) == []
    assert workspaces(torch.ops.aten.mm.default, (x, w), {}, HEUR, ON) == []


def test_flags_are_read_from_torch() -> None:
    with torch.backends.cudnn.flags(enabled=False, benchmark=True, deterministic=True):
        assert CudnnFlags.current() == CudnnFlags(enabled=False, benchmark=True, deterministic=True)
    fake = type("Backends", (), {"enabled": True, "benchmark": False, "deterministic": False})
    assert CudnnFlags.current(fake) == ON


def test_the_rule_ratios_are_the_stated_assumptions() -> None:
    assert (HEUR.forward, HEUR.backward_data, HEUR.backward_filter) == (1.0, 1.0, 1.0)
    assert (BENCH.forward, BENCH.backward_data, BENCH.backward_filter) == (2.0, 2.0, 2.0)
    dev = get_device("A100-40GB")
    assert cudnn.ratios_for(dev, ON) is HEUR and cudnn.ratios_for(dev, CudnnFlags(benchmark=True)) is BENCH


@pytest.mark.parametrize("channels_last", [False, True])
def test_channels_last_is_read_from_strides(channels_last: bool) -> None:
    t = _meta(2, 3, 4, 5, channels_last=channels_last)
    assert cudnn._channels_last(t) is channels_last
    assert not cudnn._channels_last(_meta(2, 1, 4, 5, channels_last=True))  # one channel: also contiguous


# -- what it changes: a CNN on a 16 GB GPU ----------------------------------------------------------------
def test_a_cnn_on_a_16gb_gpu_needs_more_and_fits_as_many_items_falling_back_where_a_workspace_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Away from the capacity the workspaces add to the step; at it, cuDNN runs engines that need less where a
    workspace does not fit (NOTE [ A workspace cuDNN can do without ]), so fit answers what it answers without
    cuDNN, and its estimate says how many workspaces were done without (with torch 2.13's allocator, whichever
    torch is installed: the bytes at the capacity follow its tie order)."""
    monkeypatch.setenv("BATCHFIT_ALLOCATOR_TORCH", "2.13")
    # A ResNet-18-shaped network (width 64, 4 stages) on 224x224 images, fp32 AdamW, on a V100-16GB.
    wl = batchfit.presets.get("cnn", image_size=224, width=64, stages=4)
    with torch.backends.cudnn.flags(enabled=False):  # no cuDNN: the estimate without workspaces
        before = batchfit.estimate(wl, 48, device="V100-16GB")
        fit_before = batchfit.fit(wl, "V100-16GB")
    after = batchfit.estimate(wl, 48, device="V100-16GB")
    fit_after = batchfit.fit(wl, "V100-16GB")
    assert (before.peak_allocated_bytes, before.device_total_bytes) == (11_355_383_296, 12_790_530_048)
    assert (after.peak_allocated_bytes, after.device_total_bytes) == (11_451_328_000, 13_314_818_048)
    # The largest workspace: a 3x3 64->64 convolution at 224x224, 48 x 64 x 224 x 224 fp32 in and out.
    assert after.cudnn_workspace_bytes == 2 * 48 * 64 * 224 * 224 * 4 + 64 * 64 * 9 * 4 == 1_233_272_832
    assert (fit_before.max_batch_size, fit_after.max_batch_size) == (69, 69)
    assert fit_after.estimate.device_total_bytes == 16_892_559_360 <= fit_after.capacity_bytes
    assert "4 cuDNN convolution workspaces did not fit at the capacity" in " ".join(fit_after.estimate.notes)
