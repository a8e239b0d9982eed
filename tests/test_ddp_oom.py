"""Two processes (DDP, gloo): one rank runs out of memory mid-window, and neither hangs.

Each run is ``tests/ddp_oom_worker.py`` on two ranks started as ``torchrun --standalone --nproc_per_node=2``
would start them, forked from a warm fork server (``tests/launch.py``: what is tested is the trainer on
several ranks, not the launcher), with a timeout on the wait. Rank 1 alone fails, where a scenario says;
both ranks must then go on with a consistent plan (the smallest micro-batch size any of them needed,
from the next step), their parameters equal to the full-batch reference (float64) and every item used
once, or both stop with the same one-line error.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from launch import run_script

TIMEOUT_S = 180
WORKER = Path(__file__).with_name("ddp_oom_worker.py")
G, STEPS = 24, 2


def _torchrun(out: Path, scenarios: str) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    done = run_script(2, WORKER, str(out), scenarios, timeout=TIMEOUT_S)
    reports = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    return done, reports


def _each_item_once(uses: list[list[float]]) -> bool:
    expected = [[1.0 if t * G <= i < (t + 1) * G else 0.0 for i in range(G * STEPS)] for t in range(STEPS)]
    return len(uses) == STEPS and all(abs(u - e) <= 1e-12 for us, es in zip(uses, expected) for u, e in zip(us, es))


@pytest.mark.slow
def test_one_rank_out_of_memory_mid_window(tmp_path: Path) -> None:
    done, (rank0, rank1) = _torchrun(tmp_path / "r", "forward,backward,last-forward,one-item,simulated")
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 1 re-splits alone ([4, 4, 4] planned); from the next step both ranks use its smaller size
    expected_rank1 = {
        "forward": [[4, 2, 2, 2, 2], [2] * 6],  # the second micro-batch's forward: items 4-11 re-split
        "backward": [[2] * 6, [2] * 6],  # the second micro-batch's backward: the window redone
        "last-forward": [[4, 4, 2, 2], [2] * 6],  # the last one, before it synchronises
        "simulated": [[4] + [1] * 8, [1] * 12],  # 48 MiB: 4 items, then 2, do not fit beside the gradients
    }
    for scenario, sizes in expected_rank1.items():
        a, b = rank0[scenario], rank1[scenario]
        assert a["error"] is None and b["error"] is None, (scenario, a["error"], b["error"])
        assert b["sizes"] == sizes, scenario
        micro = sizes[-1][0]
        assert a["sizes"] == [[4, 4, 4], [micro] * (12 // micro)], scenario
        assert a["micro"] == b["micro"] == [micro, micro], scenario
        assert b["replanned"][0] >= 1 and a["replanned"] == [0, 0] and b["replanned"][1] == 0, scenario
        assert a["max_rel_diff"] <= 1e-12 and b["max_rel_diff"] <= 1e-12, scenario
        assert _each_item_once(a["uses"]) and _each_item_once(b["uses"]), scenario
    # one item does not fit on rank 1: both ranks stop with its error, word for word
    a, b = rank0["one-item"]["error"], rank1["one-item"]["error"]
    assert a == b and a["type"] == "DoesNotFitError" and "\n" not in a["message"]
    assert a["message"].startswith("rank 1: one item does not fit on cpu: out of memory in the forward pass")


@pytest.mark.slow
def test_an_oom_in_the_synchronising_backward_stops_both_ranks(tmp_path: Path) -> None:
    """Its all-reduce has started, so rank 1 cannot redo it: one line naming a smaller micro-batch; rank 0,
    waiting in that all-reduce, is released when rank 1 leaves (not by the group's 30 s timeout)."""
    done, (rank0, rank1) = _torchrun(tmp_path / "s", "sync-backward")
    assert done.returncode == 0, done.stderr[-3000:]
    error = rank1["sync-backward"]["error"]
    assert error["type"] == "MicroBatchOutOfMemory" and "DoesNotFitError" in error["mro"]
    assert error["message"].startswith("out of memory on cpu in the synchronising backward of a micro-batch of 4")
    assert error["message"].endswith("restart with a micro-batch size of at most 2") and "\n" not in error["message"]
    stopped = rank0["sync-backward"]["error"]
    # gloo reads the peer's end as a close or a reset, as the timing falls; either way not its timeout
    assert stopped is not None and re.search(r"Connection (closed|reset) by peer", stopped["message"])
    assert "timed out" not in stopped["message"].lower()
