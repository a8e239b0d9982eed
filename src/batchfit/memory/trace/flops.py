"""Floating-point operations of a traced step, counted op by op as the trace runs.

The formulas are PyTorch's own (``torch.utils.flop_counter.flop_registry``: matrix products,
convolutions and their backward, the CUDA attention kernels), so a trace counts what
``FlopCounterMode`` would, without a second pass. The CPU flash-attention kernel, which the trace runs
in place of CUDA's attention (``memory/kernels/cuda.py``), is counted with the same attention formulas.
Activation checkpointing's recomputed forward is traced, so it is counted too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _registry() -> dict[Any, Callable[..., int]]:
    from torch.utils import flop_counter

    table: dict[Any, Callable[..., int]] = dict(flop_counter.flop_registry)
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and hasattr(flop_counter, "sdpa_flop_count"):

        def cpu_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
            return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)

        table[fwd] = cpu_flash
    if bwd is not None and hasattr(flop_counter, "sdpa_backward_flop_count"):

        def cpu_flash_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               *args: Any, **kwargs: Any) -> int:  # fmt: skip
            return flop_counter.sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape)

        table[bwd] = cpu_flash_backward
    return table


_TABLE: dict[Any, Callable[..., int]] | None = None


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op (0 for ops without a formula: elementwise work is counted as memory traffic)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _registry()
    formula = _TABLE.get(getattr(func, "_overloadpacket", None))
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - an argument layout a formula does not expect: not counted
        return 0
