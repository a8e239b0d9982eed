"""``batchfit train``: deterministic synthetic data, exact across micro-batch sizes, JSON, atomic save."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner

from batchfit.cli.train import train
from batchfit.errors import ConfigError, UnknownNameError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(train)  # as the package's cli.py registers it


@app.command()
def other() -> None:  # a second command, so that `train` is a subcommand as in the real CLI
    """Nothing."""


runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")


def invoke(*args: str) -> Any:
    return runner.invoke(app, ["train", *args], catch_exceptions=True)


def run_json(*args: str) -> dict[str, Any]:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def test_json_reports_every_step() -> None:
    out = run_json("mlp", "-g", "17", "-m", "5", "--steps", "2", "--seed", "3")
    assert [s["step"] for s in out["steps"]] == [0, 1]
    first = out["steps"][0]
    assert first["micro_batch_sizes"] == [5, 4, 4, 4] and first["accumulation_steps"] == 4
    assert first["micro_batch_size"] == 5 and first["n_items"] == 17 and first["replanned"] == []
    assert first["items_per_s"] > 0 and first["peak_reserved_bytes"] is None  # the plain CPU has no stats
    assert out["final_loss"] == out["steps"][-1]["loss"] and out["dtype"] == "float32" and out["plan"] is None


def test_the_same_seed_gives_the_same_run() -> None:
    a = run_json("mlp", "-g", "8", "-m", "4", "--steps", "2")
    b = run_json("mlp", "-g", "8", "-m", "4", "--steps", "2")
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]


def test_float64_runs_agree_whatever_the_micro_batch(tmp_path: Path) -> None:
    states = {}
    for micro in ("12", "5", "1"):
        path = tmp_path / f"m{micro}.pt"
        out = run_json("mlp", "-g", "12", "-m", micro, "--steps", "3", "--dtype", "float64", "--save", str(path))
        assert out["saved"] == str(path) and out["dtype"] == "float64"
        states[micro] = torch.load(path, weights_only=True)
    full = states["12"]
    assert all(t.dtype == torch.float64 for t in full.values())
    for micro in ("5", "1"):
        for name, ref in full.items():
            rel = ((states[micro][name] - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-12, (micro, name, rel)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m1.pt", "m12.pt", "m5.pt"]  # no temporary left


def test_save_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    path.write_bytes(b"old")
    run_json("mlp", "-g", "4", "--steps", "1", "--save", str(path))
    assert set(torch.load(path, weights_only=True)) >= {"head.weight", "head.bias"}


def test_text_output_shows_micro_batch_times_accumulation() -> None:
    result = invoke("mlp", "-g", "64", "-m", "16", "--steps", "2")
    assert result.exit_code == 0, result.output
    assert "global batch 64 = micro-batch 16 x 4 accumulation steps on cpu" in result.stdout
    assert result.stdout.count("16 x 4") >= 3  # the title and each step's row


def test_a_simulated_gpu_plans_the_micro_batch() -> None:
    out = run_json("mlp", "-g", "4096", "--set", "hidden=512", "--device", "simulated:48MiB", "--steps", "2")
    plan = out["plan"]
    assert plan is not None and plan["micro_batch_size"] < 4096
    for step in out["steps"]:
        assert step["micro_batch_sizes"] == plan["splits"][0] and step["accumulation_steps"] > 1
        assert 0 < step["peak_reserved_bytes"] <= 48 * 2**20


def test_a_cnn_run_carries_the_batchnorm_advice() -> None:
    out = run_json("cnn", "-g", "8", "-m", "4", "--steps", "1", "--set", "width=4", "--set", "stages=1",
                   "--set", "image_size=8")
    (advice,) = out["advice"]
    assert advice.startswith("BatchNorm under gradient accumulation") and "global batch of 8" in advice


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (["-g", "0"], ConfigError, "--global-batch-size must be a whole number >= 1, got 0"),
        (["-g", "8", "--steps", "0"], ConfigError, "--steps must be a whole number >= 1"),
        (["-g", "8", "-m", "abc"], ConfigError, "--micro-batch-size takes a whole number or 'auto'"),
        (["-g", "8", "-m", "0"], ConfigError, "--micro-batch-size must be a whole number >= 1"),
        (["-g", "8", "-m", "9"], ConfigError, "micro_batch_size 9 exceeds global_batch_size 8"),
        (["-g", "8", "--device", "simulated:"], ConfigError, "needs a GPU name or a capacity"),
        (["-g", "8", "--device", "simulated:12XB"], ConfigError, "cannot read capacity"),
        (["-g", "8", "--device", "H1000"], UnknownNameError, "unknown device 'H1000'"),
        (["-g", "8", "--device", "cuda"], ConfigError, "needs a GPU but none is visible"),
        (["-g", "8", "--dtype", "float64", "--precision", "bf16"], ConfigError, "use it with --precision fp32"),
        (["-g", "8", "--precision", "fp8"], ConfigError, "unknown precision 'fp8'"),
        (["-g", "8", "--set", "hidden"], ConfigError, "--set takes KEY=VALUE"),
        (["-g", "8", "--set", "depth=0"], ConfigError, "depth must be at least 1"),
        (["-g", "8", "--save", "/nonexistent/dir/w.pt"], ConfigError, "directory '/nonexistent/dir' does not exist"),
    ],
)
def test_bad_input_is_one_config_error(args: list[str], error: type, match: str) -> None:
    result = invoke("mlp", *args)
    assert isinstance(result.exception, error), (result.exception, result.output)
    assert match in str(result.exception)


def test_an_unknown_preset() -> None:
    result = invoke("mlpp", "-g", "8")
    assert isinstance(result.exception, UnknownNameError) and "did you mean 'mlp'" in str(result.exception)


def test_help_comes_from_the_docstring() -> None:
    result = runner.invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    assert "Train a preset on deterministic synthetic data" in result.stdout
    assert "--global-batch-size" in result.stdout and "--micro-batch-size" in result.stdout


def test_a_resume_with_no_step_left_says_so_in_one_line(tmp_path: Path) -> None:
    ck = tmp_path / "ck.pt"
    args = ("mlp", "--global-batch-size", "8", "--micro-batch-size", "4", "--steps", "2", "--checkpoint", str(ck))
    assert invoke(*args).exit_code == 0
    again = invoke(*args)
    assert again.exit_code == 0, (again.output, again.exception)
    assert "already at step 2; nothing left to run" in again.output
