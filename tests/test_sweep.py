"""The throughput sweep: real steps, the knee rule, the plot."""

from __future__ import annotations

import pytest

from batchfit import ConfigError, sweep
from batchfit.planning.sweep import SweepPoint, knee_of


def _p(b: int, ips: float) -> SweepPoint:
    return SweepPoint(b, b / ips, ips, None, None)


def test_knee_is_the_smallest_batch_within_3_percent_of_the_best() -> None:
    points = [_p(1, 100.0), _p(2, 180.0), _p(4, 970.0), _p(8, 1000.0), _p(16, 990.0)]
    assert knee_of(points) == 4
    assert knee_of([_p(1, 100.0), _p(2, 96.0)]) == 1
    assert knee_of([_p(1, 96.0), _p(2, 100.0)]) == 2


def test_sweep_measures_each_size_and_writes_a_plot(tmp_path) -> None:
    result = sweep("mlp", batch_sizes=[1, 4, 16], steps=2)
    assert [p.batch_size for p in result.points] == [1, 4, 16]
    assert all(p.seconds_per_step > 0 and p.peak_bytes and p.peak_bytes > 0 for p in result.points)
    assert result.points[2].peak_bytes > result.points[0].peak_bytes
    assert result.knee == knee_of(result.points)
    from batchfit.report.plots import plot_sweep

    out = plot_sweep(result, tmp_path / "sweep.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("sizes", [[0, 2], [-1]])
def test_bad_sizes(sizes) -> None:
    with pytest.raises(ConfigError):
        sweep("mlp", batch_sizes=sizes, steps=1)


def test_an_empty_list_is_refused_not_replaced_by_the_defaults() -> None:
    with pytest.raises(ConfigError, match="at least one batch size"):
        sweep("mlp", batch_sizes=[], steps=1)


@pytest.mark.parametrize("device", ["H100-80GB", "foo", "24GiB", "simulated:48MiB", "cuda:x"])
def test_a_device_that_is_not_this_machine_is_refused_before_any_step(device: str, monkeypatch) -> None:
    import sys

    sweep_module = sys.modules["batchfit.planning.sweep"]
    monkeypatch.setattr(sweep_module, "_time_steps", lambda *a, **k: pytest.fail("a step ran"))
    with pytest.raises(ConfigError, match=r"sweep measures this machine \(cpu, or cuda when a GPU is present\)"):
        sweep("mlp", device=device, batch_sizes=[1], steps=1)


def test_cuda_without_a_gpu_is_refused(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "CUDA", "cuda:0"):
        with pytest.raises(ConfigError, match="no CUDA GPU is visible here; use --device cpu"):
            sweep("mlp", device=device, batch_sizes=[1], steps=1)


def test_the_device_is_recorded_as_measured() -> None:
    assert sweep("mlp", device=" CPU ", batch_sizes=[2], steps=1, measure_memory=False).device == "cpu"


@pytest.mark.parametrize(
    ("text", "fault"),
    [("", "is empty"), ("  ", "is empty"), ("1,,4", "not ''"), ("1,two", "not 'two'"), ("0,2", "not '0'"),
     ("-1", "not '-1'"), ("1.5", "not '1.5'")],
)  # fmt: skip
def test_cli_batch_sizes_must_be_whole_numbers(text: str, fault: str, capsys) -> None:
    from batchfit.cli import main

    assert main(["sweep", "mlp", "--batch-sizes", text]) == 2
    err = capsys.readouterr().err
    assert fault in err and err.count("\n") == 1  # one line, no traceback


def test_cli_refuses_a_catalog_gpu_in_one_line(capsys) -> None:
    from batchfit.cli import main

    assert main(["sweep", "gpt", "--device", "H100-80GB"]) == 2
    err = capsys.readouterr().err
    assert "batchfit fit <model> --device H100-80GB" in err and err.count("\n") == 1
