"""The HTML report: one self-contained file (figures embedded as base64 PNG) that people look at.

``build_report`` gathers what the report shows: a plan of the global batch with its alternatives, one
traced step at the plan's micro-batch (its estimate, its timeline, its snapshot), the memory curve
over batch sizes (predicted from two traces through ``TraceLine``, which reproduces a real trace's
estimate exactly when the step's code does not depend on the batch size, and traced otherwise), an
optional learning-rate scaling and an optional CPU throughput sweep. ``render_html`` turns that into
text and ``write_report`` into a file. Nothing here prints. Gathering is ``build.py`` and the
sections of the page ``sections.py`` (``Report`` and ``build_report`` are re-exported here); this
module assembles the page.

Example:
    >>> from batchfit.report.html import build_report, render_html
    >>> report = build_report("mlp", device="2GiB", global_batch_size=64)  # doctest: +SKIP
    >>> "<html" in render_html(report)  # doctest: +SKIP
    True
"""

from __future__ import annotations

from pathlib import Path

from .._version import __version__
from ..units import format_bytes
from .build import DEFAULT_GLOBAL_BATCH_SIZE, Report, build_report
from .sections import _e, _estimate_section, _img, _plan_section, _sweep_section

__all__ = ["DEFAULT_GLOBAL_BATCH_SIZE", "Report", "build_report", "render_html", "write_report"]

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.25em; margin-top: 1.8em;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.6em 0 1em; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.7em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em; vertical-align: -0.1em; }
.fits { color: #1a7f37; font-weight: bold; } .nofit { color: #cf222e; font-weight: bold; }
.note { background: #fff8c5; border-left: 4px solid #d4a72c; padding: 0.5em 0.8em; margin: 0.8em 0; }
.advice { background: #ddf4ff; border-left: 4px solid #54aeff; padding: 0.5em 0.8em; margin: 0.8em 0; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
code { background: #f4f4f4; padding: 0 0.25em; }
"""


def render_html(report: Report) -> str:
    """The report as one HTML document: no external file, script or font; figures as data URIs."""
    r = report
    title = f"batchfit report: {r.workload} on {r.device}"
    budget = ""
    if r.budget_bytes is not None:
        budget = (
            f" The dashed red line is what the allocator may reserve ({format_bytes(r.budget_bytes)}: capacity less "
            "the CUDA context)."
        )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">{_e(r.precision)}{" · activation checkpointing" if r.checkpointing else ""} · '
        f"traced on fake tensors, no GPU used · batchfit {_e(__version__)} · {_e(r.created)}</p>",
        _plan_section(r),
        "<h2>Memory by batch size</h2>",
        _img(
            r.figure("memory_by_batch_size"),
            "Breakdown at the peak of one step (stacked), allocator reserve "
            "(dotted), what nvidia-smi would show (solid) and the device's capacity (dashed).",
        ),
        "<h2>Memory over one training step</h2>",
        _img(
            r.figure("memory_timeline"),
            "Live memory by category after each allocation and free of two traced "
            "steps (the first creates the optimizer state, the second is the steady state); forward, backward "
            "and optimizer phases shaded." + budget,
        ),
        _estimate_section(r),
    ]
    if r.sweep is not None:
        parts.append(_sweep_section(r))
    parts.append(_limitations(r))
    parts.append("</body></html>")
    return "\n".join(parts)


def _limitations(r: Report) -> str:
    """What the estimate assumed rather than traced, in this report's own terms (its context's source)."""
    context = getattr(r.estimate, "context_assumption", "")
    context_line = (
        f"the CUDA context is {_e(context)} (override with <code>--context-mib</code>, or measure it with "
        "<code>batchfit calibrate</code>)"
        if context
        else "no CUDA context is counted on this device"
    )
    return (
        "<h2>Limitations</h2><p>Estimated from a trace of the real step on fake tensors and a model of the CUDA "
        "caching allocator. cuDNN convolution workspaces are an assumption (room for a copy of each operand) "
        "unless a device profile measured them; other processes on the GPU are not counted and compiled regions "
        "are traced as eager; "
        f"{context_line}.</p>"
    )


def write_report(report: Report, path: str | Path, *, png_dir: str | Path | None = None) -> Path:
    """Write the HTML (and, with ``png_dir``, each figure as ``<name>.png``); returns the HTML's path."""
    out = Path(path)
    if out.parent != Path():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(report), encoding="utf-8")
    if png_dir is not None:
        for fig in report.figures:
            fig.save(png_dir)
    return out
