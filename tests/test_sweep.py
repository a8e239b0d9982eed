"""The throughput sweep: real steps, the knee rule, the plot."""

from __future__ import annotations

import pytest

from batchfit import ConfigError, sweep
from batchfit.sweep import SweepPoint, knee_of


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
