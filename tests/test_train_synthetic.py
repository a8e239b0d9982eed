"""``train_synthetic`` from Python: exact across micro-batches, the sampler's items, resumable, silent."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import batchfit
from batchfit import ConfigError, TrainingRun, train_synthetic
from batchfit.batching import rank_shares
from batchfit.sources import load
from batchfit.train.sampler import GlobalBatchSampler
from batchfit.train.save_resume import read_checkpoint
from batchfit.train.synthetic import rank_sampler

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"hidden": 16, "depth": 1}


def _recording(seen: list[list[int]]) -> Any:
    """The small MLP, its items function noting the ids of every batch it builds."""
    workload = load("mlp", **SMALL)
    build = workload.items

    def items(ids: torch.Tensor, seed: int) -> Any:
        assert ids.dtype == torch.long
        seen.append(ids.tolist())
        return build(ids, seed)

    return dataclasses.replace(workload, items=items)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_runs_differing_only_in_the_micro_batch_end_with_the_same_weights(tmp_path: Path) -> None:
    weights = {}
    for micro in (12, 5, 1):
        run = train_synthetic(load("mlp", **SMALL), 12, micro_batch_size=micro, steps=3, dtype=torch.float64,
                              save=tmp_path / f"m{micro}.pt")  # fmt: skip
        assert run.dtype == "float64" and run.micro_batch_size == micro and run.saved == str(tmp_path / f"m{micro}.pt")
        assert [row["n_items"] for row in run.steps] == [12, 12, 12]
        weights[micro] = _weights(tmp_path / f"m{micro}.pt")
    assert all(t.dtype == torch.float64 for t in weights[12].values())
    for micro in (5, 1):
        for name, ref in weights[12].items():
            assert torch.allclose(weights[micro][name], ref, rtol=0, atol=1e-12 * ref.abs().max().item()), name


def test_each_step_takes_the_global_batch_the_sampler_gives(tmp_path: Path) -> None:
    seen: list[list[int]] = []
    ck = tmp_path / "ck.pt"
    train_synthetic(_recording(seen), 7, micro_batch_size=3, steps=3, checkpoint=ck)
    sampler = GlobalBatchSampler(21, 7, rank=0, world_size=1, shuffle=False)
    assert seen == list(sampler) == [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20]]
    assert read_checkpoint(ck)["extra"]["items"] == seen


@pytest.mark.parametrize(
    ("global_batch_size", "world_size", "tensor_parallel"),
    [(7, 1, 1), (7, 2, 1), (10, 3, 1), (31, 4, 1), (5, 2, 2), (9, 4, 2), (13, 6, 3), (4, 4, 1)],
)
def test_every_rank_takes_its_contiguous_share_of_ids_t_g_onwards(
    global_batch_size: int, world_size: int, tensor_parallel: int
) -> None:
    g, steps = global_batch_size, 4
    groups = world_size // tensor_parallel
    shares = rank_shares(g, groups)
    for rank in range(world_size):
        group = rank // tensor_parallel  # the ranks of a tensor-parallel group take the same items
        first = sum(shares[:group])
        expect = [list(range(t * g + first, t * g + first + shares[group])) for t in range(steps)]
        assert list(rank_sampler(rank, world_size, g, steps, tensor_parallel)) == expect
        resumed = rank_sampler(rank, world_size, g, steps, tensor_parallel)
        resumed.position = 2
        assert list(resumed) == expect[2:]


def test_a_resume_continues_with_the_same_items_and_ends_with_the_same_weights(tmp_path: Path) -> None:
    common: dict[str, Any] = {"micro_batch_size": 3, "dtype": torch.float64, "name": "mlp"}
    whole: list[list[int]] = []
    train_synthetic(_recording(whole), 6, steps=4, save=tmp_path / "whole.pt", **common)

    ck, seen = tmp_path / "ck.pt", []
    first = train_synthetic(_recording(seen), 6, steps=2, checkpoint=ck, **common)
    assert first.resumed_from_step is None and read_checkpoint(ck)["step"] == 2
    rest = train_synthetic(_recording(seen), 6, steps=4, checkpoint=ck, save=tmp_path / "resumed.pt", **common)
    assert rest.resumed_from_step == 2 and [row["step"] for row in rest.steps] == [2, 3]
    assert seen == whole == [list(range(6 * t, 6 * t + 6)) for t in range(4)]
    assert read_checkpoint(ck)["extra"]["items"] == whole
    resumed, expected = _weights(tmp_path / "resumed.pt"), _weights(tmp_path / "whole.pt")
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)

    done = train_synthetic(_recording(seen), 6, steps=4, checkpoint=ck, **common)  # nothing left to run
    assert len(seen) == 4 and done.resumed_from_step == 4 and done.micro_batch_size is None


def test_steps_are_reported_as_they_finish_and_nothing_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    events: list[Any] = []
    run = train_synthetic("mlp", 8, micro_batch_size=4, steps=2, on_start=lambda: events.append("start"),
                          on_step=events.append)  # fmt: skip
    assert events == ["start", *run.steps] and [row["step"] for row in run.steps] == [0, 1]
    assert run.steps[0]["micro_batch_sizes"] == [4, 4] and run.final_loss == run.steps[-1]["loss"]
    assert isinstance(run, TrainingRun) and run.rank == 0 and run.preset == "mlp" and run.world_size == 1
    assert capsys.readouterr() == ("", "")


def test_the_summary_is_what_batchfit_train_json_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from batchfit.cli import main

    assert main(["train", "mlp", "-g", "8", "-m", "3", "-n", "2", "--set", "hidden=16", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    ours = json.loads(json.dumps(train_synthetic(load("mlp", hidden=16), 8, micro_batch_size=3, steps=2,
                                                 name="mlp").to_dict(), default=str))  # fmt: skip
    for summary in (cli, ours):
        for row in summary["steps"]:
            assert row.pop("seconds") > 0 and row.pop("items_per_s") > 0
    assert list(ours) == list(cli) and ours == cli


def test_it_is_exported_lazily() -> None:
    assert "train_synthetic" in batchfit.__all__ and "TrainingRun" in batchfit.__all__
    assert batchfit.train_synthetic is train_synthetic


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch_size": 0}, "global_batch_size must be a whole number >= 1, got 0"),
        ({"steps": 0}, "steps must be a whole number >= 1, got 0"),
        ({"dtype": torch.float16}, "dtype must be torch.float32 or torch.float64"),
        ({"dtype": torch.float64, "precision": "bf16"}, "use it with precision='fp32'"),
        ({"device": torch.device("cpu")}, "device must be a name: 'cpu', 'cuda[:N]' or a simulated GPU"),
        ({"save": "/nonexistent/dir/w.pt"}, "directory '/nonexistent/dir' does not exist"),
        ({"workload": 3}, "expected a Workload or a preset name, got int"),
        ({"workload": dataclasses.replace(load("mlp"), items=None)}, "has no synthetic items (Workload.items)"),
        ({"micro_batch_size": 9}, "micro_batch_size 9 exceeds global_batch_size 8"),
        ({"device": "simulated:"}, "needs a GPU name or a capacity"),
    ],
)
def test_bad_arguments_are_one_config_error(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"workload": "mlp", "global_batch_size": 8, "steps": 1, **kwargs}
    with pytest.raises(ConfigError) as info:
        train_synthetic(args.pop("workload"), args.pop("global_batch_size"), **args)
    assert match in str(info.value) and "\n" not in str(info.value)
