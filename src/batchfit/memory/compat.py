"""Libraries that branch on "am I being traced?" and would take another path on fake tensors.

NOTE [ Data-dependent branches seen through fake tensors ]
Fake tensors have no values, so code that asks a question about values must either refuse or guess.
transformers guesses conservatively: ``masking_utils.find_packed_sequence_indices`` checks whether
the position ids describe packed sequences (``(mask[:, -1] == 0).all()``) and, when it cannot read
them (``is_tracing`` is true for fake tensors), assumes they might be packed and materialises a
B x 1 x T x T attention mask. A real run with ordinary position ids finds them unpacked and lets SDPA
use ``is_causal=True`` with no mask. During a trace we answer the question the way the real run
would for position ids transformers builds itself (contiguous, so not packed). Training on packed
sequences with explicit position ids would materialise the mask for real; that case is estimated
a little low.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode


@contextlib.contextmanager
def counted_rng_states(register: Callable[[Any], Any]) -> Iterator[None]:
    """Count the RNG-state tensors activation checkpointing keeps for backward.

    ``torch.utils.checkpoint`` saves ``torch.get_rng_state()`` (a 5,056-byte CPU tensor) per
    checkpointed block to replay dropout identically in the recomputation; it is made by the
    generator directly, never by an op, so the dispatch-level tracker would not see it.
    """
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        register(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


@contextlib.contextmanager
def library_compat() -> Iterator[None]:
    """Patch the known library branches for the duration of a trace (each with its restore)."""
    with contextlib.ExitStack() as stack:
        masking = sys.modules.get("transformers.masking_utils")
        original = getattr(masking, "find_packed_sequence_indices", None)
        if masking is not None and original is not None:

            def find_packed_sequence_indices(position_ids: Any) -> Any:
                if isinstance(position_ids, FakeTensor):
                    return None
                return original(position_ids)

            masking.find_packed_sequence_indices = find_packed_sequence_indices
            stack.callback(setattr, masking, "find_packed_sequence_indices", original)
        yield


class _SavedNumbers(TorchFunctionMode):
    """Counts the Python numbers autograd keeps for backward as 0-d tensors (CPU targets).

    ``x * 0.5`` wraps 0.5 into an 8-byte tensor before dispatch (no dispatch mode sees it), and
    autograd saves it without calling saved-tensor hooks (wrapped numbers are exempt); the real step
    holds it until backward. After each torch function given a Python number, the ``_saved_*``
    tensors of its outputs' autograd nodes that are not fake are such numbers: they are registered.
    """

    def __init__(self, register: Callable[[Any], Any], own_pack: Callable[[Any], Any]) -> None:
        super().__init__()
        self._register = register
        self._own_pack = own_pack

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not torch.is_grad_enabled() or not any(
            isinstance(a, (int, float)) and not isinstance(a, bool) for a in (*args, *kwargs.values())
        ):
            return out
        # Reading ``_saved_*`` unpacks every saved tensor; under other saved-tensor hooks (activation
        # checkpointing's) that would recompute or hold tensors, so only look under the tracer's own.
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] != self._own_pack:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if node is None:
                continue
            for name in dir(node):
                if name.startswith("_saved_"):
                    value = getattr(node, name, None)
                    if isinstance(value, torch.Tensor) and value.dim() == 0 and not isinstance(value, FakeTensor):
                        self._register(value)
        return out


@contextlib.contextmanager
def counted_saved_numbers(register: Callable[[Any], Any], own_pack: Callable[[Any], Any]) -> Iterator[None]:
    """While active, Python numbers saved for backward are counted (see ``_SavedNumbers``)."""
    with _SavedNumbers(register, own_pack):
        yield
