"""The trace cache: a traced step is computed once, then reused by estimate, fit, plan and report.

Entries live in memory for the process and on disk (``BATCHFIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/batchfit`` or ``~/.cache/batchfit``; ``BATCHFIT_CACHE=0`` turns the disk off), so a
second identical command reuses the first one's traces. A file that cannot be read is ignored, with
a note in the estimate, and replaced. What goes into a key, and so when an entry is stale, is
``memory/cache/keys.py`` (NOTE [ What a trace depends on ]); its public names are re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .keys import Uncacheable, _describe, _digest, _settings, describe_model, installed, trace_key, workload_digest

if TYPE_CHECKING:
    from ...workload import Workload

__all__ = [
    "CACHE",
    "TraceCache",
    "Uncacheable",
    "cache_dir",
    "describe_model",
    "no_cache",
    "trace_key",
    "workload_digest",
]

_MEMORY_ENTRIES = 256


def cache_dir() -> Path | None:
    """Where traces are kept on disk (None: the disk cache is off)."""
    if os.environ.get("BATCHFIT_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    root = os.environ.get("BATCHFIT_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchfit"


class TraceCache:
    """Traces by key, in memory (most recent first) and on disk."""

    def __init__(self) -> None:
        self._memory: dict[str, Any] = {}
        self.enabled = True
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> Path | None:
        root = cache_dir()
        if root is None:
            return None
        name = ("fact-" if key.startswith("fact-") else "") + _digest((installed(), key))
        return root / "traces" / name[:2] / f"{name}.pickle"

    def get(self, key: str, notes: list[str], *, count: bool = True) -> Any:
        """The trace stored under ``key``, or None; an unreadable file adds a note and is removed.

        ``hits`` and ``misses`` count traces only (``count=False`` for the facts beside them).
        """
        if not self.enabled:
            return None
        if key in self._memory:
            self._memory[key] = self._memory.pop(key)
            self.hits += count
            return self._memory[key]
        path = self._path(key)
        if path is not None and path.exists():
            try:
                with open(path, "rb") as f:
                    trace = pickle.load(f)
                if not key.startswith("fact-") and type(trace).__name__ != "MemoryTrace":
                    raise TypeError(f"found a {type(trace).__name__}")
            except Exception as e:  # noqa: BLE001 - any unreadable entry is recomputed, never an error
                notes.append(f"ignored an unreadable trace cache entry {path} ({type(e).__name__}); traced again")
                with contextlib.suppress(OSError):
                    path.unlink()
            else:
                self._remember(key, trace)
                self.hits += count
                return trace
        self.misses += count
        return None

    def put(self, key: str, trace: Any) -> None:
        if not self.enabled:
            return
        self._remember(key, trace)
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(trace, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except OSError:  # a read-only or full disk: the memory cache still works
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)

    def keep(self, key: str, value: Any) -> None:
        """``value`` kept under ``key`` in this process's memory only (with the traces it holds, dropped with them by
        ``clear_memory``): what is worth keeping for the process but not across them."""
        self._remember(key, value)

    def recall(self, key: str) -> Any:
        """What ``keep`` (or a trace read or put) left in memory under ``key``, or None; the disk is not read, and
        nothing is counted."""
        if key not in self._memory:
            return None
        self._memory[key] = self._memory.pop(key)
        return self._memory[key]

    def _remember(self, key: str, trace: Any) -> None:
        self._memory[key] = trace
        while len(self._memory) > _MEMORY_ENTRIES:
            self._memory.pop(next(iter(self._memory)))

    def clear_memory(self) -> None:
        self._memory.clear()

    def fact(self, kind: str, workload: Workload, param_dtype: Any, compute: Callable[[], Any], extra: Any = ()) -> Any:
        """A result derived from ``workload`` (its state bytes, its BatchNorm layers, a fit's answer for
        ``extra``'s settings), computed once and kept beside the traces, so that a repeated plan builds
        no model and replays no allocator."""
        try:
            key = _digest((_settings(), kind, workload_digest(workload, param_dtype), _describe(extra)))
        except Uncacheable:
            return compute()
        key = f"fact-{key}"
        found = self.get(key, [], count=False)
        if found is None:
            found = compute()
            self.put(key, found)
        return found

    def device_fact(
        self, kind: str, workload: Workload, device: Any, param_dtype: Any, compute: Callable[[], Any], extra: Any = ()
    ) -> Any:
        """``fact`` for a result on a modelled device (a fit, an estimate): the device and the cuDNN
        settings its kernel model reads are part of the key, beside ``extra``."""
        from ..kernels.cudnn import CudnnFlags

        return self.fact(kind, workload, param_dtype, compute, extra=(device, CudnnFlags.current(), *extra))


CACHE = TraceCache()


@contextlib.contextmanager
def no_cache() -> Iterator[None]:
    """Within the block, traces are neither read from nor written to the cache (for measurements)."""
    saved = CACHE.enabled
    CACHE.enabled = False
    try:
        yield
    finally:
        CACHE.enabled = saved
