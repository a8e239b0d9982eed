"""Exceptions raised by batchfit.

Map of the tree (kept shallow on purpose, so callers catch one thing)::

    BatchfitError                      base of everything batchfit raises on purpose
    ├── ConfigError (+ ValueError)     bad input: a size, a name, a capacity, a batch, a loss
    │   ├── UnknownNameError (+ KeyError-like message)   unknown device or preset
    │   ├── ProfileError               a device profile that is unreadable or not for this device
    │   ├── NoGpuError                 a command that must measure a GPU, run where none is visible
    │   └── MissingExtraError (+ ImportError)           an optional package an integration needs
    ├── DoesNotFitError                even one item does not fit, or a stage of a step; names the remedy
    │   └── (train.outofmemory.MicroBatchOutOfMemory: one micro-batch; also a torch.OutOfMemoryError)
    ├── TraceError                     the training step failed while traced (names the module and op)
    └── CheckpointError                unreadable, partial or mismatched checkpoint

Each message is one line that names the fix; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class BatchfitError(Exception):
    """Base class of every error batchfit raises on purpose."""


class ConfigError(BatchfitError, ValueError):
    """Bad input: the message says what was wrong and what to pass instead."""


class UnknownNameError(ConfigError):
    """A device or preset name that is not in the catalog."""

    def __init__(self, kind: str, name: str, known: Iterable[str], hint: str = "") -> None:
        known = list(known)
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
        if not close:
            lowered = name.lower()
            close = [k for k in known if lowered in k.lower() or k.lower() in lowered][:3]
        msg = f"unknown {kind} {name!r}"
        if close:
            msg += f"; did you mean {', '.join(repr(c) for c in close)}?"
        else:
            msg += f"; known: {', '.join(known)}"
        if hint:
            msg += f" {hint}"
        super().__init__(msg)
        self.name = name
        self.close_matches = close


class ProfileError(ConfigError):
    """A device profile that cannot be read (missing, corrupt, another schema) or describes another GPU."""


class NoGpuError(ConfigError):
    """A command that measures a real GPU (``batchfit calibrate``) was run where none is visible."""


class MissingExtraError(ConfigError, ImportError):
    """An optional package is not installed; the message names the ``batchfit[extra]`` that brings it.

    Also an ``ImportError``, so ``try: import ... except ImportError`` around an optional integration
    keeps working.
    """


class DoesNotFitError(BatchfitError):
    """The workload does not fit on the device even at the smallest setting tried."""


class TraceError(BatchfitError):
    """The workload's training step raised while it was traced on fake tensors.

    The message names the module and the op where it happened, and whether the step would fail on a
    real device too (a bug in the step) or only cannot be traced (an op fake tensors cannot run).
    """


class CheckpointError(BatchfitError):
    """A checkpoint could not be read, is incomplete, or belongs to another run."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to one line of at most 300 characters (its type's name when empty):
    what a one-line batchfit error quotes of an exception raised in the user's code."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
