"""Ranks of a torchrun job forked from a warm fork server; ``batchfit`` as a new process would run it, in this one.

A ``torchrun --nproc_per_node=2`` of ``python -m batchfit train`` takes about 11 s, nearly all of it start-up:
the agent imports torch (~3 s), each worker imports torch (~3 s) and torch._dynamo (~2.4 s, which torch.optim's
first ``add_param_group`` pulls in), then trains for a tenth of a second. Here one fork server
(``multiprocessing``'s "forkserver", started with OMP_NUM_THREADS=1) imports those modules once per test process,
single-threaded, and each rank is a process forked from it: it starts in milliseconds.

A rank gets the environment torchrun gives its workers (``LocalElasticAgent._start_workers``) over the test's own
at the call: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_NAME, GROUP_WORLD_SIZE,
ROLE_WORLD_SIZE, MASTER_ADDR (127.0.0.1), MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE, TORCHELASTIC_SIGNALS_TO_HANDLE,
TORCH_NCCL_ASYNC_ERROR_HANDLING and OMP_NUM_THREADS=1 (and ``torch.set_num_threads(1)``); ``tests/test_launch.py``
compares them with a real torchrun's. Its working directory and ``sys.path`` are the test's. As torchrun does by
default, the launching process (here the test's, as torchrun's agent) hosts the job's TCPStore on a port the kernel
picks and every rank joins it as a client (TORCHELASTIC_USE_AGENT_STORE=True): no free port is guessed, so none can be
taken by another process in between. ``launched_by_torchrun()``, ``init_process_group`` (env://), Lightning's
and accelerate's detection of torchrun all take the path they take under torchrun.

A rank writes its stdout and stderr to files of its own. The result is shaped like ``subprocess.CompletedProcess``
of the torchrun command: ``stdout`` and ``stderr`` are the ranks' one after the other in rank order (torchrun's
workers write to its own streams; a test that parses stdout reads what rank 0 alone prints), and ``returncode``
is 0 when every rank exited 0, else the code of the first rank that failed (a ``SystemExit``'s code, 1 for an
uncaught exception, whose traceback is on its stderr, -N for signal N; torchrun itself exits with 1);
``ranks`` holds each rank's own. As
torchrun does, once a rank fails the others are stopped (SIGTERM, then SIGKILL). Every wait has a deadline:
past it every rank is killed and the test fails with their stderr.

What this does not run, on purpose: torchrun itself (its agent, rendezvous, restarts), a rank's interpreter
teardown (a rank flushes its streams and leaves with ``os._exit``, as ``multiprocessing``'s children do) and the
imports the server made for it (what they print, once, is not on a rank's stderr). Tests whose point is one of
those run the real torchrun.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest

TIMEOUT_S = 300.0
"""The longest a launch may take before its ranks are killed and the test fails."""
STOP_GRACE_S = 5.0
"""How long the other ranks get after SIGTERM, once one has failed, before SIGKILL."""
PRELOAD = (
    "torch",
    "torch._dynamo",  # torch.optim's first add_param_group imports it: 2.4 s a process
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp.sharded_grad_scaler",
    "torch._subclasses.schema_check_mode",
    "torch.profiler",
    "batchfit.cli",
    "batchfit.cli.train",
    "batchfit.models.gpt",
    "batchfit.models.mlp",
    "batchfit.memory.trace.model_parallel",
    "batchfit.memory.trace.tp_plan",
    "batchfit.sources.hf_tasks",
    "batchfit.sources.hub",  # pydantic
    "batchfit.sources.lora",
    "batchfit.sources.quant",
    "batchfit.train.synthetic",
    "batchfit.train.trainer",
    "batchfit.train.fsdp",
    "batchfit.train.tensor_parallel",
    "launch",  # this module: what each rank runs first
)
"""What the fork server imports before it forks anything: what the ranks of the tests import. A launch whose ranks
import more names it (``preload``, e.g. ``LIBRARIES``): the server is then restarted with it, once, rather than
every test process paying for modules only a few tests use."""

LIBRARIES = (
    "transformers",
    "transformers.models.llama.modeling_llama",
    "batchfit.integrations.transformers",
    "lightning.pytorch",
    "batchfit.integrations.lightning",
)
"""``preload`` for ranks that load a transformers model or train with Lightning: 3 to 9 s a process, about 6 s more
for the server. One set for both (Lightning imports most of what transformers does): a test process restarts its
server once at most."""

_CONTEXT = multiprocessing.get_context("forkserver")
_preloaded: tuple[str, ...] = ()


class Ranks(subprocess.CompletedProcess):
    """What torchrun's command would have given (``returncode``, ``stdout``, ``stderr``) and each rank's (``ranks``)."""

    def __init__(self, args: list[str], ranks: list[subprocess.CompletedProcess], returncode: int) -> None:
        stdout = "".join(r.stdout for r in ranks)
        stderr = "".join(r.stderr for r in ranks)
        super().__init__(args, returncode, stdout, stderr)
        self.ranks = ranks


# Each takes the options ``timeout`` (seconds; ``TIMEOUT_S``), ``env`` (more environment for the ranks) and
# ``preload`` (modules the ranks import beyond ``PRELOAD``).
def run_cli(nproc: int, *argv: str, **options: Any) -> Ranks:
    """``torchrun --nproc_per_node=NPROC -m batchfit ARGV``: each rank runs ``batchfit.cli.main(ARGV)`` and exits
    with what it returns, as ``python -m batchfit`` does."""
    return _launch(nproc, ("cli", "batchfit", list(argv)), ["-m", "batchfit", *argv], **options)


def run_script(nproc: int, script: str | Path, *argv: str, **options: Any) -> Ranks:
    """``torchrun --nproc_per_node=NPROC SCRIPT ARGV``: each rank runs the file as ``__main__`` with that
    ``sys.argv``, its folder first on ``sys.path``."""
    return _launch(nproc, ("script", str(script), list(argv)), [str(script), *argv], **options)


def run_function(nproc: int, function: Callable[..., Any], *args: Any, **options: Any) -> Ranks:
    """``function(*args)`` on each rank (a module-level function: it is pickled by name)."""
    name = f"{function.__module__}.{function.__qualname__}"
    return _launch(nproc, ("function", function, list(args)), [name, *map(str, args)], **options)


# -- the fork server ---------------------------------------------------------------------------------------------
def _ensure_server(extra: Sequence[str]) -> None:
    """The fork server running with ``PRELOAD`` and ``extra`` imported: started with them, or restarted with them
    and what it had where it lacks one."""
    global _preloaded
    wanted = tuple(dict.fromkeys((*PRELOAD, *_preloaded, *extra)))
    server = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is not None and wanted != _preloaded:
        server._stop()  # no rank is alive between launches: it exits at once
    _CONTEXT.set_forkserver_preload(list(wanted))
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read once, when torch loads OpenMP: the ranks' threads are set there
    try:
        forkserver.ensure_running()  # a no-op while it runs (it restarts one that died)
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    _preloaded = wanted


def _server_threads() -> int:
    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    return len(os.listdir(f"/proc/{pid}/task")) if pid is not None and os.path.isdir(f"/proc/{pid}") else 1


# -- one rank ----------------------------------------------------------------------------------------------------
def _die_with_the_fork_server() -> None:
    """SIGKILL this rank when the fork server, its parent, exits: it does when the test process does, once no
    rank keeps it alive (each rank is handed the pipe that keeps it: closed here)."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _streams_to(stdout: str, stderr: str) -> None:
    """File descriptors 1 and 2 (what C++ writes too) to the rank's files, and new ``sys`` streams over them, as
    an interpreter whose output is not a terminal opens them (nothing the fork server buffered comes along)."""
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )


def _rank(env: dict[str, str], stdout: str, stderr: str, target: tuple[str, Any, list[Any]]) -> None:
    """One rank, in the process forked for it: its streams, its environment, then the target."""
    _die_with_the_fork_server()
    _streams_to(stdout, stderr)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    kind, what, args = target
    try:
        if kind == "cli":
            from batchfit.cli import main

            sys.argv = ["batchfit", *args]
            sys.exit(main(list(args)))
        elif kind == "script":
            sys.argv = [what, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(what)))
            runpy.run_path(what, run_name="__main__")
        else:
            what(*args)
    except SystemExit:
        raise
    except BaseException:  # as the interpreter ends on an uncaught exception: its traceback, exit status 1
        traceback.print_exc()
        sys.exit(1)


# -- the launch --------------------------------------------------------------------------------------------------
def _torchrun_environment(rank: int, nproc: int, port: int, run_id: str, folder: str) -> dict[str, str]:
    """What torchrun adds to a worker's environment (one node, ``--standalone``, no restarts)."""
    return {
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LOCAL_RANK": str(rank),
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_ERROR_FILE": os.path.join(folder, f"{rank}.error.json"),  # where ``@record`` writes
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",  # torchrun's own, inherited
    }


def _launch(
    nproc: int,
    target: tuple[str, Any, list[Any]],
    shown: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
    preload: Sequence[str] = (),
) -> Ranks:
    from torch.distributed import TCPStore

    _ensure_server(preload)
    args = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", *shown]
    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    run_id = str(uuid.uuid4())
    base = {**os.environ, **(env or {})}
    folder = tempfile.mkdtemp(prefix="ranks-")
    files = [(os.path.join(folder, f"{r}.out"), os.path.join(folder, f"{r}.err")) for r in range(nproc)]
    processes: list[Any] = []
    try:
        for rank in range(nproc):
            rank_env = {**base, **_torchrun_environment(rank, nproc, store.port, run_id, folder)}
            process = _CONTEXT.Process(target=_rank, args=(rank_env, *files[rank], target), name=f"rank {rank}")
            process.start()
            processes.append(process)
        threads = _server_threads()
        codes, failed, timed_out = _wait(processes, timeout)
    finally:
        for process in processes:
            if process.exitcode is None:
                process.kill()
            process.join()
        ranks = [subprocess.CompletedProcess(args, p.exitcode, _read(out), _read(err))
                 for p, (out, err) in zip(processes, files)]  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)
        del store
    if timed_out:
        pytest.fail(f"{' '.join(args)}: no result in {timeout:.0f} s; every rank killed\n" + _stderr_tails(ranks))
    if threads != 1:
        pytest.fail(f"the fork server runs {threads} threads: a rank forked from it may hold another thread's lock")
    return Ranks(args, ranks, 0 if failed is None else codes[failed])


def _wait(processes: list[Any], timeout: float) -> tuple[list[int | None], int | None, bool]:
    """Wait for every rank: their exit codes, the first that failed (None: none), whether time ran out.

    As torchrun: once a rank fails, the others are sent SIGTERM, and SIGKILL ``STOP_GRACE_S`` later."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * len(processes)
    waiting = {p.sentinel: rank for rank, p in enumerate(processes)}
    failed: int | None = None
    kill_at: float | None = None
    while waiting:
        now = time.monotonic()
        if now >= deadline:
            return codes, failed, True
        if kill_at is not None and now >= kill_at:
            for rank in waiting.values():
                processes[rank].kill()
            kill_at = None
        until = deadline if kill_at is None else min(deadline, kill_at)
        for sentinel in sorted(multiprocessing.connection.wait(list(waiting), until - now), key=waiting.get):
            rank = waiting.pop(sentinel)
            processes[rank].join()
            codes[rank] = processes[rank].exitcode
            if codes[rank] != 0 and failed is None:
                failed = rank
                for other in waiting.values():
                    processes[other].terminate()
                kill_at = time.monotonic() + STOP_GRACE_S
    return codes, failed, False


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def _stderr_tails(ranks: list[subprocess.CompletedProcess], chars: int = 3000) -> str:
    return "".join(f"--- rank {r} (exit {done.returncode}) stderr ---\n{done.stderr[-chars:]}\n"
                   for r, done in enumerate(ranks))  # fmt: skip


# -- one process, this one ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def as_a_new_process() -> Iterator[None]:
    """While active, what reaches stderr is what a new interpreter would print there, and torch runs on one thread
    (as under OMP_NUM_THREADS=1): warnings are shown with Python's default filters instead of collected by pytest,
    and log records that no handler of the program takes reach logging's last resort (stderr) instead of pytest's
    log capture. So an assertion on a command's stderr (one line, say) is as strict as on a new process's."""
    import torch

    root = logging.getLogger()
    handlers, level, threads = root.handlers[:], root.level, torch.get_num_threads()

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.resetwarnings()  # then Python's default filters, as a new interpreter without -W has them
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category, append=True)
        warnings.showwarning = show
        root.handlers[:] = []
        root.setLevel(logging.WARNING)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            root.handlers[:] = handlers
            root.setLevel(level)


def batchfit_here(capfd: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    """``python -m batchfit ARGV`` run in this process (``batchfit.cli.main``): its exit code and what it wrote
    (``capfd``: file descriptors too), for tests of what the command does rather than of a new process."""
    from batchfit.cli import main

    capfd.readouterr()
    with as_a_new_process():
        try:
            code = main(list(argv))
        except SystemExit as exc:  # as the interpreter turns one into the exit status
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["batchfit", *argv], code, out, err)
