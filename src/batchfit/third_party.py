"""Other libraries' warnings and log lines, held back while batchfit imports, builds and traces for the user,
and the release of torch that a behaviour depends on.

Used wherever batchfit builds an optimizer or traces a step (sources, the fake step, the adapters), so
it sits with the core modules every package may import.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# NOTE [ Third-party chatter ]
# Importing torchao logs a warning per native library it cannot load and torch logs one per Enum
# torchao registers (``torch.utils._pytree``); compiling torchao's update warns that its state
# subclasses have no ``_stable_hash_for_caching``; bitsandbytes logs that its CPU 4-bit kernel package
# is missing, and warns "Paged optimizers are not supported on CPU" once per optimizer that pages on
# the CPU (``Optimizer8bit.get_state_buffer``), which is the fallback batchfit models there anyway.
# None of it is for the user of batchfit: it is held back while batchfit imports, builds and traces an
# optimizer, and the cache-hash warning for good once a torchao optimizer is built by name (it comes
# from the compiled update of every real step, in the user's own training loop).
_LOGGERS = ("torchao", "bitsandbytes", "torch.utils._pytree")
_PAGED_ON_CPU = "Paged optimizers are not supported on CPU"
NO_CACHE_HASH = ".*does not implement _stable_hash_for_caching"


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    """Hold back the warnings and log lines of NOTE [ Third-party chatter ] for the block."""
    saved = [(logger, logger.level) for logger in map(logging.getLogger, _LOGGERS)]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PAGED_ON_CPU)
            warnings.filterwarnings("ignore", category=UserWarning, module="torchao")
            warnings.filterwarnings("ignore", message=NO_CACHE_HASH)
            yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def torch_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version (``"2.11.0+cu130"`` -> ``(2, 11)``; None: the installed torch's), for
    the behaviours that changed between releases (the allocator's tie order, which kernels take an attention call).

    Raises:
        ConfigError: no version can be read from ``version``.
    """
    from .errors import ConfigError

    if version is None:
        import torch

        version = torch.__version__
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        raise ConfigError(f"cannot read a torch version from {version!r}; e.g. '2.11.0'") from None
    return major, minor
