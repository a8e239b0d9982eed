"""A plan's configurations fitted ahead in forked processes (``planning/workers.py``): the same plan, the same
count of traced steps, and a child that fails or hangs costs time, never the answer."""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

import batchfit
from batchfit import presets
from batchfit.errors import ConfigError
from batchfit.memory.cache import CACHE
from batchfit.planning import workers

WL = presets.get("gpt", n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=16)


def _plan(tmp: Path, monkeypatch: pytest.MonkeyPatch, workers: int) -> tuple[dict[str, Any], int, list[str]]:
    """The plan's every field, the steps traced for it (children's included) and its progress lines."""
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp))  # cold: nothing traced before
    CACHE.clear_memory()
    lines: list[str] = []
    misses = CACHE.misses
    p = batchfit.plan(WL, 64, device="410MiB", workers=workers, progress=lines.append)
    return p.to_dict(), CACHE.misses - misses, lines


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int, list[str]]:
    with pytest.MonkeyPatch.context() as mp:
        return _plan(tmp_path_factory.mktemp("serial"), mp, workers=1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fitting ahead forks")
def test_fitting_ahead_gives_the_same_plan_and_counts_the_same_steps(
    serial: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _needs_children()
    plan, traced, lines = _plan(tmp_path, monkeypatch, workers=4)
    assert lines[0] == "fitting 3 more configurations in 3 other processes"
    assert len(serial[2]) == serial[1] == 10  # one line per traced step when the plan traces them all
    assert (plan, traced) == serial[:2]


def _needs_children() -> None:
    """Skip where this process's children cannot run autograd, so nothing is fitted ahead (a CUDA build of torch,
    after the serial plan's steps: NOTE [ Autograd in a forked child ] in ``planning/workers.py``)."""
    if not workers.autograd_in_a_child():
        pytest.skip("a child forked by this process cannot run autograd (a CUDA build of torch, after a GPU step)")


def test_a_forked_child_tells_a_function_that_returns_from_one_that_raises() -> None:
    def raises() -> None:
        raise RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing")

    assert workers.forked_child_runs(lambda: None) is True
    assert workers.forked_child_runs(raises) is False


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fitting ahead forks")
def test_nothing_is_forked_where_a_child_could_not_run_autograd(
    serial: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan fits every configuration itself, says nothing of other processes, and traces what the serial plan
    traces (each child would have traced a forward and failed its backward)."""
    monkeypatch.setattr(workers, "autograd_in_a_child", lambda: False)
    plan, traced, lines = _plan(tmp_path, monkeypatch, workers=4)
    assert (plan, traced, lines) == serial


def _in_children_only(monkeypatch: pytest.MonkeyPatch, misbehave: Any) -> None:
    """Make the plan's ``_fit_config`` ``misbehave`` in a forked child; the plan's own process is untouched."""
    plan_module = importlib.import_module("batchfit.planning.plan")  # the module (``batchfit.plan`` is the function)
    parent, real = os.getpid(), plan_module._fit_config

    def fit_config(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() != parent:
            misbehave()
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_module, "_fit_config", fit_config)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fitting ahead forks")
def test_a_child_that_fails_leaves_its_configurations_to_the_plan(
    serial: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail() -> None:
        raise RuntimeError("a child's failure")

    _in_children_only(monkeypatch, fail)
    plan, traced, _ = _plan(tmp_path, monkeypatch, workers=2)
    assert (plan, traced) == serial[:2]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fitting ahead forks")
def test_the_plan_fits_the_last_configurations_while_a_child_is_busy(
    serial: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One child, slow to start: the plan's process does its first configuration, finds the second
    taken, and fits the last ones itself (their traced steps appear in its progress) instead of waiting."""
    _needs_children()
    _in_children_only(monkeypatch, lambda: time.sleep(2))
    plan, traced, lines = _plan(tmp_path, monkeypatch, workers=2)
    assert (plan, traced) == serial[:2]
    first = serial[2][0].split(":")[0]
    assert {line.split(":")[0] for line in lines[1:]} - {first}, lines


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fitting ahead forks")
def test_a_child_that_hangs_is_stopped_and_the_plan_fits_its_configurations(
    serial: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_children_only(monkeypatch, lambda: time.sleep(3600))
    monkeypatch.setattr(workers, "MIN_WAIT_S", 1.0)
    monkeypatch.setattr(workers, "CHILD_PATIENCE", 0.0)
    start = time.monotonic()
    plan, traced, _ = _plan(tmp_path, monkeypatch, workers=2)
    assert (plan, traced) == serial[:2]
    assert time.monotonic() - start < 600


def test_nothing_is_forked_without_a_disk_cache_to_bring_answers_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHFIT_CACHE", "0")
    with workers.fit_ahead(WL, ["a", "b", "c"], 4, lambda config: None) as ahead:
        assert ahead.children == 0


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_workers_must_be_a_whole_number(bad: Any) -> None:
    with pytest.raises(ConfigError, match="workers must be a whole number"):
        batchfit.plan(WL, 64, device="410MiB", workers=bad)


def test_workers_default_to_the_environment_then_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHFIT_WORKERS", "3")
    assert workers.resolve_workers(None) == 3
    monkeypatch.setenv("BATCHFIT_WORKERS", "many")
    with pytest.raises(ConfigError, match="BATCHFIT_WORKERS"):
        workers.resolve_workers(None)
    monkeypatch.delenv("BATCHFIT_WORKERS")
    assert workers.resolve_workers(None) >= 1
    assert workers.resolve_workers(2) == 2


class _BlockedStream:
    """A stream whose lock another thread holds for ever (as a display thread's may be at a fork)."""

    def write(self, text: str) -> int:
        import threading

        threading.Event().wait()
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fitting ahead forks")
def test_a_child_writes_nothing_to_the_parents_output(
    serial: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library warning in a child never touches the parent's streams: the children finish their
    configurations (each notes its process in a file) instead of waiting on a held stream lock."""
    _needs_children()
    import sys
    import warnings

    from batchfit.planning import workers as parallel

    done = tmp_path / "fitted-by"

    def warn() -> None:
        warnings.warn("a library's warning, shown once", UserWarning, stacklevel=1)
        print("a library's message", file=sys.stderr)
        with open(done, "a") as f:
            f.write(f"{os.getpid()}\n")

    _in_children_only(monkeypatch, warn)
    monkeypatch.setattr(parallel, "MIN_WAIT_S", 3.0)  # a blocked child is stopped soon (it would wait for ever)
    monkeypatch.setattr(sys, "stderr", _BlockedStream())
    plan, traced, _ = _plan(tmp_path / "cache", monkeypatch, workers=2)
    assert (plan, traced) == serial[:2]
    assert done.exists() and done.read_text().split()
