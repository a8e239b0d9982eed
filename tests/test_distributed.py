"""Several processes (gloo on the CPU): the same weights as one process, across resumes and kills.

Every run is of ``batchfit train`` in float64 (or of ``tests/fsdp_worker.py``), with a timeout on every wait.
DDP by default; ``--shard`` (FSDP's ``fully_shard``) where named. What the tests check is what the training
code does on several ranks, so most runs start their ranks as torchrun would, but forked from a warm fork
server (``tests/launch.py``: the environment torchrun gives, in milliseconds instead of ~11 s of imports).
A real ``torchrun --standalone`` (``python -m torch.distributed.run``) runs where the launcher is part of
what is tested: the killed rank that torchrun restarts (``--max-restarts``), and one plain end-to-end run
(``test_two_processes_equal_one[30-torchrun]``). One process is ``batchfit.cli.main`` in this process
(``launch.batchfit_here``): nothing those tests check depends on a new process.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from launch import batchfit_here, run_cli, run_script

from batchfit.train.save_resume import read_checkpoint
from batchfit.train.synthetic import train_synthetic

TIMEOUT_S = 120
BASE = ["train", "mlp", "--dtype", "float64", "--micro-batch-size", "7", "--json"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # restarted workers must not read stale addresses
    return env


def _one_process(capfd: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    return batchfit_here(capfd, *BASE, *args)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The weights one process ends with (``train_synthetic``, as ``batchfit train`` runs it), trained here
    rather than in a new process, once per setting for the whole module: the runs the tests compare with."""
    folder = tmp_path_factory.mktemp("references")
    done: dict[tuple[int, int, int], Path] = {}

    def weights(global_batch_size: int, steps: int, micro: int = 7) -> Path:
        key = (global_batch_size, steps, micro)
        if key not in done:
            path = folder / f"g{global_batch_size}-s{steps}-m{micro}.pt"
            old = torch.get_num_threads()
            torch.set_num_threads(1)  # as the processes compared with it run (OMP_NUM_THREADS=1)
            try:
                train_synthetic("mlp", global_batch_size, micro_batch_size=micro, steps=steps, dtype=torch.float64,
                                save=path)  # fmt: skip
            finally:
                torch.set_num_threads(old)
            done[key] = path
        return done[key]

    return weights


def _torchrun(nproc: int, *args: str, restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}",
        "-m",
        "batchfit",
        *BASE,
        *args,
    ]


def _run_torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """A real torchrun of ``batchfit train``."""
    return subprocess.run(_torchrun(nproc, *args), capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())


def _run_forked(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``batchfit train`` on ``nproc`` ranks forked as torchrun would start them (``tests/launch.py``)."""
    return run_cli(nproc, *BASE, *args, timeout=TIMEOUT_S)


WORKER = Path(__file__).with_name("fsdp_worker.py")


def _max_rel_diff(a: Path, b: Path) -> float:
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sa.keys() == sb.keys()
    return max(((sa[k] - sb[k]).abs().max() / sa[k].abs().max().clamp_min(1e-300)).item() for k in sa)


@pytest.mark.parametrize(
    ("global_batch_size", "launch"), [(30, _run_torchrun), (31, _run_forked)], ids=["30-torchrun", "31-forked"]
)
def test_two_processes_equal_one(
    tmp_path: Path, global_batch_size: int, launch: Callable[..., subprocess.CompletedProcess],
    reference: Callable[..., Path]
) -> None:  # fmt: skip
    two = launch(2, "--global-batch-size", str(global_batch_size), "--steps", "4", "--save", str(tmp_path / "p2.pt"))
    assert two.returncode == 0, two.stderr[-2000:]
    assert _max_rel_diff(reference(global_batch_size, 4), tmp_path / "p2.pt") <= 1e-12


@pytest.mark.parametrize(("first", "second"), [(2, 1), (1, 2)])
def test_resume_on_another_world_size(
    tmp_path: Path, first: int, second: int, reference: Callable[..., Path], capfd: pytest.CaptureFixture
) -> None:
    ck = tmp_path / "ck.pt"

    def run(nproc: int, steps: int, *extra: str) -> subprocess.CompletedProcess:
        args = ("--global-batch-size", "31", "--steps", str(steps), "--checkpoint", str(ck), *extra)
        return _one_process(capfd, *args) if nproc == 1 else _run_forked(nproc, *args)

    a = run(first, 2)
    assert a.returncode == 0, a.stderr[-2000:]
    assert read_checkpoint(ck)["step"] == 2
    b = run(second, 4, "--save", str(tmp_path / "resumed.pt"))
    assert b.returncode == 0, b.stderr[-2000:]
    assert _max_rel_diff(reference(31, 4), tmp_path / "resumed.pt") <= 1e-12
    items = read_checkpoint(ck)["extra"]["items"]
    assert [sorted(step) for step in items] == [list(range(31 * t, 31 * (t + 1))) for t in range(4)]


def _worker_pids(parent: int) -> list[int]:
    """Children of the torchrun agent (its worker processes), from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent:
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("sharding", [["--shard"]], ids=["fsdp"])
def test_a_killed_rank_resumes_from_the_checkpoint(
    tmp_path: Path, sharding: list[str], reference: Callable[..., Path]
) -> None:
    """The agent restarts both ranks after one is killed, and they resume from the checkpoint (FSDP's sharded state;
    DDP's whole state resumes in ``test_resume_on_another_world_size``, on one process and two)."""
    steps = 12
    ck = tmp_path / "ck.pt"
    cmd = _torchrun(
        2,
        "--global-batch-size",
        "30",
        "--steps",
        str(steps),
        "--checkpoint",
        str(ck),
        "--save",
        str(tmp_path / "out.pt"),
        *sharding,
        restarts=1,
    )
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    killed = None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while killed is None and time.monotonic() < deadline and agent.poll() is None:
            try:
                progressed = ck.exists() and read_checkpoint(ck)["step"] >= 2
            except Exception:  # caught mid-rename: try again
                progressed = False
            workers = _worker_pids(agent.pid)
            if progressed and workers:
                killed = max(workers)
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.01)
        out, err = agent.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if agent.poll() is None:
            agent.kill()
    assert killed is not None, "the job finished before a worker could be killed"
    assert agent.returncode == 0, err[-3000:]
    assert _max_rel_diff(reference(30, steps), tmp_path / "out.pt") <= 1e-12
    items = read_checkpoint(ck)["extra"]["items"]
    assert len(items) == steps
    # Every step used exactly its global batch: no item lost, none used twice.
    assert [sorted(step) for step in items] == [list(range(30 * t, 30 * (t + 1))) for t in range(steps)]


def test_bad_checkpoints_and_world_sizes_are_one_line_and_overwrite_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    ck = tmp_path / "ck.pt"
    first = _one_process(capfd, "--global-batch-size", "8", "--steps", "1", "--checkpoint", str(ck))
    assert first.returncode == 0, first.stderr
    good = ck.read_bytes()

    other_model = _one_process(
        capfd, "--global-batch-size", "8", "--steps", "2", "--checkpoint", str(ck), "--set", "hidden=32"
    )
    assert other_model.returncode == 2
    assert other_model.stderr.strip().count("\n") == 0 and "another model" in other_model.stderr
    assert ck.read_bytes() == good

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good[: len(good) // 3])
    cut = _one_process(capfd, "--global-batch-size", "8", "--steps", "2", "--checkpoint", str(truncated))
    assert cut.returncode == 2 and "unreadable" in cut.stderr and cut.stderr.strip().count("\n") == 0
    assert truncated.read_bytes() == good[: len(good) // 3]

    too_many = _run_forked(2, "--global-batch-size", "1", "--steps", "1")
    assert too_many.returncode != 0
    assert "cannot share a global batch of 1" in too_many.stderr


# -- FSDP (fully_shard) --------------------------------------------------------------------------------
@pytest.mark.parametrize(("global_batch_size", "micro"), [(31, 7), (5, 1)])
def test_sharded_training_equals_one_process(
    tmp_path: Path, global_batch_size: int, micro: int, reference: Callable[..., Path]
) -> None:
    """G=31, micro 7: shares 16/15 split 6+5+5 / 5+5+5; G=5, micro 1: rank 1 ends with a padding piece."""
    args = ("--global-batch-size", str(global_batch_size), "--micro-batch-size", str(micro), "--steps", "3")
    two = _run_forked(2, *args, "--shard", "--save", str(tmp_path / "p2.pt"))
    assert two.returncode == 0, two.stderr[-2000:]
    summary = json.loads(two.stdout)
    assert summary["sharded"] and summary["world_size"] == 2
    assert _max_rel_diff(reference(global_batch_size, 3, micro), tmp_path / "p2.pt") <= 1e-12


@pytest.mark.parametrize(
    ("first", "second"),
    [(["--shard"], []), ([], ["--shard", "--micro-batch-size", "auto"]), (["--shard"], ["--shard"])],
    ids=["fsdp-to-one", "one-to-fsdp-auto", "fsdp-to-fsdp"],  # the last loads into an already sharded model
)
def test_a_sharded_checkpoint_resumes_unsharded_and_back(
    tmp_path: Path, first: list[str], second: list[str], reference: Callable[..., Path], capfd: pytest.CaptureFixture
) -> None:
    """Checkpoints hold whole states whatever wrote them: FSDP on 2 ranks -> 1 process, and 1 -> FSDP on 2."""
    ck = tmp_path / "ck.pt"
    nprocs = [2 if "--shard" in first else 1, 2 if "--shard" in second else 1]
    runs = []
    for nproc, steps, extra in ((nprocs[0], 2, first), (nprocs[1], 4, second)):
        args = ("--global-batch-size", "9", "--steps", str(steps), "--checkpoint", str(ck), *extra)
        args += ("--save", str(tmp_path / "resumed.pt")) if steps == 4 else ()
        runs.append(_one_process(capfd, *args) if nproc == 1 else _run_forked(nproc, *args))
        assert runs[-1].returncode == 0, runs[-1].stderr[-2000:]
    saved = read_checkpoint(ck)
    assert saved["step"] == 4 and all(isinstance(k, int) for k in saved["optimizer"]["state"])
    assert _max_rel_diff(reference(9, 4), tmp_path / "resumed.pt") <= 1e-12


@pytest.mark.parametrize(("global_batch_size", "micro"), [(7, 2), (3, 1)])
def test_the_sharded_trainer_is_the_large_batch_by_hand(tmp_path: Path, global_batch_size: int, micro: int) -> None:
    """GPT with padded token losses, AdamW and clipping: FSDP on 2 ranks == one forward of the global batch.

    The noise scale's inputs too: under FSDP the small batch is the union of the ranks' first micro-batches.
    """
    out = tmp_path / "report.json"
    done = run_script(2, WORKER, str(out), str(global_batch_size), str(micro), "3", timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["sharded"] and report["dtensor_params"] and report["optimizer_holds_sharded"]
    assert report["max_rel_diff"] <= 1e-12
    assert report["fp16"]["scaler"] == "ShardedGradScaler" and len(set(report["fp16"]["scales"])) == 1
    assert report["decided"] == [10, 10] and report["refused"] == ["no plan here"] * 2  # rank 0's, on both
    assert report["simulated"].startswith("FSDP sharding does not run on a simulated 1.00 GiB GPU")
    sizes = report["micro_batch_sizes"]  # [rank][step]
    if micro == 1:  # shares 2 and 1: rank 1 joins the second micro-batch's collectives with a padding piece
        assert sizes == [[[1, 1]] * 3, [[1, 0]] * 3]
    else:  # shares 4 and 3
        assert sizes == [[[2, 2]] * 3, [[2, 1]] * 3]
    assert len(report["noise_calls"]) == len(report["noise_expected"]) == 3
    for got, want in zip(report["noise_calls"], report["noise_expected"]):
        assert got[1] == want[1] and got[3] == want[3]  # token counts of the small and the whole batch
        assert math.isclose(got[0], want[0], rel_tol=1e-10) and math.isclose(got[2], want[2], rel_tol=1e-10)
