"""``benchmarks/cudnn_rnn_sizes.py`` without a GPU: its one-line exit, the descriptor it sets, the algorithm it asks
about, its grid, and how it reads a real call's workspaces."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sizes() -> ModuleType:
    return load_benchmark("cudnn_rnn_sizes")


def test_without_a_gpu_it_says_so_in_one_line(sizes: ModuleType, capsys, monkeypatch, tmp_path: Path) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sizes.main(["--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("cudnn_rnn_sizes: no CUDA GPU is visible here")
    assert not (tmp_path / "out").exists()


def test_descriptor_is_set_as_pytorch_sets_it(sizes: ModuleType) -> None:
    """``RNNDescriptor::set``: the input's dtype as data type, float math precision, tensor-op math for fp16 and
    FMA for fp32 without TF32, double bias, the projection's width where there is one, else the hidden size."""
    p = {"mode": "LSTM", "dtype": "bf16", "input": 300, "hidden": 512, "proj": 0, "layers": 2, "bidirectional": True,
         "batch": 8, "seq": 16}  # fmt: skip
    assert sizes.descriptor_args(p, sizes.STANDARD) == (0, 2, 2, 1, 0, 9, 0, 0, 300, 512, 512, 2)
    assert sizes.descriptor_args({**p, "dtype": "fp16"}, 0)[5:8] == (2, 0, sizes.TENSOR_OP_MATH)
    assert sizes.descriptor_args({**p, "dtype": "fp32"}, 0, allow_tf32=False)[5:8] == (0, 0, sizes.FMA_MATH)
    assert sizes.descriptor_args({**p, "dtype": "fp32"}, 0)[7] == sizes.DEFAULT_MATH
    assert sizes.descriptor_args({**p, "proj": 128}, 0)[10] == 128
    assert sizes.descriptor_args({**p, "mode": "GRU"}, 3)[:2] == (3, 3)


def test_algorithm_is_the_one_pytorch_picks(sizes: ModuleType) -> None:
    """``get_algo`` on an H200: persistent small-H kernels up to 192 (LSTM, GRU) or 384 (RNN) forward and 128 / 256
    backward; fp16 one-layer stacks of multiples of 128 with a batch of a multiple of 8 up to 128 persistent; a
    projection always standard."""
    lstm = {"mode": "LSTM", "dtype": "fp32", "input": 512, "hidden": 192, "proj": 0, "layers": 1,
            "bidirectional": False, "batch": 64, "seq": 100}  # fmt: skip
    assert sizes.torch_algo(lstm, True) == sizes.PERSIST_STATIC_SMALL_H
    assert sizes.torch_algo(lstm, False) == sizes.STANDARD
    assert sizes.torch_algo({**lstm, "mode": "RNN_TANH", "hidden": 300}, True) == sizes.PERSIST_STATIC_SMALL_H
    assert sizes.torch_algo({**lstm, "mode": "RNN_TANH", "hidden": 300}, False) == sizes.STANDARD
    fp16 = {**lstm, "dtype": "fp16", "hidden": 512}
    assert sizes.torch_algo(fp16, True) == sizes.PERSIST_STATIC
    assert sizes.torch_algo({**fp16, "batch": 136}, True) == sizes.STANDARD
    assert sizes.torch_algo({**fp16, "mode": "GRU"}, True) == sizes.STANDARD
    assert sizes.torch_algo({**fp16, "layers": 2}, True) == sizes.STANDARD
    assert sizes.torch_algo({**lstm, "hidden": 64, "proj": 32}, True) == sizes.STANDARD


def test_grid_is_deterministic_and_valid(sizes: ModuleType) -> None:
    first = list(itertools.islice(sizes.problems(3), 60000))
    assert first == list(itertools.islice(sizes.problems(3), 60000))
    for p in first:
        assert p["mode"] in sizes.MODES and p["dtype"] in sizes.DTYPES
        assert min(p["input"], p["hidden"], p["layers"], p["batch"], p["seq"]) >= 1
        assert 0 <= p["proj"] < p["hidden"] and (not p["proj"] or p["mode"] == "LSTM")
    seqs = {p["seq"] for p in first if p["mode"] == "LSTM" and p["dtype"] == "fp32"}
    assert {288, 320, 384, 480} <= seqs  # steps in the regime the recorded sample left open (257-511)


def test_real_workspaces_are_read_from_a_recorded_step(sizes: ModuleType) -> None:
    """The first recorded problem (LSTM 512 -> 512, fp32, batch 1 x 128 steps): one 18,372,896-byte workspace in the
    forward and two in the backward."""
    path = ROOT / "benchmarks/results/cudnn-H200-2026-11-28/rnn_events.jsonl.gz"
    with gzip.open(path, "rt") as f:
        row = json.loads(f.readline())
    assert sizes._real_workspaces(row["calls"][1]) == [18372896] * 3
