"""Paged optimizer states: the storages bitsandbytes puts in CUDA unified memory, outside PyTorch's allocator.

NOTE [ Paged optimizer states ]
A bitsandbytes optimizer built with ``is_paged=True`` (``PagedAdamW8bit``, ``PagedAdamW32bit``,
``PagedLion``, ...) makes its per-parameter state buffers with ``get_state_buffer``
(``bitsandbytes/optim/optimizer.py``, ``Optimizer8bit.get_state_buffer``): on a CUDA device and for a
parameter of at least 1e5 values it calls ``F.get_paged``, which allocates with ``cudaMallocManaged``
(``bitsandbytes/functional.py``, ``get_paged``; ``cget_managed_ptr`` in its C library), else
``torch.zeros_like``. Only ``state1`` / ``state2`` come from it: the 8-bit ``absmax`` blocks and the
quantisation maps are ordinary tensors.

Unified memory is invisible to the caching allocator (``torch.cuda.memory_allocated`` and
``memory_reserved`` never count it) but resident on the GPU once the optimizer's kernels touch it, so it
is left out of the allocator's replay and of the allocated and reserved peaks, and added to the
device's total. When the GPU fills (activations, a larger batch), the driver migrates those pages to
host RAM and back when the optimizer next touches them: the step slows down instead of failing with
an out-of-memory error, which is what bitsandbytes' paged optimizers are for ("Paged optimizers",
bitsandbytes documentation; Dettmers et al. 2023, QLoRA, section 2).

On the CPU there is no unified memory: bitsandbytes' ``get_state_buffer`` returns ``zeros_like`` for a
CPU parameter (with a warning), so a CPU trace counts paged states as ordinary memory, as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

PAGED_MIN_NUMEL = 100_000
"""bitsandbytes pages a state buffer only for a parameter of at least this many values
(``Optimizer8bit.get_state_buffer``: ``if not self.is_paged or p.numel() < 1e5``)."""


def is_paged(optimizer: Any) -> bool:
    """Whether ``optimizer`` makes its states the way NOTE [ Paged optimizer states ] describes."""
    return bool(getattr(optimizer, "is_paged", False)) and callable(getattr(optimizer, "get_state_buffer", None))


@contextlib.contextmanager
def paged_states(optimizer: Any, storage_id: Callable[[torch.Tensor], int | None], paged: set[int]) -> Iterator[None]:
    """While active, the storages ``optimizer`` would page on a GPU are added to ``paged`` (their ids,
    from ``storage_id``); a no-op for an optimizer that does not page."""
    if not is_paged(optimizer):
        yield
        return
    original = optimizer.get_state_buffer
    own = vars(optimizer).get("get_state_buffer")  # an instance attribute already there, to put back

    def get_state_buffer(p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        buffer = original(p, dtype=dtype)
        if p.numel() >= PAGED_MIN_NUMEL:
            sid = storage_id(buffer)
            if sid is not None:
                paged.add(sid)
        return buffer

    optimizer.get_state_buffer = get_state_buffer  # the instance's, over its class's method
    try:
        yield
    finally:
        if own is None:
            del optimizer.get_state_buffer
        else:
            optimizer.get_state_buffer = own
