"""The staging buffer a CUDA reduction takes from the caching allocator when blocks split an output's inputs.

NOTE [ CUDA reduction staging ]
Source: PyTorch's ``aten/src/ATen/native/cuda/Reduce.cuh`` (``setReduceConfig``, ``ReduceConfig``,
``get_output_vec_size``, ``gpu_reduce_kernel``), which ``sum``, ``mean`` and the other TensorIterator
reductions run on CUDA. When each output has many inputs and there are few outputs, the kernel splits an
output's inputs across thread blocks (``ctas_per_output``) and combines their partial results through
global memory: ``gpu_reduce_kernel`` allocates ``global_memory_size()`` bytes of staging and
``semaphore_size()`` bytes of semaphores from the caching allocator, in that order, after the output
exists, and frees both (semaphores first) when it returns. The CPU runs the same reduction with no such
buffer, so a trace on the CPU misses it.

It matters for the bias gradient of every linear layer: ``grad.sum(0)`` over (tokens, features) has few
outputs and many inputs per output. On an H200 (132 multiprocessors) a [4096, 4096] fp32 column sum stages
128 MiB; ViT-base's fc1 bias gradient (6304 tokens x 3072, bf16) 132 MiB and fc2's (x 768) 37.125 MiB, as
the recorded allocator streams show (``benchmarks/results/snapshots-H200-2026-11-26``): transient, but at
the start of backward, where the peak is, they are on top of everything kept.

The geometry follows ``TensorIterator``: reduced dimensions first, each group ordered by stride (fastest
first) and coalesced where contiguous; then ``setReduceConfig``'s choices, which depend on the GPU's
multiprocessor count and threads per multiprocessor (``Device.multiprocessors``,
``gpu.catalog.threads_per_multiprocessor``). Modelled: ``sum.dim_IntList`` and ``mean.dim``, for inputs that
``TensorIterator`` indexes with 32 bits (larger ones are split into sub-iterators, not modelled).

The size is not linear in the batch size (nothing below a threshold of inputs per output, then
``ctas_per_output`` bounded by the multiprocessors, then growing again), while ``fit`` extends every storage along
a line through two small batches (``memory/synthesis/scaling.py``). So the trace keeps each staging buffer's
``Reduction``, the input's geometry and the GPU's, beside its storage (``MemoryTrace.reductions``), and a trace
predicted at another batch size (or sequence length) sizes the buffer again from the input's shape there, each
of its numbers being affine in the batch: the line carries the reduction's geometry, not its size. Every modelled
reduction records both buffers, empty where the kernel takes none, so that two batch sizes on either side of the
threshold still run the same events.

NOTE [ Batch norm statistics on a float32 copy ]
Source: PyTorch's ``aten/src/ATen/native/cuda/Normalization.cu`` (``batch_norm_choose_impl``,
``batch_norm_mean_var``) and ``aten/src/ATen/native/ReduceOpsUtils.h`` (``make_reduction``). CUDA runs a bf16 batch
norm with PyTorch's own kernels (cuDNN's takes no bf16 input: ``_select_batch_norm_backend``). In training they
compute the batch's mean and variance with a dedicated kernel when the input is contiguous (or channels-last
contiguous) and indexed with 32 bits; otherwise (``Impl::General``: 2**31 - 1 elements or more, or another layout)
with ``var_mean_out``, whose ``make_reduction`` reads a float16 input as it is but casts any other input to the
float32 of the statistics first (``self.to(dtype1)``): a transient copy of 4 bytes per element, allocated after the
op's output, mean and inverse deviation, and freed before it returns. The CPU computes the statistics without one. A
real ResNet-50 step in bf16 at 3,299 images on an H200 took 10,103 MiB for each batch norm of the 64- and
256-channel maps at 112 x 112 and 56 x 56 (2.65e9 elements each;
``benchmarks/results/snapshots-H200-2026-11-28-capacity``). Whether the copy is taken depends on the batch size, so
the trace keeps the input's geometry (``StatsUpcast``) beside the copy, as for a reduction's staging, with the copy
empty where the kernel takes none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

_SUM = torch.ops.aten.sum.dim_IntList
_MEAN = torch.ops.aten.mean.dim
OPS = frozenset({_SUM, _MEAN})
"""The traced ops whose CUDA kernel is ``gpu_reduce_kernel`` with a staging buffer to model."""

MAX_NUM_THREADS = 512
"""``mnt_wrapper<scalar_t>::MAX_NUM_THREADS`` (256 only for complex128)."""
INPUT_VEC_SIZE = 4
VT0 = 4
WARP = 32
MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD = 16, 256
_INT32_MAX = 2**31 - 1


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


@dataclass(frozen=True)
class Reduction:
    """A reduction's input as ``gpu_reduce_kernel`` sees it, and the GPU it runs on: what sizes its staging."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    """The input's strides, in elements."""
    offset: int
    """The input's storage offset, in elements."""
    itemsize: int
    reduced: tuple[int, ...]
    """The reduced dimensions, non-negative and sorted."""
    acc: int
    """Bytes of the accumulate type (``arg_t``)."""
    multiprocessors: int
    threads_per_mp: int

    def sizes(self) -> tuple[int, int]:
        """``(global_memory_size, semaphore_size)``: ``(0, 0)`` when the kernel reduces within blocks."""
        if math.prod(self.shape) == 0:
            return 0, 0
        geometry = _iterator(self.shape, self.stride, self.itemsize, set(self.reduced))
        if geometry is None:
            return 0, 0
        shape, strides, num_reduce = geometry
        return _config(shape, strides, num_reduce, self.itemsize, self.acc, self.offset, self.multiprocessors,
                       self.threads_per_mp)  # fmt: skip

    def numbers(self) -> tuple[int, ...]:
        """The numbers that change with the batch size or the sequence length: shape, strides, offset."""
        return (*self.shape, *self.stride, self.offset)

    def with_numbers(self, numbers: list[int] | tuple[int, ...]) -> Reduction:
        """This reduction with ``numbers`` (as ``numbers()`` orders them) in place of its own."""
        n = len(self.shape)
        return replace(self, shape=tuple(numbers[:n]), stride=tuple(numbers[n : 2 * n]), offset=numbers[2 * n])


def reduction_of(func: Any, args: tuple, kwargs: dict, multiprocessors: int, threads_per_mp: int
                 ) -> Reduction | None:  # fmt: skip
    """The ``Reduction`` of a traced ``func`` call (None: not a reduction modelled here, or none on this GPU)."""
    if func not in OPS or not args or not isinstance(args[0], torch.Tensor) or multiprocessors <= 0:
        return None
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
    if x.is_complex() or (dtype is not None and dtype.is_complex):
        return None
    nd = x.dim()
    reduced = range(nd) if dims is None or (isinstance(dims, (list, tuple)) and not dims) else {
        d % max(nd, 1) for d in ([dims] if isinstance(dims, int) else dims)}  # fmt: skip
    out = dtype or (x.dtype if x.is_floating_point() else torch.int64)
    acc = 4 if out in (torch.float32, torch.float16, torch.bfloat16) else 8  # arg_t: float for half/bf16
    return Reduction(tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.element_size(), tuple(sorted(reduced)),
                     acc, multiprocessors, threads_per_mp)  # fmt: skip


def _iterator(shape: tuple[int, ...], stride: tuple[int, ...], item: int, reduced: set[int]
              ) -> tuple[list[int], list[int], int] | None:  # fmt: skip
    """``TensorIterator``'s shape and input strides (bytes) for reducing a tensor of ``shape`` and ``stride``
    over ``reduced``: reduced dimensions first, fastest first, coalesced; None when it would need 64-bit
    indexing."""
    nd = len(shape)
    span = sum((s - 1) * abs(st) for s, st in zip(shape, stride, strict=True)) * item
    if span > _INT32_MAX or math.prod(shape) > _INT32_MAX:  # can_use_32bit_indexing
        return None
    kept = [d for d in range(nd) if shape[d] != 1]
    order = sorted(kept, key=lambda d: (d not in reduced, stride[d], -d))
    out_shape: list[int] = []
    strides: list[int] = []
    kinds: list[bool] = []
    for d in order:
        size, step, is_reduced = shape[d], stride[d] * item, d in reduced
        if out_shape and kinds[-1] == is_reduced and step == out_shape[-1] * strides[-1]:
            out_shape[-1] *= size
            continue
        out_shape.append(size)
        strides.append(step)
        kinds.append(is_reduced)
    return out_shape, strides, sum(kinds)


def _config(shape: list[int], strides: list[int], num_reduce: int, item: int, acc: int, offset: int,
            multiprocessors: int, threads_per_mp: int) -> tuple[int, int]:  # fmt: skip
    """``setReduceConfig`` and the two sizes ``gpu_reduce_kernel`` allocates with it."""
    ndim = len(shape)
    num_outputs = 1
    for s in shape[num_reduce:]:
        num_outputs *= s
    inputs = 1
    for s in shape[:num_reduce]:
        inputs *= s
    if ndim > 0:
        fastest = num_reduce == ndim or strides[0] < strides[num_reduce]
        if fastest:
            dim0, dim1, moving = inputs, num_outputs, strides[0]
        else:
            dim0, dim1, moving = num_outputs, inputs, strides[num_reduce]
    else:
        fastest, dim0, dim1, moving = True, 1, 1, item
    output_vec = 1
    if moving == item:
        if fastest and dim0 > 128 and num_reduce == 1 and VT0 >= INPUT_VEC_SIZE:
            dim0 //= INPUT_VEC_SIZE
        elif not fastest:
            output_vec = _output_vec_size(shape, strides, num_reduce, item, offset)
            dim0 //= output_vec
    # set_block_dimension
    max_threads = MAX_NUM_THREADS // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    threads = width * height
    step_input = step_output = 1
    block_x_reduce = ndim == 0 or fastest
    if block_x_reduce:
        step_input *= width
    else:
        step_output *= width
    split_warps = _div_up(inputs, step_input) >= min(height * 16, MAX_VALUES_PER_THREAD)
    if split_warps:
        step_input *= height
    else:
        step_output *= height
    target_grid = multiprocessors * (threads_per_mp // threads)
    grid_x = _div_up(num_outputs // output_vec, step_output)
    values = _div_up(inputs, step_input)
    if not (split_warps and values >= MAX_VALUES_PER_THREAD and grid_x <= target_grid):
        return 0, 0
    ctas = max(min(_div_up(target_grid, grid_x), _div_up(values, MIN_VALUES_PER_THREAD)),
               _div_up(values, MAX_VALUES_PER_THREAD))  # fmt: skip
    if ctas <= 1:
        return 0, 0
    size = acc * num_outputs * ctas
    if not block_x_reduce:
        size *= width * output_vec
    return size, 4 * grid_x


def _output_vec_size(shape: list[int], strides: list[int], num_reduce: int, item: int, offset: int) -> int:
    """``get_output_vec_size``: 4, halved until the input's offset, the first output dimension and every other
    input stride (in elements) divide by it."""
    vec = 4
    for n in (offset, shape[num_reduce], *(s // item for j, s in enumerate(strides) if j != num_reduce)):
        while n % vec:
            vec //= 2
    return vec


# -- batch norm's statistics in float32 ----------------------------------------------------------------
_BATCH_NORMS = {  # op -> the position of its ``training`` argument (None: always training)
    getattr(getattr(torch.ops.aten, name, None), overload, None): training
    for name, overload, training in (
        ("native_batch_norm", "default", 5),
        ("_native_batch_norm_legit", "default", 5),
        ("_native_batch_norm_legit", "no_stats", 3),
        ("_batch_norm_with_update", "default", None),
    )
}
_BATCH_NORMS.pop(None, None)
BATCH_NORM_OPS = frozenset(_BATCH_NORMS)
"""The traced batch norms whose CUDA kernel may compute its statistics on a float32 copy (``StatsUpcast``)."""


@dataclass(frozen=True)
class StatsUpcast:
    """A bf16 batch norm's input as ``batch_norm_mean_var`` sees it: what sizes the float32 copy of its ``General``
    path (NOTE [ Batch norm statistics on a float32 copy ]). Sized again at another batch size as a ``Reduction``
    is (``numbers``, ``with_numbers``, ``sizes``)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def sizes(self) -> tuple[int]:
        """``(bytes of the float32 copy,)``: 0 unless the kernel takes the general path."""
        numel = math.prod(self.shape)
        return (4 * numel if numel and not _dedicated_kernel(self.shape, self.stride) else 0,)

    def numbers(self) -> tuple[int, ...]:
        return (*self.shape, *self.stride)

    def with_numbers(self, numbers: list[int] | tuple[int, ...]) -> StatsUpcast:
        n = len(self.shape)
        return replace(self, shape=tuple(numbers[:n]), stride=tuple(numbers[n : 2 * n]))


def stats_upcast_of(func: Any, args: tuple, kwargs: dict) -> StatsUpcast | None:
    """The ``StatsUpcast`` of a traced batch norm (None where CUDA computes no statistics on a copy at any size: not
    training, or an input other than bf16, whose statistics ``make_reduction`` reads as they are)."""
    if func not in _BATCH_NORMS or not args or not isinstance(args[0], torch.Tensor):
        return None
    at = _BATCH_NORMS[func]
    training = True if at is None else (args[at] if len(args) > at else kwargs.get("training", False))
    x = args[0]
    if not training or x.dtype != torch.bfloat16:
        return None
    return StatsUpcast(tuple(x.shape), tuple(x.stride()))


def _dedicated_kernel(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """``batch_norm_choose_impl`` picks a kernel of its own (``Contiguous`` or ``ChannelsLast``): the input is
    indexed with 32 bits (``canUse32BitIndexMath``) and contiguous, or channels-last contiguous in 4-d."""
    numel = math.prod(shape)
    span = sum((s - 1) * st for s, st in zip(shape, stride, strict=True))  # the last element's, storage offset aside
    if numel >= _INT32_MAX or span >= _INT32_MAX:
        return False
    if _dense_in(shape, stride, range(len(shape))):
        return True
    return len(shape) == 4 and _dense_in(shape, stride, (0, 2, 3, 1))


def _dense_in(shape: tuple[int, ...], stride: tuple[int, ...], order: Any) -> bool:
    """Whether the dimensions, outermost first in ``order``, are laid out densely (size-1 dimensions aside)."""
    expected = 1
    for d in reversed(tuple(order)):
        if shape[d] != 1 and stride[d] != expected:
            return False
        expected *= shape[d]
    return True
