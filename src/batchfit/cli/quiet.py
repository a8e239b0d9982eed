"""Other libraries' chatter kept off the terminal: their warnings and logs are shown with ``-v`` only.

Tracing a transformers model with peft and bitsandbytes makes them warn about things that concern
their own users, not a person reading an estimate (deprecated aliases batchfit's calls reach, kernels a
CPU-only machine lacks, config fields of a tiny test model); a plan traces many steps and would print
them again and again. batchfit's own warnings (``BatchNormWarning``) and logs are always shown.

Nothing here imports torch: the command line's start stays fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

VERBOSE_FLAGS = ("-v", "--verbose")


def take_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``-v`` / ``--verbose`` (accepted anywhere on the line), and whether it was there."""
    kept = [a for a in argv if a not in VERBOSE_FLAGS]
    return kept, len(kept) != len(argv)


def _ours(category: type) -> bool:
    return getattr(category, "__module__", "").split(".")[0] == "batchfit"


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set where the user has not set them, restored after."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def _transformers_errors_only() -> Iterator[None]:
    """transformers' own handler prints warnings (``[transformers] ...``): errors only, while active."""
    module = sys.modules.get("transformers.utils.logging")
    if module is None:  # not imported yet: TRANSFORMERS_VERBOSITY (set by the caller) takes effect on import
        yield
        return
    level = module.get_verbosity()
    module.set_verbosity_error()
    try:
        yield
    finally:
        module.set_verbosity(level)


@contextlib.contextmanager
def _torch_errors_only() -> Iterator[None]:
    """torch's own handler prints its warnings: errors only while active (TORCH_LOGS=-torch does the same
    for a torch imported later)."""
    if "torch" not in sys.modules:
        yield
        return
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def third_party_output(verbose: bool) -> Iterator[None]:
    """While active, other libraries' warnings and log records reach the terminal only when ``verbose``."""
    if verbose:
        root = logging.getLogger()
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        root.addHandler(handler)
        try:
            yield
        finally:
            root.removeHandler(handler)
        return
    shown = warnings.showwarning

    def showwarning(
        message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if _ours(category):
            shown(message, category, filename, lineno, file, line)

    root = logging.getLogger()
    swallow = logging.NullHandler()  # third-party records stop here instead of logging's last resort (stderr)
    root.addHandler(swallow)
    # torch's own handler prints its warnings ("W1125 ... _pytree.py] ..."); TORCH_LOGS=-torch: errors only
    env = _environment(TRANSFORMERS_VERBOSITY="error", TORCH_LOGS="-torch", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    try:
        with env, _transformers_errors_only(), _torch_errors_only(), warnings.catch_warnings():
            warnings.showwarning = showwarning
            yield
    finally:
        root.removeHandler(swallow)
