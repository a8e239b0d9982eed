"""The HTML report: it parses, its images are PNGs, a browser renders it, its figures show the estimate's numbers."""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import pickle
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import typer
from torch.cuda import _memory_viz
from typer.testing import CliRunner

import batchfit
from batchfit import presets
from batchfit.cli.report import report
from batchfit.memory.categories import ORDER
from batchfit.planning.plan import PlanOption
from batchfit.report.figures import _downsample, memory_timeline
from batchfit.report.html import Report, build_report, render_html, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHROMIUM = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
DEVICE = "512MiB"  # small enough that the fitter's traces stay small


def _tiny_gpt():
    return presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)


@pytest.fixture(scope="module")
def built() -> Report:
    # 600 items with at most 256 per micro-batch: three micro-batches of 200.
    return build_report(
        _tiny_gpt(), device=DEVICE, global_batch_size=600, precision="fp32", base_lr=1e-3, base_batch_size=150
    )


@pytest.fixture(scope="module")
def written(built, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    return write_report(built, out / "report.html", png_dir=out / "png")


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str | None]] = []
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        if tag == "img":
            self.images.append(dict(attrs))

    def handle_data(self, data) -> None:
        self.text.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def _decode_png(raw: bytes):
    import matplotlib.image

    assert raw[:8] == PNG_SIGNATURE
    return matplotlib.image.imread(io.BytesIO(raw), format="png")  # (H, W, channels) floats in [0, 1]


def test_the_report_parses_and_every_image_is_an_embedded_png(written) -> None:
    page = _parse(written)
    assert {"html", "head", "body", "h1", "table"} <= set(page.tags)
    assert len(page.images) == 2  # no sweep in this report
    for img in page.images:
        src = img["src"] or ""
        assert src.startswith("data:image/png;base64,")  # self-contained: nothing fetched
        pixels = _decode_png(base64.b64decode(src.split(",", 1)[1], validate=True))
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert "http://" not in written.read_text() and "https://" not in written.read_text()
    pngs = sorted(p.name for p in (written.parent / "png").iterdir())
    assert pngs == ["memory_by_batch_size.png", "memory_timeline.png"]


def test_the_plan_section_shows_the_plan_and_the_scaled_lr(built, written) -> None:
    text = " ".join(_parse(written).text)
    plan = built.plan
    assert (plan.micro_batch_size, plan.accumulation_steps) == (200, 3)
    assert "200 x 3 x 1" in text and "3 x 200" in text
    # AdamW: square-root rule; 600 / 150 = 4, so twice the reference learning rate.
    assert built.lr.rule == "sqrt" and built.lr.lr == pytest.approx(2e-3)
    assert "learning rate" in text and "0.002 (sqrt rule)" in text
    alt = PlanOption("bf16", False, False, 341, 200, 3, 400 * 2**20, 100 * 2**20, ("bf16 autocast",))
    with_alt = dataclasses.replace(built, plan=dataclasses.replace(plan, alternatives=(alt,)))
    assert "Alternatives" in render_html(with_alt) and "341" in render_html(with_alt)


def test_the_limitations_name_the_context_this_estimate_assumed(built) -> None:
    # A GPU given by its size gets the default context, and the page says so with the figure.
    assumed = built.estimate.context_assumption
    assert assumed.startswith("384.00 MiB: default") and html.escape(assumed) in render_html(built)
    said = "1.25 GiB: measured by batchfit calibrate (h100.json)"
    for assumption, shown in ((said, said), ("", "no CUDA context is counted")):
        estimate = dataclasses.replace(built.estimate, context_assumption=assumption)
        page = render_html(dataclasses.replace(built, estimate=estimate))
        assert html.escape(shown) in page and html.escape(assumed) not in page


def test_memory_by_batch_size_shows_the_estimates(built) -> None:
    data = built.figure("memory_by_batch_size").data
    sizes = data["batch_sizes"]
    assert sizes[0] == 1 and sizes[-1] >= built.plan.max_micro_batch_size
    for i in (0, len(sizes) // 2, len(sizes) - 1):
        b = sizes[i]
        # The plan accumulates (3 micro-batches): the curve is of steps with the gradients alive throughout.
        est = batchfit.estimate(_tiny_gpt(), b, device=DEVICE, precision="fp32", accumulation_steps=3)
        stacked = {c.value: data["categories"][c.value][i] for c in ORDER}
        assert sum(stacked.values()) == est.peak_allocated_bytes, b
        assert stacked == est.breakdown
        assert data["device_total"][i] == est.device_total_bytes
    assert data["capacity"] == batchfit.get_device(DEVICE).total_bytes
    traced = sizes.index(built.batch_size)  # the traced step is on the curve, with the same numbers
    assert data["peak_allocated"][traced] == built.estimate.peak_allocated_bytes
    assert built.plan.max_micro_batch_size in sizes


def test_memory_timeline_shows_the_traced_step(built) -> None:
    data = built.figure("memory_timeline").data
    est = batchfit.estimate(_tiny_gpt(), built.batch_size, device=DEVICE, precision="fp32", accumulation_steps=3)
    assert built.estimate.peak_allocated_bytes == est.peak_allocated_bytes
    assert max(data["total"]) == data["peak_bytes"] == est.peak_allocated_bytes
    at_peak = {c: series[data["peak_index"]] for c, series in data["categories"].items()}
    assert at_peak == est.breakdown
    assert len(data["total"]) == len(built.trace.events)
    # Two micro-batches per step (the plan accumulates), then the optimizer.
    phases = ["setup", "batch", "forward", "backward", "batch", "forward", "backward", "optimizer"]
    assert [p[1] for p in data["phases"][: len(phases)]] == phases
    assert data["total"][-1] == sum(series[-1] for series in data["categories"].values())


def test_timeline_counts_exact_bytes_on_the_cpu_and_downsampling_keeps_the_peak() -> None:
    from batchfit.memory.trace.fake_step import MemoryTrace

    trace = MemoryTrace(events=[1, 2, ~2, 3, ~1, ~3], nbytes={1: 100, 2: 1000, 3: 10})
    exact = memory_timeline(trace, rounded=False)
    assert exact["total"] == [100, 1100, 100, 110, 10, 0] and exact["peak_index"] == 1
    assert memory_timeline(trace, rounded=True)["total"] == [512, 1536, 512, 1024, 512, 0]
    keep = _downsample(list(range(100)) + [1000] + list(range(100)), 20)
    assert 100 in keep and len(keep) <= 20


def _find_chromium() -> str | None:
    for name in CHROMIUM:
        found = shutil.which(name)
        if found:
            return found
    return None


def test_the_report_renders_in_headless_chromium(written, tmp_path) -> None:
    browser = _find_chromium()
    if browser is None:
        print("skipping: no chromium on PATH or at /usr/bin/chromium (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    shot = tmp_path / "shot.png"
    args = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1200,900",
        written.resolve().as_uri(),
    ]
    subprocess.run(args, check=True, capture_output=True, timeout=120)
    pixels = _decode_png(shot.read_bytes())
    assert pixels.shape[:2] == (900, 1200)
    gray = pixels[..., :3].mean(axis=2)
    assert gray.std() > 0.05, "the screenshot is blank"  # a white page has std 0
    assert (gray < 0.5).mean() > 0.005  # some dark pixels: text, tables, axes


def test_cli_writes_the_report_figures_and_snapshot_with_a_sweep(tmp_path) -> None:
    app = typer.Typer()
    app.command()(report)
    out = tmp_path / "r.html"
    result = CliRunner().invoke(
        app,
        [
            "mlp",
            "--device",
            "cpu",
            "-o",
            str(out),
            "--batch-size",
            "8",
            "--sweep",
            "--sweep-batch-sizes",
            "1,4",
            "--png-dir",
            str(tmp_path / "png"),
            "--snapshot",
            str(tmp_path / "s.pickle"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert Path(d["report"]) == out.resolve() and d["plan"] is None and "no memory capacity" in d["plan_note"]
    page = _parse(out)
    assert len(page.images) == 3  # memory by batch size, timeline, throughput
    for img in page.images:
        _decode_png(base64.b64decode((img["src"] or "").split(",", 1)[1]))
    assert sorted(Path(p).name for p in d["png"]) == [
        "memory_by_batch_size.png",
        "memory_timeline.png",
        "throughput.png",
    ]
    assert all(Path(p).stat().st_size > 0 for p in d["png"])
    with open(d["snapshot"], "rb") as f:
        snap = pickle.load(f)
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snap)
    assert d["sweep"]["knee"] in (1, 4)
    assert d["estimate"]["peak_allocated_bytes"] == batchfit.estimate("mlp", 8, device="cpu").peak_allocated_bytes


def test_cli_prints_the_paths_and_rejects_half_an_lr_reference(tmp_path) -> None:
    app = typer.Typer()
    app.command()(report)
    out = tmp_path / "r.html"
    ok = CliRunner().invoke(app, ["mlp", "--device", "cpu", "-o", str(out), "-b", "4"])
    assert ok.exit_code == 0, ok.output
    assert f"report written to {out.resolve()}" in ok.stdout
    bad = CliRunner().invoke(app, ["mlp", "--device", "cpu", "-o", str(out), "--base-lr", "0.1"])
    assert isinstance(bad.exception, batchfit.ConfigError) and "--base-batch-size" in str(bad.exception)
