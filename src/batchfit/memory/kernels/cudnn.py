"""cuDNN convolution workspaces: the scratch each convolution takes from the caching allocator on CUDA.

A fake CPU trace sees a convolution as ``aten.convolution`` (forward) and ``aten.convolution_backward``
(gradients of input and weight); on the CPU neither asks for scratch the trace cannot see. On CUDA each
cuDNN call also allocates a workspace, frees it when it returns, and the caching allocator keeps the
block cached, so it raises both the peak and what stays reserved. ``workspaces`` gives, for one traced
op, the workspace of each cuDNN call it makes; ``memory/kernels/cuda.py`` adds them to the trace as transient
allocations right after the op's outputs, which is where PyTorch allocates them.

NOTE [ cuDNN convolution workspaces ]
Sources: PyTorch's ``aten/src/ATen/native/Convolution.cpp`` (``_select_conv_backend``, ``use_cudnn``,
``use_cudnn_depthwise``, ``check_cudnn_depthwise_workload_with_filter``) and
``aten/src/ATen/native/cudnn/Conv_v8.cpp`` (``run_single_conv``, ``run_conv_plan``,
``generate_and_filter_plans``, ``try_configs``), with ``Conv_v7.cpp`` for the legacy path.

1. Which calls. ``_select_conv_backend`` sends a CUDA convolution to cuDNN unless cuDNN is disabled
   (``torch.backends.cudnn.enabled``), the tensors need 64-bit indexing even after splitting the batch
   (``needs_64bit_indexing_no_split``), a dilated NCHW convolution must be deterministic, or a
   transposed one has ``output_padding >= stride``. A *depthwise* convolution (``groups`` = input
   channels > 1, output channels a multiple of them, not transposed) goes to PyTorch's own depthwise
   kernels (no workspace) unless ``use_cudnn_depthwise``: channels-last tensors, or fp16 with at least
   32 channels, no dilation, equal strides and the shapes ``check_cudnn_depthwise_workload_with_filter``
   accepts (cuDNN >= 8.2, which every torch >= 2.4 build has). A 1-d convolution is viewed as 2-d first.
2. Which engines. ``convolution`` runs the forward engine; a transposed convolution runs the
   backward-data engine forward (``cudnn_convolution_transpose``). ``convolution_backward`` runs the
   backward-data engine for the input's gradient and the backward-filter engine for the weight's, one
   after the other, each with its own workspace; the bias gradient is a reduction, not cuDNN. For a
   transposed convolution the input's gradient runs the forward engine.
3. When. ``run_conv_plan`` asks the caching allocator for ``plan.getWorkspaceSize()`` bytes after the
   output exists and frees them when the call returns: a transient allocation after the op's outputs.
4. How large, with ``torch.backends.cudnn.benchmark = False`` (PyTorch's default). ``run_single_conv``
   builds cuDNN's heuristic engine configs (``CUDNN_HEUR_MODE_INSTANT``) and runs the first one that
   works (``try_configs``). cuDNN does not publish the workspace of an engine, and it cannot be known
   without the GPU. The model assumes room for a copy of every operand: PyTorch's tensors are NCHW
   while cuDNN's tensor-core engines work in NHWC, so an engine transposes the input and filter into
   its workspace and writes the output there before transposing it back (NVIDIA's channels-last
   diagram as MosaicML's "Channels Last" method card shows it; "cudnn can internally transpose your
   NCHW data to NHWC if a faster kernel can be found", discuss.pytorch.org/t/123686). The v8 path is
   PyTorch's default (``TORCH_CUDNN_V8_API_DISABLED=1`` falls back to ``Conv_v7.cpp``, whose
   ``AlgoIterator::try_all`` allocates each algorithm's workspace the same way). The workspace is taken as
   ``1.0 x (input + weight + output)`` bytes in every direction (the three operands of a backward call
   have the same shapes). Channels-last tensors need no transposition, but split-K and Winograd engines
   keep partial sums and transformed tiles; the same size is assumed for them, the conservative side.
4a. Pointwise convolutions. A 1x1 convolution with stride 1, no padding and one group on NCHW data is a
   matrix product per image, ``y[n] = W @ x[n]`` over ``(C, H*W)`` views, and its input gradient is
   ``W.T @ dy[n]``: cuDNN's heuristics pick GEMM engines that read NCHW as it is, with no workspace to
   transpose into. Measured on an H200 (cuDNN 9, torch 2.11; the snapshots in ``benchmarks/results``):
   of the 932 forward and input-gradient calls of such convolutions in the recorded steps (ResNet-50 in
   fp32 and bf16, transformers' ResNet-50, DenseNet-121, Inception v3), 802 took none (0 to 400 bytes)
   and 130 took about input + output, all on maps of 7 x 7 to 17 x 17, where the product per image is
   narrow. The model takes none for both directions; the weight's gradient sums
   over the batch (a split-K reduction with partial sums) and keeps the operand-sized workspace.
   Traced steps replayed with the GPU's own size for each workspace (``benchmarks/stream_diff.py
   --workspaces``) reserve what the GPU did to within -1.2% to +2.2% (ResNet-18 to VGG-16), so the
   workspaces are what the model's reserved error of CNNs is made of; with pointwise GEMMs taking none,
   ResNet-50's error goes from -8.6% to -0.2%. The weight gradient's engines vary most: split-K engines
   add partial sums of the weight, 3, 7 or 14 times its bytes in the streams, as the heuristics choose.
5. How large, with ``benchmark = True``. ``get_plans_from_find`` times every engine with a workspace of
   the largest one that fits the largest free block (``generate_and_filter_plans``: the caching
   allocator's ``cacheInfo``, at least the driver's free memory), halving it on out-of-memory, then
   empties the cache (``_cudnn_get_conv_benchmark_empty_cache``, on by default) and runs the fastest.
   The search therefore never runs out of memory and leaves nothing cached; what stays is the fastest
   engine's workspace, and fast engines (FFT, Winograd) hold transformed tiles of complex numbers,
   twice the real bytes of their operands. The model assumes ``2.0 x (input + weight + output)``.
6. Out of memory. When a workspace cannot be allocated (after the caching allocator released its
   cache and retried), ``try_configs`` / ``try_plans`` catch the ``OutOfMemoryError`` and try the next
   engine, which needs less, and the step goes on, slower. A real ResNet-50 step on an H200 capped at
   16 GiB shows it (batch 192 in ``benchmarks/results/snapshots-H200-2026-11-26``): 36 caught OOMs of
   workspaces from 92 to 768 MiB, then an 8 KiB one, and the step completed. The allocator model's replay
   at the capacity does the same (NOTE [ A workspace cuDNN can
   do without ] in ``memory/estimate.py``): a workspace that does not fit is taken as none, the engine cuDNN
   falls back to. Which engine that is, and what it takes, is cuDNN's choice (in the recorded VGG-16 streams 0
   to 240 MiB where about 1 GiB was refused), and PyTorch keeps it in its plan cache for the later calls; so
   whether a step fits is not always monotonic in the batch near the capacity, on the GPU as in the model.

A device profile (``batchfit calibrate``) replaces the two factors of 4 and 5 with ratios measured per
direction on the GPU (``Device.conv_workspace`` and ``conv_workspace_benchmark``).

Limitations:
    cuDNN batch norm's workspace and reserve, the native kernels' ``columns`` buffers (cuDNN disabled,
    dilated deterministic convolutions) and the benchmark search's transient are not modelled, nor the
    engine cuDNN's heuristics pick for a call (item 4a: the weight gradient's split-K partial sums). The
    trace lists a backward's two outputs before its two workspaces; cuDNN takes the input gradient's
    workspace before it allocates the weight's gradient, so the trace holds one weight gradient more
    while that workspace is alive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...gpu.catalog import ConvWorkspace, Device

FORWARD, BACKWARD_DATA, BACKWARD_FILTER = "forward", "backward data", "backward filter"
WORKSPACE = "cuDNN workspace"
"""The start of a workspace's op label in the trace (``ConvCall.label``), which ``estimate`` sums."""
HEURISTIC_WORKSPACE = ConvWorkspace(forward=1.0, backward_data=1.0, backward_filter=1.0)
"""The assumed workspace with cuDNN's heuristics, per byte of input + weight + output (NOTE, item 4)."""
BENCHMARK_WORKSPACE = ConvWorkspace(forward=2.0, backward_data=2.0, backward_filter=2.0)
"""The assumed workspace of the fastest engine ``benchmark = True`` picks (NOTE, item 5)."""
_INT_MAX = 2**31 - 1

_CONVOLUTION = torch.ops.aten.convolution.default
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default
OPS = frozenset({_CONVOLUTION, _CONVOLUTION_BACKWARD})
"""The traced ops that run cuDNN convolutions on CUDA."""


@dataclass(frozen=True)
class CudnnFlags:
    """The ``torch.backends.cudnn`` settings that decide which engines run (read once per trace)."""

    enabled: bool = True
    benchmark: bool = False
    deterministic: bool = False

    @classmethod
    def current(cls, backends: Any = None) -> CudnnFlags:
        """The flags of this process (``torch.backends.cudnn``, or a fake with the same attributes).

        ``torch.use_deterministic_algorithms(True)`` makes convolutions deterministic too
        (``convolution`` in ``Convolution.cpp`` ORs ``deterministicAlgorithms()`` in).
        """
        b = backends if backends is not None else torch.backends.cudnn
        deterministic = bool(b.deterministic) or (backends is None and torch.are_deterministic_algorithms_enabled())
        return cls(enabled=bool(b.enabled), benchmark=bool(b.benchmark), deterministic=deterministic)


@dataclass(frozen=True)
class ConvCall:
    """One cuDNN call a traced op makes: the engine's direction and its workspace."""

    direction: str
    nbytes: int

    @property
    def label(self) -> str:
        """The trace's op label of the workspace (``estimate`` sums labels starting with "cuDNN")."""
        return f"{WORKSPACE} ({self.direction})"


def ratios_for(device: Device, flags: CudnnFlags) -> ConvWorkspace:
    """The workspace ratios for ``device``: measured ones from its profile, else the model's (NOTE, 4-5)."""
    if flags.benchmark:
        return device.conv_workspace_benchmark or BENCHMARK_WORKSPACE
    return device.conv_workspace or HEURISTIC_WORKSPACE


def workspace_bytes(direction: str, operand_bytes: int, ratios: ConvWorkspace) -> int:
    """The workspace of one call whose input, weight and output hold ``operand_bytes`` together."""
    ratio = {FORWARD: ratios.forward, BACKWARD_DATA: ratios.backward_data, BACKWARD_FILTER: ratios.backward_filter}
    return math.ceil(ratio[direction] * operand_bytes)


def workspaces(func: Any, args: tuple, kwargs: dict, ratios: ConvWorkspace, flags: CudnnFlags) -> list[ConvCall]:
    """The cuDNN calls ``func`` makes on CUDA, in order, each with its workspace (empty: no cuDNN).

    Args:
        func: a traced op; only ``aten.convolution`` and ``aten.convolution_backward`` make cuDNN calls.
        args, kwargs: the op's arguments (fake tensors: only shapes, strides and dtypes are read).
        ratios: workspace per operand byte, per direction (``ratios_for``).
        flags: ``torch.backends.cudnn``'s settings for the step.
    """
    if func is _CONVOLUTION:
        p = _params(func, args, kwargs)
        x, w, out = p["input"], p["weight"], None
        transposed = bool(p["transposed"])
        directions = [BACKWARD_DATA if transposed else FORWARD]
    elif func is _CONVOLUTION_BACKWARD:
        p = _params(func, args, kwargs)
        x, w, out = p["input"], p["weight"], p["grad_output"]
        transposed = bool(p["transposed"])
        mask = list(p["output_mask"])
        directions = []
        if mask[0]:
            directions.append(FORWARD if transposed else BACKWARD_DATA)
        if mask[1]:
            directions.append(BACKWARD_FILTER)
    else:
        return []
    k = x.dim() - 2
    stride, padding, dilation = _expand(p["stride"], k), _expand(p["padding"], k), _expand(p["dilation"], k)
    groups, output_padding = int(p["groups"]), _expand(p["output_padding"], k)
    out_shape = list(out.shape) if out is not None else _output_shape(x, w, stride, padding, dilation, transposed,
                                                                      output_padding, groups)  # fmt: skip
    if not directions or _numel(out_shape) == 0 or x.shape[0] == 0 or x.shape[1] == 0:
        return []
    conv = _Conv(list(x.shape), list(w.shape), out_shape, _channels_last(x) or _channels_last(w), x.dtype,
                 stride, padding, dilation, transposed, output_padding, groups)  # fmt: skip
    if not uses_cudnn(conv, flags):
        return []
    operands = (_numel(conv.input) + _numel(conv.weight) + _numel(conv.output)) * x.element_size()
    gemm = not flags.benchmark and is_pointwise_gemm(conv)
    return [ConvCall(d, 0 if gemm and d != BACKWARD_FILTER else workspace_bytes(d, operands, ratios))
            for d in directions]  # fmt: skip


def is_pointwise_gemm(conv: _Conv) -> bool:
    """Whether ``conv`` is one matrix product per image on NCHW data, which needs no workspace (NOTE, item 4a)."""
    k = len(conv.weight) - 2
    return (
        not conv.transposed
        and not conv.channels_last
        and conv.groups == 1
        and all(n == 1 for n in conv.weight[2:])
        and conv.stride == [1] * k
        and conv.padding == [0] * k
        and conv.dilation == [1] * k
    )


@dataclass(frozen=True)
class _Conv:
    """A convolution's shapes and parameters, as ``_select_conv_backend`` sees them."""

    input: list[int]
    weight: list[int]
    output: list[int]
    channels_last: bool
    dtype: torch.dtype
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    transposed: bool
    output_padding: list[int]
    groups: int


def uses_cudnn(conv: _Conv, flags: CudnnFlags) -> bool:
    """Whether ``_select_conv_backend`` picks cuDNN for this convolution on CUDA (NOTE, item 1)."""
    x, w = list(conv.input), list(conv.weight)
    stride, dilation = list(conv.stride), list(conv.dilation)
    if len(w) == 3:  # view1d_as_2d: (N, C, L) -> (N, C, 1, L)
        x, w = [x[0], x[1], 1, x[2]], [w[0], w[1], 1, w[2]]
        stride, dilation = [1, *stride], [1, *dilation]
    if _is_depthwise(x, w, conv.transposed, conv.groups):
        return _use_cudnn_depthwise(conv, x, w, stride, dilation, flags)
    return _use_cudnn(conv, x, flags)


def _use_cudnn(conv: _Conv, x: list[int], flags: CudnnFlags) -> bool:
    if not flags.enabled:
        return False
    if _numel(x) // x[0] > _INT_MAX or _numel(conv.output) // max(conv.output[0], 1) > _INT_MAX:
        return False  # needs_64bit_indexing_no_split
    if not conv.channels_last and flags.deterministic and any(d != 1 for d in conv.dilation):
        return False
    return not any(p >= s for p, s in zip(conv.output_padding, conv.stride))  # is_output_padding_big


def _is_depthwise(x: list[int], w: list[int], transposed: bool, groups: int) -> bool:
    return not transposed and len(x) in (4, 5) and x[1] == groups and groups > 1 and w[0] % x[1] == 0


def _use_cudnn_depthwise(
    conv: _Conv, x: list[int], w: list[int], stride: list[int], dilation: list[int], flags: CudnnFlags
) -> bool:
    if not _use_cudnn(conv, x, flags):
        return False
    if conv.channels_last:
        return True  # "always use cudnn_depthwise for channels_last format"
    if conv.dtype != torch.float16 or len(x) != 4 or any(d != 1 for d in dilation) or x[1] < 32:
        return False
    if stride[0] != stride[1] and x[2] != 1:
        return False
    return _depthwise_workload_with_filter(x, w, stride[1])


def _depthwise_workload_with_filter(x: list[int], w: list[int], stride: int) -> bool:
    """``check_cudnn_depthwise_workload_with_filter`` (cuDNN >= 8.2): shapes where cuDNN's kernel is faster."""
    if x[2] == 1 and stride == 1:
        return True
    if w[2] != w[3] or w[3] not in (1, 3, 5) or x[3] < 7:
        return False
    if stride == 1:
        return True
    if stride != 2:
        return False
    filt, width, channels, batch = w[3], x[3], x[1], x[0]
    if batch == 1:
        return (filt == 1 and width <= 28) or filt in (3, 5)
    if filt == 1 and batch <= 16 and channels >= 128 and width <= 7:
        return True
    return filt in (3, 5) and (channels >= 512 or (channels >= 256 and width >= 28))


# -- helpers -----------------------------------------------------------------------------------------
_NAMES = {
    _CONVOLUTION: (
        "input",
        "weight",
        "bias",
        "stride",
        "padding",
        "dilation",
        "transposed",
        "output_padding",
        "groups",
    ),  # fmt: skip
    _CONVOLUTION_BACKWARD: (
        "grad_output",
        "input",
        "weight",
        "bias_sizes",
        "stride",
        "padding",
        "dilation",
        "transposed",
        "output_padding",
        "groups",
        "output_mask",
    ),  # fmt: skip
}


def _params(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    return {**dict(zip(_NAMES[func], args)), **kwargs}


def _expand(values: Any, k: int) -> list[int]:
    """``expand_param_if_needed``: one value stands for every spatial dimension (``padding="valid"`` gives [0])."""
    values = [int(v) for v in values] if isinstance(values, (list, tuple)) else [int(values)]
    return values * k if len(values) == 1 else values


def _numel(shape: list[int]) -> int:
    return math.prod(int(s) for s in shape)


def _channels_last(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are channels-last and not also plain contiguous (``suggest_memory_format``)."""
    shape, strides = [int(s) for s in t.shape], [int(s) for s in t.stride()]
    if len(shape) not in (4, 5):
        return False
    order = [1, *range(len(shape) - 1, 1, -1), 0]  # innermost first: C, then W, H(, D), then N
    expected, cl = 1, [0] * len(shape)
    for dim in order:
        cl[dim] = expected
        expected *= max(shape[dim], 1)
    contiguous, expected = [0] * len(shape), 1
    for dim in range(len(shape) - 1, -1, -1):
        contiguous[dim] = expected
        expected *= max(shape[dim], 1)
    significant = [i for i, s in enumerate(shape) if s != 1]
    same_cl = all(strides[i] == cl[i] for i in significant)
    same_contiguous = all(strides[i] == contiguous[i] for i in significant)
    return same_cl and not same_contiguous


def _output_shape(
    x: torch.Tensor,
    w: torch.Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> list[int]:
    """``conv_output_size`` / ``conv_input_size`` of ``ConvUtils.h``: the forward op's output shape."""
    k = x.dim() - 2
    sizes = [int(x.shape[0]), int(w.shape[1]) * groups if transposed else int(w.shape[0])]
    for i in range(k):
        n, kernel = int(x.shape[i + 2]), dilation[i] * (int(w.shape[i + 2]) - 1) + 1
        if transposed:
            sizes.append((n - 1) * stride[i] - 2 * padding[i] + kernel + output_padding[i])
        else:
            sizes.append((n + 2 * padding[i] - kernel) // stride[i] + 1)
    return sizes
