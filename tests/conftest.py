"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def _a_share_of_the_cores_per_worker() -> None:
    """Under xdist, each worker's torch, and every process its tests start, runs on its share of the cores.

    Left alone, each of two workers on two cores runs torch's intra-op pool on both, and so do the ranks and
    commands the tests start: more threads than cores, whose parallel regions wait on threads the other
    worker's work has descheduled. A count the environment sets (``OMP_NUM_THREADS``) is kept; tests that
    need another set it themselves (``one_thread``; ``test_estimate_cpu_exact.py``'s intra-op tests run on two or more).
    """
    import os

    from batchfit.planning.workers import available_cores

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    share = max(1, available_cores() // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


_a_share_of_the_cores_per_worker()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run torch on one thread: tiny ops are faster so, and immune to other processes' load on the CPU."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary directory, shared by xdist's workers (the one above theirs): what one worker writes
    there, another finds."""
    import os

    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _trace_cache_dir(run_dir: Path) -> Iterator[None]:
    """The trace cache on disk lives in this session's temporary directory, never the user's; xdist's workers share
    one (``run_dir``: entries are written whole and renamed into place, and an unreadable one is traced again), so a
    step one worker traced is not traced again by the other."""
    cache = run_dir / "trace-cache"
    cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHFIT_CACHE_DIR", str(cache))
        yield


@pytest.fixture(scope="session", autouse=True)
def _plans_fit_one_configuration_at_a_time() -> Iterator[None]:
    """Plans do not fork (``planning/workers.py``) except where a test asks: two xdist workers already fill
    the machine, and tests count the steps a plan traces and the progress lines it shows."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHFIT_WORKERS", "1")
        yield


@pytest.fixture(scope="session", autouse=True)
def _fits_exact_against_the_allocator_model() -> Iterator[None]:
    """Fits answer with the allocator model alone (``BATCHFIT_KNOWN_ERRORS=0``), so that tests of the search
    compare it with ``estimate`` exactly; ``tests/test_fit_known_error.py`` and ``test_gpu_truth_rows.py``
    turn the measured errors back on, as a user has them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHFIT_KNOWN_ERRORS", "0")
        yield


@pytest.fixture(autouse=True)
def _fresh_trace_cache() -> None:
    """Each test starts with nothing cached in memory (the disk cache is per session, see above)."""
    from batchfit.memory.cache import CACHE

    CACHE.clear_memory()


@pytest.fixture(autouse=True)
def _collect_after_each_test_when_asked(request: pytest.FixtureRequest) -> Iterator[None]:
    """Debugging aid: with BATCHFIT_GC_EACH_TEST=1, collect garbage after each test, so that an object
    whose destruction crashes is found at the test that made it, not at some later collection."""
    import os

    yield
    if os.environ.get("BATCHFIT_GC_EACH_TEST") == "1":
        import gc
        import sys

        print(f"\n[gc after {request.node.nodeid}]", file=sys.stderr, flush=True)
        gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _long_lived_objects_frozen_between_modules() -> Iterator[None]:
    """After each test module, garbage is collected and what survives is frozen (``gc.freeze``).

    A worker that ran torch.compile (torchao's optimizers, compiled regions) holds a million long-lived
    objects of dynamo and sympy, and every full collection afterwards walked all of them: the Trainer's
    ``gc.collect()`` on each out-of-memory re-split made later tests several times slower in the suite
    than alone. Frozen objects are still alive; they are only left out of later collections.
    """
    import gc

    yield
    gc.collect()
    gc.freeze()
