"""``tests/launch.py``, the forked ranks other tests train on: torchrun's environment, exit codes, output, deadlines.

The environment is compared with what a real ``torchrun --standalone`` gives its workers (a script that imports
nothing heavy: the agent's start-up, ~3 s, is the cost); the rest runs on ranks forked from the warm server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import run_function, run_script

ENV_DUMP = """
import json, os, sys
with open(f"{sys.argv[1]}.{os.environ['RANK']}", "w") as f:
    json.dump(dict(os.environ), f)
"""
PER_RUN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
"""Variables whose values belong to one run (their names must still be there)."""


def test_a_rank_gets_the_environment_torchrun_gives(tmp_path: Path) -> None:
    script = tmp_path / "env_dump.py"
    script.write_text(ENV_DUMP)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torchrun then sets 1, as the ranks have
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(tmp_path / "real")], capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip
    assert real.returncode == 0, real.stderr[-3000:]
    forked = run_script(2, script, str(tmp_path / "forked"), timeout=60)
    assert forked.returncode == 0, forked.stderr[-3000:]
    runs = []
    for rank in (0, 1):
        want = json.loads((tmp_path / f"real.{rank}").read_text())
        got = json.loads((tmp_path / f"forked.{rank}").read_text())
        assert sorted(got) == sorted(want)
        assert {k: v for k, v in got.items() if k not in PER_RUN} == {k: v for k, v in want.items() if k not in PER_RUN}
        assert got["OMP_NUM_THREADS"] == "1" and got["MASTER_ADDR"] == "127.0.0.1"
        runs.append((got["MASTER_PORT"], got["TORCHELASTIC_RUN_ID"]))
    assert runs[0] == runs[1]  # one job


def _report(path: str) -> None:
    """Each rank: what it was started with, on stdout and in a file."""
    import torch
    import torch.distributed as dist

    from batchfit.train.distributed import init_distributed, launched_by_torchrun, shutdown

    place = init_distributed("cpu")
    total = torch.tensor([place.rank + 1])
    dist.all_reduce(total)
    seen = {"rank": place.rank, "world": place.world_size, "torchrun": launched_by_torchrun(),
            "elastic": dist.is_torchelastic_launched(), "threads": torch.get_num_threads(), "sum": total.item(),
            "cwd": os.getcwd()}  # fmt: skip
    Path(f"{path}.{place.rank}").write_text(json.dumps(seen))
    print(f"rank {place.rank} out")
    print(f"rank {place.rank} err", file=sys.stderr)
    shutdown(place)


def test_ranks_join_one_process_group_on_one_thread(tmp_path: Path) -> None:
    done = run_function(3, _report, str(tmp_path / "seen"), timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(3):
        seen = json.loads((tmp_path / f"seen.{rank}").read_text())
        assert seen == {"rank": rank, "world": 3, "torchrun": True, "elastic": True, "threads": 1, "sum": 6,
                        "cwd": os.getcwd()}  # fmt: skip
    assert done.stdout == "rank 0 out\nrank 1 out\nrank 2 out\n"  # each rank's, in rank order
    assert [r.stdout for r in done.ranks] == [f"rank {r} out\n" for r in range(3)]
    assert [r.stderr.splitlines()[-1] for r in done.ranks] == [f"rank {r} err" for r in range(3)]


def _fail_on_rank_1(how: str) -> None:
    """Rank 1 fails (``how``); rank 0 waits for it forever."""
    if os.environ["RANK"] == "1":
        print("rank 1 was here", file=sys.stderr)
        if how == "exit":
            sys.exit(3)
        raise ValueError("rank 1 raised")
    time.sleep(600)


@pytest.mark.parametrize(("how", "code"), [("exit", 3), ("raise", 1)])
def test_a_failed_rank_is_the_exit_code_and_stops_the_others(how: str, code: int) -> None:
    start = time.monotonic()
    done = run_function(2, _fail_on_rank_1, how, timeout=60)
    assert time.monotonic() - start < 30  # rank 0 was stopped, not waited for
    assert done.returncode == code and done.ranks[1].returncode == code
    assert done.ranks[0].returncode == -15  # SIGTERM, as torchrun stops the others
    assert "rank 1 was here" in done.stderr
    if how == "raise":
        assert done.ranks[1].stderr.rstrip().endswith("ValueError: rank 1 raised")
        assert "Traceback (most recent call last):" in done.ranks[1].stderr


def _hang(path: str) -> None:
    print(f"rank {os.environ['RANK']} hangs", file=sys.stderr)
    Path(f"{path}.{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(600)


def test_a_launch_past_its_deadline_kills_every_rank_and_fails_with_their_stderr(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_function(2, _hang, str(tmp_path / "pid"), timeout=3)
    assert time.monotonic() - start < 30
    message = str(failed.value)
    assert "no result in 3 s; every rank killed" in message
    assert "rank 0 hangs" in message and "rank 1 hangs" in message
    for rank in (0, 1):
        assert not Path(f"/proc/{(tmp_path / f'pid.{rank}').read_text()}").exists()
