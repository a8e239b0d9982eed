"""Matplotlib figures (PNG). Imported only by the CLI and the report, so ``import batchfit`` stays light."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..units import GiB, MiB


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    return plt


def _unit(max_bytes: float) -> tuple[float, str]:
    return (GiB, "GiB") if max_bytes >= GiB else (MiB, "MiB")


def plot_sweep(result: Any, path: str | Path) -> Path:
    """Throughput (left axis) and peak memory (right axis) against batch size, the knee marked."""
    plt = _pyplot()
    sizes = [p.batch_size for p in result.points]
    thr = [p.items_per_second for p in result.points]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(sizes, thr, "o-", color="tab:blue", label="items/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("items / s", color="tab:blue")
    knee = next(p for p in result.points if p.batch_size == result.knee)
    ax.axvline(result.knee, color="tab:green", linestyle="--", linewidth=1)
    ax.annotate(
        f"knee: {result.knee}\n({knee.items_per_second:.0f} items/s)",
        (result.knee, knee.items_per_second),
        textcoords="offset points",
        xytext=(8, -28),
        color="tab:green",
    )
    peaks = [p.peak_bytes for p in result.points]
    if all(v is not None for v in peaks):
        scale, unit = _unit(max(peaks))  # type: ignore[type-var]
        ax2 = ax.twinx()
        ax2.plot(sizes, [v / scale for v in peaks], "s--", color="tab:orange", label="peak memory")  # type: ignore[operator]
        ax2.set_ylabel(f"peak memory ({unit})", color="tab:orange")
    ax.set_title(f"{result.workload} on {result.device}: throughput and memory by batch size")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
