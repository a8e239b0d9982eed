"""``batchfit calibrate``'s measurements, with fakes of the GPU, ``torch.cuda`` and NVML (no GPU runs tests)."""

from __future__ import annotations

import pytest
import torch
from gpu_fakes import H100, H100_TOTAL, PER_HANDLE, FakeCuda, FakeGpu, FakeNvml, this_pid

from batchfit.errors import NoGpuError
from batchfit.gpu.catalog import ConvWorkspace
from batchfit.memory.kernels.cudnn import BACKWARD_DATA, BACKWARD_FILTER, FORWARD
from batchfit.runtime import calibrate
from batchfit.runtime.calibrate import QUICK_SHAPES, SHAPES, ConvShape, TorchGpu, calibrate_device, measure_transient
from batchfit.units import MiB


# -- assembling a profile ------------------------------------------------------------------------------
def test_the_profile_holds_what_was_measured() -> None:
    gpu = FakeGpu()
    lines: list[str] = []
    profile = calibrate_device(gpu, progress=lines.append)
    assert profile.gpu == H100
    assert (profile.total_bytes, profile.compute_capability, profile.module_loading) == (H100_TOTAL, (9, 0), "LAZY")
    assert profile.bare_context_bytes == 600 * MiB - 2 * MiB  # NVML's used less memory_reserved
    assert profile.context_bytes == 1400 * MiB - 300 * MiB  # ... after the training steps
    assert profile.context_benchmark_bytes == 2000 * MiB - 500 * MiB  # ... after the benchmark runs too
    assert (profile.cublas_workspace_bytes, profile.cublas_handles) == (PER_HANDLE, 2)
    assert profile.conv_workspace == ConvWorkspace(forward=0.25, backward_data=0.375, backward_filter=0.0)
    assert profile.conv_workspace_benchmark == ConvWorkspace(forward=1.5, backward_data=1.0, backward_filter=0.5)
    assert len(profile.conv_measurements) == 2 * 2 * len(SHAPES) * 3  # modes x dtypes x shapes x directions
    assert (profile.cudnn_version, profile.alloc_conf) == (91002, "expandable_segments:True")
    assert profile.steps == ("mlp fp32", "mlp bf16")
    assert gpu.calls == ["init", "cublas", "steps quick=False"]  # the cuBLAS workspace before any step's GEMM
    assert gpu.modes == [False, True] and gpu.batches == {(False, 16), (True, 24)}
    assert len(lines) == 5 and lines[-1].startswith("measuring cuDNN convolution workspaces (benchmark)")


def test_quick_measures_three_shapes() -> None:
    gpu = FakeGpu()
    profile = calibrate_device(gpu, quick=True)
    assert len(profile.conv_measurements) == 2 * 2 * len(QUICK_SHAPES) * 3 == 36
    assert gpu.calls[-1] == "steps quick=True"


def test_the_handles_are_counted_from_the_workspaces_alive() -> None:
    assert calibrate_device(FakeGpu(alive=3 * PER_HANDLE)).cublas_handles == 3
    assert calibrate_device(FakeGpu(alive=None)).cublas_handles == 2  # a torch that cannot clear them: assumed


def test_the_context_after_benchmark_is_never_below_the_context() -> None:
    class Smaller(FakeGpu):
        USED = (600 * MiB, 1400 * MiB, 1500 * MiB)  # 1500 - 500 = 1000 < 1100

    assert calibrate_device(Smaller()).context_benchmark_bytes == 1100 * MiB


def test_without_nvml_calibration_stops_with_one_line() -> None:
    with pytest.raises(NoGpuError, match="NVML cannot report"):
        calibrate_device(FakeGpu(nvml=False))


def test_a_direction_without_measurements_keeps_the_models_ratio() -> None:
    rows = [calibrate.ConvMeasurement("s", "float32", FORWARD, False, 800, 100)]
    assert calibrate.ratios(rows, benchmark=False) == ConvWorkspace(0.125, 1.0, 1.0)
    assert calibrate.ratios(rows, benchmark=True) == ConvWorkspace(2.0, 2.0, 2.0)


# -- the real GPU's seams ------------------------------------------------------------------------------
def test_no_gpu_here_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as here, even where tests run on a GPU
    with pytest.raises(NoGpuError, match="no CUDA GPU is visible"):
        TorchGpu()  # torch.cuda itself
    with pytest.raises(NoGpuError):
        TorchGpu(cuda=FakeCuda(available=False))


def test_a_transient_is_the_peak_above_before_and_the_output() -> None:
    cuda = FakeCuda(allocated=10 * MiB, peaks=[10 * MiB + 4096 + 3 * MiB])
    assert measure_transient(cuda, lambda: None, 4000) == 3 * MiB  # the 4000-byte output is a 4096-byte block
    assert cuda.resets == 1
    cuda = FakeCuda(allocated=10 * MiB, peaks=[10 * MiB])
    assert measure_transient(cuda, lambda: None, 4000) == 0  # never negative


def test_nvml_figure_of_this_process_or_the_device_less_the_baseline() -> None:
    nvml = FakeNvml(used=5000 * MiB, processes={this_pid(): 900 * MiB, 1: 100 * MiB})
    gpu = TorchGpu(cuda=FakeCuda(), nvml=nvml, device="cpu")
    assert gpu.process_used() == 900 * MiB
    # In a container NVML lists other pids: the device's used memory less what was used before.
    nvml = FakeNvml(used=3000 * MiB, processes={12345: 700 * MiB})
    gpu = TorchGpu(cuda=FakeCuda(), nvml=nvml, device="cpu")  # baseline read now: 3000 MiB
    nvml.used = 3700 * MiB
    assert gpu.process_used() == 700 * MiB
    assert TorchGpu(cuda=FakeCuda(), nvml=FakeNvml(missing=True), device="cpu").process_used() is None


@pytest.mark.parametrize(("visible", "handle"), [(None, 0), ("2,3", 2), ("GPU-8f2a", "GPU-8f2a"), ("", 0)])
def test_nvml_finds_the_gpu_cuda_calls_device_0(visible: str | None, handle: int | str) -> None:
    nvml = FakeNvml(used=MiB)
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    TorchGpu(cuda=FakeCuda(), nvml=nvml, device="cpu", environ=environ)
    assert nvml.handles == [handle]


def test_identity_and_settings_through_the_seams() -> None:
    gpu = TorchGpu(cuda=FakeCuda(), nvml=FakeNvml(driver=b"580.65.06"), device="cpu", environ={})
    ident = gpu.identity()
    assert (ident.name, ident.driver, ident.torch) == (H100.name, "580.65.06", torch.__version__)
    props = gpu.properties()
    assert (props["total_bytes"], props["compute_capability"], props["module_loading"]) == (H100_TOTAL, (9, 0), "LAZY")
    assert props["conv_dtypes"] == [torch.float32, torch.bfloat16] and props["alloc_conf"] == ""
    env = {"CUDA_MODULE_LOADING": "eager", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    volta = TorchGpu(cuda=FakeCuda(major=7), nvml=FakeNvml(), device="cpu", environ=env).properties()
    assert (volta["module_loading"], volta["alloc_conf"]) == ("EAGER", "expandable_segments:True")
    assert volta["conv_dtypes"] == [torch.float32, torch.float16]  # no bf16 before sm 80
    assert TorchGpu(cuda=FakeCuda(), nvml=FakeNvml(missing=True), device="cpu").identity().driver == "unknown"


def test_a_convolutions_workspace_is_measured_around_its_output() -> None:
    shape = ConvShape(4, 8, 10, 3, stride=1, padding=1)  # x (2,4,10,10), w (8,4,3,3), y (2,8,10,10)
    x, w, y = 2 * 4 * 100 * 4, 8 * 4 * 9 * 4, 2 * 8 * 100 * 4
    for direction, out in ((FORWARD, y), (BACKWARD_DATA, x), (BACKWARD_FILTER, w)):
        before = 7 * MiB
        cuda = FakeCuda(allocated=before, peaks=[before + -(-out // 512) * 512 + 5 * MiB])
        gpu = TorchGpu(cuda=cuda, nvml=FakeNvml(), device="cpu")
        m = gpu.conv_workspace(shape, 2, torch.float32, direction)  # the ops run for real, on the CPU
        assert (m.direction, m.operand_bytes, m.workspace_bytes, m.benchmark) == (direction, x + w + y, 5 * MiB, False)
        assert m.shape == "x=2x4x10x10 w=8x4x3x3 stride=1 padding=1 groups=1" and m.dtype == "float32"


def test_modes_run_in_a_fresh_thread_with_the_flag_set() -> None:
    import threading

    gpu = TorchGpu(cuda=FakeCuda(), nvml=FakeNvml(), device="cpu")
    seen = gpu.in_mode(True, lambda: (torch.backends.cudnn.benchmark, threading.current_thread().name))
    assert seen == (True, "calibrate-cudnn-benchmark")
    assert torch.backends.cudnn.benchmark is False
    with pytest.raises(ZeroDivisionError):
        gpu.in_mode(False, lambda: 1 / 0)  # an error in the thread reaches the caller


def test_the_cublas_workspace_is_what_the_first_gemms_keep() -> None:
    out = 64 * 64 * 4
    cuda = FakeCuda(allocated=MiB, peaks=[MiB + out + 32 * MiB, MiB + out + 4 * MiB])
    assert TorchGpu(cuda=cuda, nvml=FakeNvml(), device="cpu").cublas_workspace() == 36 * MiB


def test_clearing_the_workspaces_counts_what_they_held(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(allocated=100 * MiB)
    gpu = TorchGpu(cuda=cuda, nvml=FakeNvml(), device="cpu")

    def clear() -> None:
        cuda.allocated = 28 * MiB

    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", clear, raising=False)
    assert gpu.clear_cublas_workspaces() == 72 * MiB
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    assert gpu.clear_cublas_workspaces() is None


def test_the_training_steps_run(one_thread: None) -> None:
    gpu = TorchGpu(cuda=FakeCuda(), nvml=FakeNvml(), device="cpu")
    assert gpu.run_steps(quick=True) == ["mlp fp32", "mlp bf16", "cnn fp32", "cnn bf16"]
