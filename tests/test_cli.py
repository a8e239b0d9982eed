"""The command line: JSON agrees with the Python API, tables render, bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest

import batchfit
from batchfit.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json_has_the_fields(capsys) -> None:
    code, out, err = _run(
        capsys,
        "estimate",
        "gpt",
        "--batch-size",
        "2",
        "--device",
        "A100-40GB",
        "--json",
        "--set",
        "n_layer=2",
        "--set",
        "n_embd=64",
        "--set",
        "n_head=2",
        "--seq-len",
        "32",
    )
    assert code == 0, err
    d = json.loads(out)
    for key in (
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "device_total_bytes",
        "breakdown",
        "per_module",
        "analytic",
    ):
        assert key in d
    assert sum(d["breakdown"].values()) == d["peak_allocated_bytes"]


def test_estimate_json_on_cpu_agrees_with_the_api(capsys) -> None:
    code, out, _ = _run(capsys, "estimate", "mlp", "-b", "8", "--device", "cpu", "--json")
    assert code == 0
    assert json.loads(out)["peak_allocated_bytes"] == batchfit.estimate("mlp", 8, device="cpu").peak_allocated_bytes


@pytest.mark.parametrize("command", ["estimate", "fit"])
def test_accumulation_steps_reach_the_api_and_bad_values_are_one_line(capsys, command: str) -> None:
    size = ["-b", "8"] if command == "estimate" else []
    code, out, err = _run(capsys, command, "mlp", *size, "--device", "1GiB", "--accumulation-steps", "4", "--json")
    assert code == 0, err
    got = json.loads(out) if command == "estimate" else json.loads(out)["estimate"]
    assert got["accumulation_steps"] == 4
    if command == "estimate":
        api = batchfit.estimate("mlp", 8, device="1GiB", accumulation_steps=4)
        assert got["device_total_bytes"] == api.device_total_bytes
    code, out, err = _run(capsys, command, "mlp", *size, "--accumulation-steps", "0")
    assert code == 2 and err.strip().count("\n") == 0 and "--accumulation-steps must be a whole number >= 1" in err


def test_some_blocks_checkpointed_reach_the_api(capsys) -> None:
    gpt = ["gpt", "--device", "A100-40GB", "--set", "n_layer=4", "--set", "n_embd=32", "--set", "n_head=2",
           "--seq-len", "64", "--json"]  # fmt: skip
    code, out, err = _run(capsys, "estimate", *gpt, "-b", "2", "--checkpoint-blocks", "0,2")
    assert code == 0, err
    got = json.loads(out)
    assert got["checkpointing"] and got["checkpointed_blocks"] == [0, 2]
    wl = batchfit.presets.get("gpt", n_layer=4, n_embd=32, n_head=2, seq_len=64)
    api = batchfit.estimate(wl, 2, device="A100-40GB", checkpointing=[0, 2])
    assert got["device_total_bytes"] == api.device_total_bytes
    code, out, err = _run(capsys, "estimate", *gpt, "-b", "2", "--checkpoint-blocks", "3")
    assert code == 0 and json.loads(out)["checkpointed_blocks"] == [0, 1, 2]
    for value, blocks, selective in (("2", [0, 1], False), ("1,3", [1, 3], False), ("selective", None, True),
                                     ("2+selective", [0, 1], True), ("1,3+selective", [1, 3], True)):
        code, out, err = _run(capsys, "estimate", *gpt, "-b", "2", "--checkpointing", value)
        got = json.loads(out)
        assert code == 0 and got["checkpointing"], err
        assert (got["checkpointed_blocks"], got["selective_checkpointing"]) == (blocks, selective)


def test_checkpointing_takes_an_optional_value_on_estimate_and_fit() -> None:
    from batchfit.cli.options import take_checkpointing

    assert take_checkpointing(["estimate", "gpt", "--checkpointing"]) == ["estimate", "gpt", "--checkpointing=blocks"]
    assert take_checkpointing(["estimate", "--checkpointing", "gpt"]) == ["estimate", "--checkpointing=blocks", "gpt"]
    assert take_checkpointing(["fit", "gpt", "--checkpointing", "-b", "2"])[2] == "--checkpointing=blocks"
    for value in ("auto", "12", "0,4,8", "selective", "12+selective", "0,4+selective", "blocks", "none"):
        assert take_checkpointing(["fit", "gpt", "--checkpointing", value]) == ["fit", "gpt", "--checkpointing", value]
    assert take_checkpointing(["plan", "gpt", "--checkpointing", "-g", "8"])[2] == "--checkpointing"  # a flag there


def test_estimate_table_renders(capsys) -> None:
    code, out, _ = _run(capsys, "estimate", "mlp", "-b", "8", "--device", "T4")
    assert code == 0
    assert "at the peak" in out and "headroom" in out and "fits" in out


def test_gpus_lists_the_catalog(capsys) -> None:
    code, out, _ = _run(capsys, "gpus", "--json")
    names = {d["name"] for d in json.loads(out)["devices"]}
    assert code == 0 and {"A100-40GB", "H100-80GB", "T4", "B200"} <= names and len(names) >= 14


def test_fit_and_plan_json(capsys) -> None:
    code, out, _ = _run(capsys, "fit", "mlp", "--device", "1GiB", "--json")
    fit = json.loads(out)
    assert code == 0 and fit["trials"] <= 4 and fit["max_batch_size"] > 1000
    code, out, _ = _run(capsys, "plan", "mlp", "-g", "31", "--gpus", "2", "--device", "1GiB", "--json")
    plan = json.loads(out)
    assert code == 0 and [sum(s) for s in plan["splits"]] == [16, 15]
    for key in (
        "micro_batch_size",
        "accumulation_steps",
        "gpus",
        "precision",
        "checkpointing",
        "estimate",
        "headroom_bytes",
        "alternatives",
    ):
        assert key in plan


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["estimate", "mlp", "--batch-size", "0"], "batch-size"),
        (["estimate", "mlp", "--batch-size", "-3"], "batch-size"),
        (["estimate", "gtp", "-b", "2"], "did you mean 'gpt'"),
        (["estimate", "mlp", "-b", "2", "--device", "A100-45GB"], "A100-40GB"),
        (["estimate", "mlp", "-b", "2", "--device", "24XB"], "capacity"),
        (["estimate", "mlp", "-b", "2", "--precision", "fp8"], "precision"),
        (["estimate", "mlp", "-b", "x"], "batch-size"),
        (["plan", "mlp", "-g", "0", "--device", "1GiB"], "global batch"),
        (["plan", "mlp", "-g", "2", "--gpus", "3", "--device", "1GiB"], "GPUs"),
        (["plan", "mlp", "-g", "8", "--gpus", "0", "--device", "1GiB"], "GPUs"),
        (["fit", "mlp", "--device", "cpu"], "capacity"),
        (["estimate", "nosuchmodule.x:y", "-b", "2"], "nosuchmodule"),
        (["estimate", "mlp", "-b", "2", "--checkpoint-blocks", "two"], "a number of blocks (12) or block indices"),
        (["fit", "mlp", "--checkpoint-blocks", "1", "--checkpointing"], "not both"),
        (["estimate", "mlp", "-b", "2", "--checkpointing=every"], "a number of blocks (12), block indices (0,4,8)"),
        (["estimate", "gpt", "-b", "2", "--checkpointing", "auto"], "does not choose checkpointing"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv: list[str], fragment: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchfit: error:"), err
    assert fragment in lines[0]
    assert "Traceback" not in err


def test_a_model_that_does_not_fit_at_batch_1(capsys) -> None:
    code, _, err = _run(
        capsys, "fit", "gpt", "--device", "T4", "--set", "n_layer=48", "--set", "n_embd=2048", "--set", "n_head=16"
    )
    assert code == 2
    assert "does not fit" in err and len(err.strip().splitlines()) == 1


def test_a_bare_batchfit_prints_the_help_and_succeeds(capsys) -> None:
    code, out, err = _run(capsys)
    assert code == 0 and err == ""
    assert out.startswith("Usage: batchfit") and "estimate" in out and "--version" in out


def test_version(capsys) -> None:
    assert _run(capsys, "--version") == (0, f"batchfit {batchfit.__version__}\n", "")
