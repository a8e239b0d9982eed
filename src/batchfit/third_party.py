"""Other libraries' warnings and log lines, held back while batchfit imports, builds and traces for the user.

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
