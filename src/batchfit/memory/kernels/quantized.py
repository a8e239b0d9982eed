"""What bitsandbytes' quantised matmuls allocate on a CUDA GPU beyond the outputs their fake kernels show.

A quantised base weight (``sources/quant.py``) is traced through bitsandbytes' own Python code
(``Linear4bit.forward``, ``MatMul4Bit``, ``Linear8bitLt.forward``, ``MatMul8bitLt``), whose custom ops
have fake kernels that return outputs only. On the CPU that is exact: the CPU probe
(``memory/kernels/cpu_probe.py``) measures what each op allocates inside, as for any kernel. For a CUDA target the
CUDA kernels' own temporaries are added here, from their sources (NOTE [ The 4-bit matmul's
dequantised weight ]), and the 8-bit matmul takes the CUDA branch (NOTE [ LLM.int8() on CUDA ]).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch

# NOTE [ The 4-bit matmul's dequantised weight ]
# bitsandbytes/backends/cuda/ops.py (0.50), the CUDA kernel of `bitsandbytes::gemm_4bit`: past
# `_gemm_4bit_custom_max_m = 1536` rows of input (a training batch of B x T tokens), and below it
# wherever `_gemm_4bit_use_custom_cuda`'s per-architecture table prefers it, the op runs
# `_dequant_linear_fallback`: with double quantisation it dequantises the 8-bit scales into a new
# fp32 tensor of one value per block (`absmax_dq`), adds the offset into a second (`absmax`), then
# dequantises the whole weight into `torch.empty(shapeB, dtype=A.dtype)` (the [out, in] weight in the
# compute dtype) and calls `F.linear`; the three die when the op returns. The op's fake kernel
# (bitsandbytes/_ops.py, `register_fake("bitsandbytes::gemm_4bit")`) returns the output alone, so the
# three are added here as the op's transient scratch. Below 1536 rows a GPU may run the fused kernel,
# which makes none of them: the model takes the fallback always, one dequantised weight above the
# real step then (the safe side). In backward, `MatMul4Bit.backward` calls `F.dequantize_4bit`, whose
# ops' fake outputs are exactly the tensors their CUDA kernels allocate (`torch.empty(shape, dtype)`
# in `bitsandbytes::dequantize_4bit`, `torch.empty_like` in `dequantize_blockwise`): nothing to add.
GEMM_4BIT_FUSED_MAX_ROWS = 1536


def _op(name: str) -> Any:
    namespace = getattr(torch.ops, "bitsandbytes", None)
    packet = getattr(namespace, name, None) if namespace is not None else None
    return getattr(packet, "default", None) if packet is not None else None


def is_quantized_op(func: Any) -> bool:
    """Whether ``func`` is one of bitsandbytes' ops (the kernel model looks at those too)."""
    return getattr(func, "namespace", None) == "bitsandbytes"


def gemm_4bit_scratch(func: Any, args: tuple, kwargs: dict) -> list[tuple[int, str]]:
    """``(bytes, label)`` of what the CUDA ``gemm_4bit`` allocates inside, in order (NOTE [ The 4-bit
    matmul's dequantised weight ]); empty for any other op."""
    if func is not _op("gemm_4bit"):
        return []
    names = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit")
    given = {**dict(zip(names, args)), **kwargs}
    a, shape, nested = given["A"], given["shapeB"], given.get("absmax_8bit")
    out: list[tuple[int, str]] = []
    if isinstance(nested, torch.Tensor):
        blocks = nested.numel() * 4  # fp32, one value per block
        out += [(blocks, "bitsandbytes 4-bit scales, dequantised"), (blocks, "bitsandbytes 4-bit scales + offset")]
    out.append((math.prod(shape) * a.element_size(), "bitsandbytes 4-bit weight, dequantised"))
    return out


# NOTE [ LLM.int8() on CUDA ]
# bitsandbytes/autograd/_functions.py, `matmul`: a training step (`state.is_training`) on a CPU tensor
# takes `MatMul8bitFp` (dequantise the int8 weight, then an ordinary matmul), on a CUDA tensor
# `MatMul8bitLt` (quantise the input row-wise to int8, an int8 GEMM with int32 accumulation, then
# dequantise; backward dequantises the weight). A trace on fake CPU tensors for a CUDA target must take
# the CUDA branch: `cuda_int8_matmul` routes `matmul` there while it is active. Its custom ops have fake
# kernels with the CUDA kernels' output shapes and dtypes, but one: with the outlier threshold (6.0 by
# default) `int8_vectorwise_quant` picks the input's columns holding a value above it, and
# `int8_mixed_scaled_mm` multiplies those apart in fp16 (`subA`, [rows, outliers], kept for backward),
# a count that depends on the activations' values. The forward is traced with the threshold at 0 for
# the call, which is the same step with no outlier column: each outlier column a real step finds adds
# 2 bytes per token to its layer's saved tensors and a transient [out, outliers] fp16 slice of the
# weight (bitsandbytes/backends/cuda/ops.py, `int8_mixed_scaled_mm`). `QuantSpec.describe` says so.


@contextlib.contextmanager
def cuda_int8_matmul() -> Iterator[None]:
    """While active, bitsandbytes' 8-bit matmul takes the branch a CUDA tensor takes (NOTE [ LLM.int8()
    on CUDA ]); nothing happens where bitsandbytes was not imported."""
    functions = sys.modules.get("bitsandbytes.autograd._functions")
    if functions is None or not hasattr(functions, "MatMul8bitLt"):
        yield
        return
    import bitsandbytes

    original = functions.matmul

    def matmul(A: Any, B: Any, out: Any = None, state: Any = None, threshold: float = 0.0, bias: Any = None) -> Any:
        state = state or functions.MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        kept, state.threshold = state.threshold, 0.0  # no outlier column (NOTE [ LLM.int8() on CUDA ])
        try:
            return functions.MatMul8bitLt.apply(A, B, out, bias, state)
        finally:
            state.threshold = kept

    patched = [(functions, "matmul"), (bitsandbytes, "matmul")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched if getattr(owner, name, None) is original]
    try:
        for owner, name, _ in saved:
            setattr(owner, name, matmul)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
