"""A plan's configurations fitted side by side, in forked processes, where the machine has cores to spare.

A plan fits its configurations one after another (``plan.py``), each a few traced steps on one core.
Which configurations it will fit first is known before it starts: the first ``1 + ALTERNATIVES`` that
pass the state-only lower bound are each fitted unless one errs, and none depends on another. So
forked children take the others in order while the plan's own process fits the first and then takes
whichever no child has started, the last first (``FitAhead``: claims), and a child's results reach
the plan through the trace cache on disk (one file per entry, replaced atomically), where the plan's
own call for that configuration then finds them. Nothing else passes between them but the number of steps each child
traced, added to ``CACHE.misses``, and the blocks they traced and stood for, added to depth synthesis'
``STATS`` (a child stopped early reports none).

Only where it is safe and pays: Linux (``fork``), the disk cache on, a workload the cache can key, a child
that can run autograd (NOTE [ Autograd in a forked child ]), and more than one core (``workers``;
``BATCHFIT_WORKERS=1`` turns it off). A child that fails, or that keeps
the plan waiting ``CHILD_PATIENCE`` times what the plan's process took for its first configuration (at
least ``MIN_WAIT_S``), is stopped with the other children, and the plan fits what is left itself: a
child can save time, never change an answer. Children die with the plan's process (``PR_SET_PDEATHSIG``).

NOTE [ Autograd in a forked child ]
A CUDA build of torch refuses any backward in a child forked after the parent's autograd engine started its
device threads ("Unable to handle autograd's threading in combination with fork-based multiprocessing"), and a
traced step on a fake GPU starts them: measured with torch 2.11+cu130, a child forked after one GPU estimate in the
same process fails its first backward, where one forked before it runs. So a plan called after an estimate (a
notebook), or a second walk of the same plan (the fused loss's), would fork children that each trace a forward
and fail. Before forking, a probe child runs one backward on the CPU; when it fails, the plan forks nothing and
fits every configuration itself, as with one worker.

NOTE [ Forking a process that has threads ]
Only the forking thread exists in the child; a lock another thread held at the fork stays held there.
The child touches none of the parent's threads' objects (no progress display, nothing of its own on
the output: it leaves with ``os._exit``), and the interpreter re-creates its own locks after a fork;
what is left is a lock inside a library some other thread of the user's held at that instant, which
would hang the child. The patience above bounds what that costs: the plan stops the children and does
the work itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..memory.cache import CACHE, Uncacheable, cache_dir, workload_digest

if TYPE_CHECKING:
    from ..workload import Workload

__all__ = ["FitAhead", "autograd_in_a_child", "available_cores", "fit_ahead", "forked_child_runs", "resolve_workers"]

CHILD_PATIENCE = 5.0
"""The plan waits for a child's configuration this many times what its own first configuration took
before it stops the children and fits what is left itself."""
MIN_WAIT_S = 60.0
"""...and never less than this."""


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_workers(workers: Any) -> int:
    """Processes a plan may use: ``workers``, else ``BATCHFIT_WORKERS``, else the cores available."""
    source = "workers"
    if workers is None:
        env = os.environ.get("BATCHFIT_WORKERS", "").strip()
        if not env:
            return available_cores()
        source, workers = "BATCHFIT_WORKERS", env
        try:
            workers = int(workers)
        except ValueError:
            raise ConfigError(f"BATCHFIT_WORKERS must be a whole number >= 1, got {env!r}") from None
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"{source} must be a whole number >= 1 (1: one configuration at a time), got {workers!r}")
    return workers


class FitAhead:
    """The children fitting configurations ahead of the plan (none where it would not pay).

    Work is shared by claims: whoever first creates a configuration's claim file (``O_EXCL``, atomic)
    fits it, children taking the configurations in order and the plan's own process each as it reaches
    it; a finished one gets a ``.done`` file. So the plan's process is never idle while a configuration
    it will need is unclaimed, and no configuration is fitted twice.
    """

    def __init__(self, work: list[Any]) -> None:
        self._index = {id(config): i for i, config in enumerate(work)}
        self._work = work
        self._dir: str | None = None
        self._reads: dict[int, int] = {}  # child pid -> read end of its pipe
        self._start = time.monotonic()
        self._own: float | None = None
        self.children = 0

    def _claim(self, i: int) -> bool:
        assert self._dir is not None
        try:
            fd = os.open(os.path.join(self._dir, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        try:
            os.write(fd, str(os.getpid()).encode())
        except OSError:  # a full disk: the claim stands, its owner is unknown (waited for until patience ends)
            pass
        finally:
            os.close(fd)
        return True

    def spawn(self, fit_one: Any) -> None:
        """Fork one child that claims and fits (``fit_one(config)``) configurations until none is left."""
        from ..memory.synthesis.depth import STATS

        parent = os.getpid()
        try:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="batchfit-plan-")
            read, write = os.pipe()
        except OSError:  # no temporary directory or descriptors: the plan fits everything itself
            return
        try:
            pid = _fork()
        except Exception:  # noqa: BLE001 - no child (no resources, a warning made an error): the plan fits it
            os.close(read)
            os.close(write)
            return
        if pid == 0:  # the child: fit, report the steps traced, and leave without the parent's clean-up
            code = 1
            try:
                os.close(read)
                _die_with(parent)
                _quiet()
                before = CACHE.misses
                traced, blocks, traces = STATS.blocks_traced, STATS.blocks_written, STATS.traces_written
                for i, config in enumerate(self._work):
                    if self._claim(i):
                        fit_one(config)
                        self._mark_done(i)
                written = (STATS.blocks_traced - traced, STATS.blocks_written - blocks, STATS.traces_written - traces)
                os.write(write, " ".join(str(n) for n in (CACHE.misses - before, *written)).encode())
                code = 0
            except BaseException:  # noqa: BLE001 - the plan fits it itself
                pass
            finally:
                os._exit(code)
        os.close(write)
        self._reads[pid] = read
        self.children += 1

    def _mark_done(self, i: int) -> None:
        assert self._dir is not None
        with contextlib.suppress(OSError):  # unmarked, the plan waits for patience, then fits it itself
            open(os.path.join(self._dir, f"{i}.done"), "wb").close()

    def wait(self, config: Any, fit_here: Any = None) -> None:
        """Before the plan fits ``config``: claim it, or let the child that did finish it (or stop that
        child when it is overdue or gone without finishing; the plan then fits it itself). Meanwhile the
        plan's process fits (``fit_here``) the last configurations no one has started, not to sit idle."""
        i = self._index.get(id(config))
        if i is None or self._dir is None or self._claim(i):
            return
        if self._own is None:  # what the plan's process took for its first configuration: the patience
            self._own = time.monotonic() - self._start
        claim, done = os.path.join(self._dir, str(i)), os.path.join(self._dir, f"{i}.done")
        later = len(self._work) - 1
        while fit_here is not None and later > i and not os.path.exists(done):
            if self._claim(later):
                fit_here(self._work[later])
                self._mark_done(later)
            later -= 1
        deadline = time.monotonic() + max(MIN_WAIT_S, CHILD_PATIENCE * self._own)
        owner = None
        while not os.path.exists(done):
            if owner is None:
                with contextlib.suppress(OSError, ValueError), open(claim, "rb") as f:
                    owner = int(f.read() or b"0") or None
            if owner is not None and (owner == os.getpid() or owner not in self._reads or self._exited(owner)):
                return  # the plan's own claim, or a child gone (left, stopped) without finishing this one
            if owner is None and not self._reads:
                return  # no child left to finish it
            if time.monotonic() > deadline:  # forked at one instant, the others likely hang on the same lock
                for pid in list(self._reads):
                    self._stop(pid)
                return
            time.sleep(0.02)

    def _exited(self, pid: int) -> bool:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored, another reaper): its count is lost
            done, status = pid, 1 << 8
        if done:
            self._reap(pid, os.waitstatus_to_exitcode(status) == 0)
        return bool(done)

    def _reap(self, pid: int, ok: bool) -> None:
        from ..memory.synthesis.depth import STATS

        read = self._reads.pop(pid)
        with os.fdopen(read, "rb") as f:
            counts = (f.read().decode() if ok else "").split()
        if len(counts) == 4 and all(c.isdigit() for c in counts):
            CACHE.misses += int(counts[0])
            STATS.blocks_traced += int(counts[1])
            STATS.blocks_written += int(counts[2])
            STATS.traces_written += int(counts[3])

    def _stop(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        os.close(self._reads.pop(pid))

    def close(self) -> None:
        """Collect the children (by now they have nothing left to claim); stop any still running."""
        if self._dir is not None:
            for i in range(len(self._work)):  # nothing more for a child to start
                self._claim(i)
        until = time.monotonic() + 5.0
        while self._reads and time.monotonic() < until:
            for pid in list(self._reads):
                self._exited(pid)
            time.sleep(0.02)
        for pid in list(self._reads):
            self._stop(pid)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def fit_ahead(workload: Workload, configs: list[Any], workers: int, fit_one: Any) -> Iterator[FitAhead]:
    """Children fitting ``configs[1:]`` (``fit_one(config)`` each) while the caller fits ``configs[0]``."""
    rest = configs[1:]
    ahead = FitAhead(rest)
    try:
        if workers > 1 and rest and _can_fork() and _cacheable(workload) and autograd_in_a_child():
            for _ in range(min(workers - 1, len(rest))):
                ahead.spawn(fit_one)
        yield ahead
    finally:
        ahead.close()


def autograd_in_a_child() -> bool:
    """Whether a child forked now can run a backward (NOTE [ Autograd in a forked child ])."""
    return forked_child_runs(_one_backward)


def _one_backward() -> None:
    import torch

    torch.ones(1, requires_grad=True).sum().backward()


def forked_child_runs(fn: Any) -> bool:
    """Whether ``fn()`` returns, rather than raises, in a child forked now (False where forking fails)."""
    try:
        pid = _fork()
    except Exception:  # noqa: BLE001 - no child: nothing can be fitted ahead either
        return False
    if pid == 0:
        code = 1
        try:
            _quiet()
            fn()
            code = 0
        except BaseException:  # noqa: BLE001 - the answer is the exit code
            pass
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # reaped elsewhere: the answer is lost, so assume the worst
        return False
    return os.waitstatus_to_exitcode(status) == 0


def _fork() -> int:
    """``os.fork()``, without the warning Python 3.12+ gives for a process with threads (NOTE [ Forking a process that
    has threads ] says why it is safe here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _can_fork() -> bool:
    """Linux, and a disk cache that can be written (the only way a child's answer comes back)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "fork") and CACHE.enabled):
        return False
    root = cache_dir()
    if root is None:
        return False
    try:
        (root / "traces").mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(root / "traces", os.W_OK)


def _quiet() -> None:
    """The child writes nothing to the parent's output (see the NOTE): its streams are fresh ones on
    ``/dev/null``, and warnings and log records are dropped. A library's warning written to the
    inherited ``sys.stderr`` would take that stream's lock, which a thread of the parent (a progress
    display redrawing on a terminal) may have held at the fork: the child would wait for ever."""
    import logging

    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):  # what C code writes, too
        with contextlib.suppress(OSError):
            os.dup2(null, fd)
    os.close(null)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the child's for as long as it lives
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)


def _die_with(parent: int) -> None:
    """Have the kernel stop this child when the plan's process dies (Linux ``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # it died before the request was made
        os._exit(1)


def _cacheable(workload: Workload) -> bool:
    """Whether the plan's facts about ``workload`` are kept on disk (how a child's answer comes back)."""
    try:
        workload_digest(workload, None)
    except Uncacheable:
        return False
    return True
