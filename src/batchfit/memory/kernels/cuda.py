"""Making a trace on fake CPU tensors allocate what the same step allocates on a CUDA GPU.

A CPU build of PyTorch cannot fake ``cuda`` tensors, so the step is traced on fake CPU tensors and
the kernels whose memory differs between the two devices are corrected here, one by one. Each
correction says why, and ``tests/test_cuda_model.py`` checks each one.

NOTE [ CPU and CUDA kernels that keep different memory ]
1. Dropout. On the CPU, ``F.dropout`` is composite: it draws a mask in the *input's dtype* and
   multiplies (``aten/src/ATen/native/Dropout.cpp``, ``_dropout_impl``), so autograd keeps a 4-byte
   mask per fp32 element. On CUDA it calls the fused ``native_dropout`` whose mask is ``bool`` (1 byte,
   ``is_fused_kernel_acceptable``). We route dropout to ``native_dropout``: ``F.dropout`` and its kin in
   Python, and ``aten::dropout`` itself in the dispatcher (a kernel at AutogradCPU), which is what C++
   callers reach. One such caller is the math path of ``scaled_dot_product_attention``, which CUDA takes
   for a mask that needs a gradient (T5's learned relative-position bias): its dropout of the B*H*T*T
   probabilities keeps a 1-byte mask on CUDA (T5-small's step was estimated +10.7% allocated on an
   H200 with a 4-byte one). CUDA's kernel allocates the mask before the output (``dropout_cuda`` in
   ``aten/src/ATen/native/cuda/Dropout.cu``), and the trace registers them in that order: which cached
   blocks the two take follows from it. A GPT-2 step (dropout 0.1, bf16 autocast, paged 8-bit AdamW) on
   an H200 reserved 12,503 MB; the trace with the output first replayed to 14,124 MB (+13%), with the
   mask first to 12,501 MB.
2. Attention. ``scaled_dot_product_attention`` on the CPU falls back to the math path whenever there
   is dropout, which materialises the B*H*T*T attention matrix (and its dropout mask) for backward.
   CUDA's flash / memory-efficient kernels keep only the output and a float32 log-sum-exp of B*H*T,
   with dropout regenerated from a Philox seed (``sdp_utils.cpp`` selects them for fp16/bf16, and
   memory-efficient attention for fp32 and arbitrary masks). We route attention to the CPU flash
   kernel, whose saved tensors have those sizes, with the mask passed through.
   2a. Where no fused kernel takes the call, CUDA runs the math path too (``select_sdp_backend``): flash
   and cuDNN attention take only fp16/bf16, and memory-efficient attention, which takes fp32, had no
   grouped-query attention before torch 2.14 (its backward's meta kernel gives the key and value
   gradients their own head counts from 2.14 on). So fp32 attention with ``enable_gqa`` and fewer
   key/value heads than query heads (transformers passes it without a mask; a QLoRA step under peft's
   k-bit preparation runs its attention in fp32) materialises the B*H*T*T scores and probabilities in
   fp32: a real Llama-3.1-8B-shaped QLoRA step on an H200 (torch 2.11) took two 2 GiB transients per
   layer at batch 4 x 2048 tokens, which the fused routing missed (reserved -15%). The trace runs that
   composite op for op (``_math_attention``), with the mask added to the scores in place: the kernel adds it
   out of place only for subclass-like tensors, such as the trace's fakes.
   2b. The fused backward's workspace. A fused attention backward in fp16/bf16, after making the three
   gradients, takes one transient of ``B*H*T*(D + 1)*4 + 256`` bytes (B, H, T, D: the query's batch,
   heads, length and head size): an fp32 accumulator of the query's gradient and an fp32 sum per row.
   Measured on an H200 (torch 2.11 with cuDNN 9.19, whose SDPA prefers cuDNN attention on Hopper): to
   the byte in every recorded step of GPT-2 (8, 14, 15 and 16 items) and ViT-base (32 and 90 to 93
   items; ``benchmarks/results/snapshots-H200-*``). Flash attention's backward takes the same two fp32
   buffers (``dq_accum``, ``softmax_d``), its lengths rounded up to 128. The CPU kernel takes none, so
   the trace adds it after the gradients of ``_scaled_dot_product_flash_attention_for_cpu_backward``.
   2c. Grouped-query attention in fp16/bf16. The fused kernels take fewer key/value heads natively: the
   forward keeps the key and value as given (no copy repeated per query head; a real Qwen2.5-7B LoRA step
   on an H200 allocated nothing between its key/value projections and the attention's output), and the
   backward makes their gradients with their own head count, its workspace ``B*H*T*D*4`` bytes larger
   (H the query heads: the key and value gradients per query head, in the same one transient; 787.06 MiB
   where the model had 395.06 for that step at 7 x 4096 tokens, and in every recorded Llama-shaped, LoRA
   and Mixtral-shaped step). The CPU kernel's fake takes those shapes too, so the trace passes them
   unrepeated. Repeating them instead (as the trace did) keeps the same bytes in many smaller blocks, and
   near the capacity that decides the fit: the capacity-limited replay of that step ran out of memory at 7
   and 8 items where the GPU ran both (reserved 75,254 and 84,213 MB of 84,221; the model now 75,661 and
   84,211 with the GPU's transformers).
3. Autocast. CUDA's autocast runs a list of ops in float32 (layer_norm, softmax, log_softmax, exp,
   pow, the losses, ...; ``aten/src/ATen/autocast_mode.cpp``, ``KERNEL_CUDA(..., fp32)`` and
   ``fp32_set_opt_dtype``); the CPU's list is shorter, so on the CPU those ops stay in bf16 and save
   half the bytes. We register AutocastCPU kernels that apply CUDA's policy for the ops CPU autocast
   leaves alone, only for the duration of the trace, each where this torch's AutocastCUDA has a kernel.
   The reverse holds too: CPU autocast runs ``cross_entropy_loss`` in float32 and CUDA's has no policy
   for it, so on CUDA it decomposes with autocast on (``log_softmax`` in the logits' dtype, only
   ``nll_loss``'s input cast to float32); those CPU-only policies are lifted as well (``CPU_ONLY_FP32_OPS``).
4. cuBLAS workspace. Each cuBLAS handle/stream gets a workspace from the caching allocator on its
   first GEMM (``CublasHandlePool.cpp``), and training uses two: the forward thread's and the
   autograd engine's. It stays allocated.
5. Recurrent layers. On the CPU, ``nn.LSTM`` runs oneDNN's ``mkldnn_rnn_layer`` once per layer and
   direction, whose meta kernel returns an empty ``workspace``; on CUDA one ``_cudnn_rnn`` call runs the
   whole stack and keeps a cuDNN *reserve space* from the forward to the backward
   (``aten/src/ATen/native/cudnn/RNN.cpp``: its size is ``cudnnGetRNNTempSpaceSizes``'s reserve, a byte
   tensor from the caching allocator returned for backward). cuDNN does not publish its size; measured
   on an H200 (cuDNN 9.19, ``benchmarks/cudnn_workspaces.py``, 975 random problems of every mode, dtype,
   depth and direction) it is ``(U x layers - 1) x directions x T x B x H`` elements of the input's
   dtype plus 256 to 296 bytes, with U = 6 for an LSTM (4 gates, the cell and the hidden state), 7 for a
   GRU and 2 for a plain RNN: every layer's U per time step, less the last layer's hidden states, which
   are the output ``y``. The CPU trace already holds each layer's output as a tensor of its own (kept for
   the next layer's backward, or as ``y``), so each layer and direction's ``workspace`` becomes the rest
   of its share, ``U - 1`` units (``U - 2`` above the first layer of a bidirectional stack, whose input,
   the concatenation of the two directions below, the trace keeps too), and the stack's total is the
   GPU's to within those 256-296 bytes.
   5a. cuDNN's transient workspace. ``_cudnn_rnn`` takes a workspace after its outputs and frees it on return;
   ``_cudnn_rnn_backward`` takes one for the data's gradient (before the weights' gradient buffer) and one for
   the weights' (after it), each freed at once. RNN.cpp asks ``cudnnGetRNNTempSpaceSizes`` the same question
   (training mode) all three times, so the three have one size where the forward and the backward pick the
   same algorithm (all 963 such problems): the standard one, unless the hidden size is small enough for the
   persistent small-H kernels (LSTM: up to 192 forward, 128 backward) or an fp16 stack meets the persistent
   heuristics. It is as large as the reserve and often larger (a 2-layer bidirectional LSTM, 256 -> 512 at
   64 x 128: 306 MiB beside a 352 MiB reserve), so a step that left it out allocated 32% more on an H200 than
   estimated, and reserved 39% more. cuDNN does not publish its size; read off the same problems, for an LSTM
   without projection on the standard algorithm, with T steps, B sequences, input width I, hidden size H, L
   layers, D directions and s bytes per element, W the weight buffer's bytes and C = 8 MiB:
   ``W + 256 + 32 ceil(B/4) + TBs (I + 5H) + L (C + (10B - 8) H s)`` for a one-directional stack,
   with, in a single layer, the last term ``C + max((10B - 8) H s, 2 TBs (I - H) + (11B - 8) H s)``, and from
   512 steps on ``W + 256 + 32 ceil(B/4) + C + (11B - 8) H s + TBs (2I + 4H + max(0, I - H))``; and
   ``W + 256 + 32 ceil(B/4) + TBs (I + 14H) + 2L (C + (12B - 8) H s)`` for a bidirectional one
   (``cudnn_rnn_workspace_bytes``). As the allocator rounds it, that is the GPU's size in 205 of the 220
   recorded stacks it covers (fp32 88 of 94, bf16 92 of 99, fp16 25 of 27; ``rnn_workspace_covered``: the
   input no wider than the hidden size, except for one-directional single layers, and one-directional stacks
   of up to 256 or, single, from 512 steps); of the others, most are stacks of one or two steps (the GPU's up
   to 2.7% larger), the rest a few bytes of alignment. Outside (27 stacks: a wider input in a deeper or
   bidirectional stack, 257-511 steps unmeasured, deeper one-directional stacks from 512 steps) it is the
   closest form measured: -5% to +24% of the GPU's. The small-H kernels take another size (the rule: -54% to
   0% of it in fp32, -69% to 0% in fp16, -14% to +4% in bf16; the trace uses it there too), no fp16 stack of
   the sample met the persistent heuristics, and an LSTM with a projection runs cell by cell on the CPU, so
   is not traced as cuDNN's stack. ``benchmarks/cudnn_rnn_sizes.py`` asks cuDNN itself over a dense grid, to
   pin what the sample leaves open. The trace takes the workspace as transient scratch after the stack's last layer
   in the forward (its outputs and reserve alive, as on the GPU), after the first layer run backward and
   after the last, each sized again at another batch size or length from the stack's geometry
   (``RnnWorkspace``: the size rounds the batch and takes a maximum, so it is not a line). The two steps of
   ``benchmarks/gpu_truth.py`` with LSTMs then allocate within 0.2% of an H200 and reserve within 2.0%.
6. Grouped GEMM. ``_grouped_mm`` (mixture-of-experts layers) on CUDA pads the last dimension of its
   output to a 16-byte multiple (``_create_grouped_mm_output_tensor`` in ``_meta_registrations.py``,
   which mirrors the CUDA kernel's ``create_grouped_gemm_output_tensor``); the CPU kernel does not.
7. cuDNN convolution workspaces. Each cuDNN convolution call takes a workspace from the caching
   allocator after its output and frees it on return; which calls use cuDNN and how large the
   workspace is assumed to be are in ``memory/kernels/cudnn.py`` (NOTE [ cuDNN convolution workspaces ]).
   They are added as transient allocations right after the op's outputs.
8. Quantised matmuls. bitsandbytes' 4-bit matmul dequantises the whole weight on CUDA (added as the
   op's transient scratch), and its 8-bit matmul takes another branch on CUDA than on the CPU
   (``memory/kernels/quantized.py``).

9. Reduction staging. A CUDA ``sum``/``mean`` whose outputs each have many inputs splits them across
   thread blocks and stages partial results in a buffer from the caching allocator, with semaphores,
   freed when the kernel returns (``memory/kernels/cuda_reduce.py``, NOTE [ CUDA reduction staging ]):
   every linear layer's bias gradient takes one (128 MiB for a [4096, 4096] fp32 one on an H200). Both
   are added after the op's output, empty where the kernel takes none, with the input's geometry
   (``MemoryTrace.reductions``) that sizes them again at another batch size.
10. Batch norm statistics. A bf16 batch norm in training whose input needs 64-bit indexing (2**31 - 1
   elements or more) or has no dense layout computes its mean and variance on a float32 copy of the input
   on CUDA, a transient of 4 bytes per element; the CPU needs none (``memory/kernels/cuda_reduce.py``, NOTE
   [ Batch norm statistics on a float32 copy ]). Like a reduction's staging it is sized from the input's
   geometry at each batch size, empty below the threshold.

Limitations:
    cuBLASLt's workspace is not modelled apart from cuBLAS's unless a device profile measured it
    (``batchfit calibrate`` folds it into the per-handle workspace); cuDNN's RNN reserve is modelled,
    and its transient workspace for LSTMs by a rule measured on one GPU and cuDNN (H200, 9.19: item 5a),
    exact where it was found so and the closest measured form elsewhere; cuDNN convolution workspaces are
    an assumption unless a device profile measured them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ...gpu.catalog import Device, threads_per_multiprocessor
from ...precision import PrecisionPolicy
from ...third_party import torch_release
from ..trace import overrides
from . import cuda_reduce, cudnn, quantized
from .fused_loss import target_capability

# -- 4. cuBLAS workspace ----------------------------------------------------------------------------
_GEMMS = frozenset(
    op.default
    for op in (
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        torch.ops.aten.baddbmm,
        torch.ops.aten.addmv,
        torch.ops.aten.mv,
        torch.ops.aten.addbmm,
    )
)


_ATTENTION_BACKWARD = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None),
                              "default", None)  # fmt: skip
"""The backward of the kernel attention is routed to (NOTE, item 2); CUDA's fused one takes a workspace (2b)."""
_RNN_LAYER = getattr(getattr(torch.ops.aten, "mkldnn_rnn_layer", None), "default", None)
_RNN_LAYER_BACKWARD = getattr(getattr(torch.ops.aten, "mkldnn_rnn_layer_backward", None), "default", None)
"""One layer and direction of a CPU LSTM, forward and backward: on CUDA one cuDNN call runs the stack (NOTE, item 5)."""


class _WatchedOps:
    """The ops ``CudaKernels.after_op`` acts on: GEMMs, cuDNN's, and bitsandbytes' (whichever are loaded)."""

    def __init__(self, ops: frozenset) -> None:
        self._ops = ops

    def __contains__(self, func: object) -> bool:
        return func in self._ops or quantized.is_quantized_op(func)


class CudaKernels:
    """The tracer's kernel model for a CUDA device: adds cuBLAS and cuDNN workspaces where CUDA allocates them.

    Args:
        device: the GPU (its cuBLAS workspace, handles and measured cuDNN workspace ratios).
        cudnn_flags: ``torch.backends.cudnn``'s settings for the step; default: this process's
            (``device.cudnn_benchmark`` turns benchmark on as well).
    """

    watched_ops = _WatchedOps(_GEMMS | cudnn.OPS | cuda_reduce.OPS | cuda_reduce.BATCH_NORM_OPS
                              | {_ATTENTION_BACKWARD, _RNN_LAYER, _RNN_LAYER_BACKWARD} - {None})  # fmt: skip
    """The ops ``after_op`` acts on (the tracer calls it for no other)."""

    def __init__(self, device: Device, cudnn_flags: cudnn.CudnnFlags | None = None) -> None:
        self.device = device
        self._handles: set[str] = set()
        self._rnn_calls = 0  # mkldnn_rnn_layer calls into the current stack (NOTE, item 5)
        self._rnn_backward_calls = 0  # mkldnn_rnn_layer_backward calls into the current stack
        self._rnn_stacks: list[RnnWorkspace] = []  # the workspaces of stacks run forward and not yet backward
        self._rnn_input = 0  # the input width of the stack's first layer
        flags = cudnn_flags if cudnn_flags is not None else cudnn.CudnnFlags.current()
        if device.cudnn_benchmark and not flags.benchmark:
            flags = dataclasses.replace(flags, benchmark=True)
        self.cudnn_flags = flags
        self._conv_ratios = cudnn.ratios_for(device, self.cudnn_flags)
        self._threads_per_mp = threads_per_multiprocessor(device.compute_capability)

    def after_op(self, tracer: Any, func: Any, args: tuple, kwargs: dict, out_sids: list[int | None]) -> None:
        if func in cudnn.OPS:  # NOTE, item 7
            for call in cudnn.workspaces(func, args, kwargs, self._conv_ratios, self.cudnn_flags):
                if call.nbytes > 0:
                    tracer.add_scratch(call.nbytes, call.label, transient=True)
            return
        if func in cuda_reduce.OPS:  # NOTE, item 9: staging, then semaphores; freed in reverse on return
            reduction = cuda_reduce.reduction_of(func, args, kwargs, self.device.multiprocessors, self._threads_per_mp)
            if reduction is not None:
                sizes = reduction.sizes()
                sids = [tracer.add_scratch(n, f"CUDA reduction {part}", transient=False)
                        for n, part in zip(sizes, ("staging", "semaphores"), strict=True)]  # fmt: skip
                for part, sid in enumerate(sids):
                    tracer.sized_by(sid, reduction, part)
                tracer.free_scratch(reversed(sids))
            return
        if func in cuda_reduce.BATCH_NORM_OPS:  # NOTE, item 10: after the output, mean and inverse deviation
            upcast = cuda_reduce.stats_upcast_of(func, args, kwargs)
            if upcast is not None:
                sid = tracer.add_scratch(upcast.sizes()[0], "batch norm statistics in float32", transient=True)
                tracer.sized_by(sid, upcast, 0)
            return
        if func is _RNN_LAYER or func is _RNN_LAYER_BACKWARD:  # NOTE, item 5: cuDNN's transient workspace
            self._rnn_workspace(tracer, func, args)
            return
        if func is _ATTENTION_BACKWARD:  # NOTE, item 2b
            nbytes = attention_backward_workspace(args)
            if nbytes:
                tracer.add_scratch(nbytes, "attention backward workspace", transient=True)
            return
        if quantized.is_quantized_op(func):  # NOTE, item 8: alive together inside the op, freed on return
            sids = [tracer.add_scratch(n, label, transient=False) for n, label in quantized.gemm_4bit_scratch(
                func, args, kwargs)]  # fmt: skip
            tracer.free_scratch(reversed(sids))
            return
        if func not in _GEMMS:
            return
        # The autograd engine runs backward ops on its own thread, with its own cuBLAS handle.
        in_backward = torch._C._current_autograd_node() is not None
        handle = "autograd thread" if in_backward else "main thread"
        if handle in self._handles or len(self._handles) >= self.device.cublas_handles:
            return
        self._handles.add(handle)
        tracer.add_scratch(self.device.cublas_workspace_bytes, f"cuBLAS workspace ({handle})", transient=False)

    def _rnn_workspace(self, tracer: Any, func: Any, args: tuple) -> None:
        """cuDNN's workspace, taken and freed inside the stack's one ``_cudnn_rnn`` call (after the last layer's
        outputs, all of them alive there as on the GPU) and twice inside its ``_cudnn_rnn_backward``: for the data's
        gradient before any weight's gradient (after the first layer run backward), for the weights' after them all
        (after the last). Counted in layer calls, as ``fix_outputs`` counts the forward's (NOTE, item 5a)."""
        if func is _RNN_LAYER:
            if len(args) < 16 or not isinstance(args[0], torch.Tensor):
                return
            calls = max(1, int(args[11])) * (2 if args[13] else 1)
            index = (self._rnn_calls - 1) % calls  # this call's place in its stack (``fix_outputs`` counted it)
            if index == 0:
                self._rnn_input = int(args[0].shape[-1])  # the first layer reads the stack's input
            if index != calls - 1 or not args[15]:  # not the stack's last call, or not training
                return
            ws = rnn_workspace_of(args, self._rnn_input)
            if ws is None:
                return
            self._rnn_stacks.append(ws)
            _add_rnn_workspace(tracer, ws, "cuDNN RNN workspace (forward)")
            return
        if len(args) < 20:
            return
        calls = max(1, int(args[16])) * (2 if args[19] else 1)
        first, last = self._rnn_backward_calls == 0, self._rnn_backward_calls == calls - 1
        self._rnn_backward_calls = (self._rnn_backward_calls + 1) % calls
        ws = self._rnn_stacks[-1] if self._rnn_stacks else None
        if first and ws is not None:
            _add_rnn_workspace(tracer, ws, "cuDNN RNN workspace (backward data)")
        if last and ws is not None:
            self._rnn_stacks.pop()
            _add_rnn_workspace(tracer, ws, "cuDNN RNN workspace (backward weights)")

    def fix_outputs(self, tracer: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Lay out outputs as the CUDA kernel makes them (NOTE, items 5-6)."""
        if func is _RNN_LAYER and len(args) >= 16:
            # The CPU runs a stack's layers in order, each direction in turn: the call's place gives its layer.
            layers, directions = max(1, int(args[11])), 2 if args[13] else 1
            layer = self._rnn_calls // directions
            self._rnn_calls = (self._rnn_calls + 1) % (layers * directions)
            return _with_reserve(args, out, takes_concatenation=directions == 2 and layer > 0)
        if func is _GROUPED_MM:
            return _padded_grouped_mm(out)
        return out

    def allocation_order(self, func: Any, outputs: list) -> list:
        """An op's outputs in the order the CUDA kernel allocates them (NOTE, item 1: dropout's mask first)."""
        if func is _NATIVE_DROPOUT and len(outputs) == 2:
            return [outputs[1], outputs[0]]
        return outputs

    def finish(self, trace: Any) -> None:
        """Say where attention ran the math path (NOTE, item 2a): its scores are often most of the step."""
        if _MATH_PATH:
            dtypes = " and ".join(sorted(set(_MATH_PATH)))
            trace.notes.append(
                f"attention with fewer key/value heads than query heads, in {dtypes}, runs PyTorch's math path on "
                f"CUDA before torch 2.14 (no fused kernel takes it) and keeps its B x H x T x T scores; bf16 "
                f"autocast (or kbit_prep=false for QLoRA) keeps flash attention"
            )


_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default

# -- 5. recurrent layers: cuDNN's reserve space ------------------------------------------------------
RESERVE_UNITS = {0: 2, 1: 2, 2: 6, 3: 7}
"""cuDNN's reserve per layer, direction and time step, in hidden-size vectors, by mode (RNN_RELU, RNN_TANH, LSTM,
GRU), as measured (NOTE, item 5)."""


def cudnn_rnn_reserve_bytes(rows: int, hidden: int, mode: int, itemsize: int, takes_concatenation: bool = False) -> int:
    """The share of cuDNN's reserve that one layer and direction adds to the CPU trace over ``rows`` = time steps x
    batch: its units less the layer's output, which the trace holds already, and less one more where the layer
    reads the concatenation of a bidirectional layer below, which the trace keeps for it (NOTE, item 5)."""
    return rows * hidden * (RESERVE_UNITS.get(mode, 6) - 1 - takes_concatenation) * itemsize


def _with_reserve(args: tuple, out: Any, takes_concatenation: bool) -> Any:
    # mkldnn_rnn_layer(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
    #                  has_biases, bidirectional, batch_first, train) -> (output, hy, cy, workspace)
    if not args[15] or not isinstance(out, tuple) or len(out) != 4:
        return out
    # The layer's input is time-major, (T, B, features), or the (rows, features) of a packed sequence.
    x, mode, hidden = args[0], args[9], args[10]
    rows = x.shape[0] * x.shape[1] if x.dim() == 3 else x.shape[0]
    nbytes = cudnn_rnn_reserve_bytes(rows, hidden, mode, x.element_size(), takes_concatenation)
    reserve = torch.empty(nbytes, dtype=torch.uint8)
    return (*out[:3], reserve)


# -- 5. recurrent layers: cuDNN's transient workspace -------------------------------------------------
_CUDNN_LSTM = 2
_RNN_CONSTANT = 8 << 20
"""A fixed 8 MiB in each layer and direction's share of the workspace (NOTE, item 5a)."""


def cudnn_rnn_workspace_bytes(itemsize: int, input_size: int, hidden: int, layers: int, bidirectional: bool,
                              batch: int, seq: int) -> int:  # fmt: skip
    """The workspace ``cudnnGetRNNTempSpaceSizes`` gives a cuDNN LSTM without projection (standard algorithm, dropout
    off, padded I/O, as ``aten/src/ATen/native/cudnn/RNN.cpp`` describes it) on an H200 with cuDNN 9.19, for the whole
    stack; ``_cudnn_rnn`` and both halves of ``_cudnn_rnn_backward`` take one of this size. ``itemsize``: the input's
    dtype. Measured rule (NOTE, item 5a): to the byte, after the allocator's rounding, where ``rnn_workspace_covered``
    says so; elsewhere the closest measured form (its errors there in the NOTE)."""
    s, b, t, i, h, n = itemsize, batch, seq, input_size, hidden, layers
    d = 2 if bidirectional else 1
    tbs = t * b * s
    weights = sum(d * (4 * h * ((i if layer == 0 else d * h) + h) + 8 * h) * s for layer in range(n))
    base = weights + 256 + 32 * -(-b // 4)
    if d == 2:
        return base + tbs * (i + 14 * h) + 2 * n * (_RNN_CONSTANT + (12 * b - 8) * h * s) + 4 * tbs * max(0, i - h)
    if n == 1 and t >= 512:
        return base + _RNN_CONSTANT + (11 * b - 8) * h * s + tbs * (2 * i + 4 * h + max(0, i - h))
    per_layer = n * (_RNN_CONSTANT + (10 * b - 8) * h * s)
    if n == 1:
        return base + tbs * (i + 5 * h) + max(per_layer, _RNN_CONSTANT + 2 * tbs * (i - h) + (11 * b - 8) * h * s)
    return base + tbs * (i + 5 * h) + per_layer + 2 * tbs * max(0, i - h)


def rnn_workspace_covered(input_size: int, hidden: int, layers: int, bidirectional: bool, seq: int) -> bool:
    """Whether ``cudnn_rnn_workspace_bytes`` was found exact for such a stack (NOTE, item 5a): a bidirectional stack
    whose input is no wider than its hidden size; a one-directional layer of up to 256 or from 512 steps; a
    one-directional stack of up to 256 steps whose input is no wider than its hidden size."""
    if bidirectional:
        return input_size <= hidden
    if layers == 1:
        return seq <= 256 or seq >= 512
    return seq <= 256 and input_size <= hidden


@dataclasses.dataclass(frozen=True)
class RnnWorkspace:
    """A traced LSTM stack as cuDNN sizes its workspace: the sizes of ``cudnn_rnn_workspace_bytes``. Sized again at
    another batch size or sequence length as a CUDA reduction is (``numbers``, ``with_numbers``, ``sizes``): the size
    is not affine in either (it rounds the batch and takes a maximum)."""

    itemsize: int
    input_size: int
    hidden: int
    layers: int
    bidirectional: bool
    batch: int
    seq: int

    def sizes(self) -> tuple[int]:
        if self.batch <= 0 or self.seq <= 0:
            return (0,)
        return (cudnn_rnn_workspace_bytes(self.itemsize, self.input_size, self.hidden, self.layers,
                                          self.bidirectional, self.batch, self.seq),)  # fmt: skip

    def numbers(self) -> tuple[int, ...]:
        return (self.batch, self.seq)

    def with_numbers(self, numbers: list[int] | tuple[int, ...]) -> RnnWorkspace:
        return dataclasses.replace(self, batch=int(numbers[0]), seq=int(numbers[1]))


def rnn_workspace_of(args: tuple, input_size: int) -> RnnWorkspace | None:
    """The workspace of the cuDNN call that runs the stack whose ``mkldnn_rnn_layer`` calls take ``args`` (any of them:
    batch, length, hidden size and depth are the stack's) and whose first layer reads ``input_size`` features (None:
    not an LSTM, or a packed sequence, whose lengths cuDNN sizes it by)."""
    x, mode, hidden, layers, bidirectional = args[0], args[9], args[10], args[11], args[13]
    if mode != _CUDNN_LSTM or not isinstance(x, torch.Tensor) or x.dim() != 3 or list(args[8] or []):
        return None
    seq, batch = x.shape[0], x.shape[1]  # time-major whatever ``batch_first`` says: ``nn.LSTM`` transposes first
    return RnnWorkspace(x.element_size(), int(input_size), int(hidden), max(1, int(layers)), bool(bidirectional),
                        int(batch), int(seq))  # fmt: skip


def _add_rnn_workspace(tracer: Any, ws: RnnWorkspace, label: str) -> None:
    nbytes = ws.sizes()[0]
    if nbytes > 0:
        sid = tracer.add_scratch(nbytes, label, transient=True)
        tracer.sized_by(sid, ws, 0)


# -- 6. grouped GEMM ------------------------------------------------------------------------------------
_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def _padded_grouped_mm(out: Any) -> Any:
    if not isinstance(out, torch.Tensor) or out.dim() not in (2, 3):
        return out
    align = max(1, 16 // out.element_size())
    padded = -(-out.shape[-1] // align) * align
    if padded == out.shape[-1]:
        return out
    stride = [out.shape[1] * padded, padded, 1] if out.dim() == 3 else [padded, 1]
    return torch.empty_strided(tuple(out.shape), stride, dtype=out.dtype)


# -- 1 and 2: dropout and attention ----------------------------------------------------------------
_DROPOUT_NAMES = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


def _dropout_like_cuda(orig: Callable) -> Callable:
    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    dropout.__wrapped__ = orig  # type: ignore[attr-defined]
    return dropout


def _sdpa_like_cuda(orig: Callable) -> Callable:
    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        def generic() -> torch.Tensor:
            kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
            return orig(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)

        if query.dim() != 4 or query.shape[-1] > 256:
            return generic()
        if _math_on_cuda(query, key, enable_gqa):
            _MATH_PATH.append(str(query.dtype).removeprefix("torch."))
            return _math_attention(query, key, value, attn_mask, dropout_p, bool(is_causal), scale)
        # Grouped-query attention goes in as it is: CUDA's kernels take fewer key/value heads natively, keeping
        # the key and value as given and making their gradients with their own head count, as the CPU kernel's
        # fake does (NOTE, item 2c).
        q, k, v, mask = query, key, value, attn_mask
        if torch.is_autocast_enabled("cpu"):
            low = torch.get_autocast_dtype("cpu")
            q, k, v = (t.to(low) if t.dtype == torch.float32 else t for t in (q, k, v))
        if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        try:
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, bool(is_causal), attn_mask=mask, scale=scale
            )
        except RuntimeError:  # a layout the CPU kernel refuses: keep the generic path
            return generic()
        return out

    scaled_dot_product_attention.__wrapped__ = orig  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` with grouped-query attention, op for op as CUDA runs it on plain tensors
    (``aten/src/ATen/native/transformers/attention.cpp``; NOTE, item 2a). The mask is added to the scores in place:
    the kernel adds it out of place only where a tensor is subclass-like (``areAnyTensorSubclassLike``), which the
    trace's fake tensors are, and that would hold one more B x H x T x T tensor than the GPU does."""
    origin = query.dtype
    low = (torch.float16, torch.bfloat16)
    q, k, v = (t.float() if t.dtype in low and not torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp() else t
               for t in (query, key, value))  # fmt: skip
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    q = q * (-factor if scale is not None and scale < 0 else factor)
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril() if is_causal else attn_mask
    if mask is not None and mask.dtype == torch.bool:  # convert_boolean_attn_mask
        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
    if k.shape[-3] != q.shape[-3]:  # pre_process_group_query_attention_input
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.dropout(attn, dropout_p, True)
    return torch.matmul(attn, v).to(origin)


def attention_backward_workspace(args: tuple) -> int:
    """The workspace of CUDA's fused attention backward for this call's query (NOTE, item 2b; 0 outside fp16/bf16)."""
    query, key = (args[1], args[2]) if len(args) > 2 else (None, None)
    if not isinstance(query, torch.Tensor) or query.dim() != 4 or query.dtype not in (torch.float16, torch.bfloat16):
        return 0
    b, h, t, d = query.shape
    grouped = isinstance(key, torch.Tensor) and key.dim() == 4 and key.shape[1] != h
    return b * h * t * (d + 1) * 4 + 256 + (b * h * t * d * 4 if grouped else 0)


_MATH_PATH: list[str] = []
"""The dtype of each attention call of the trace being made that ran the math path (NOTE, item 2a): the estimate
says so. Emptied when ``cuda_kernel_routing`` starts a trace."""
_MEMORY_EFFICIENT_GQA = torch_release() >= (2, 14)
"""Whether CUDA's memory-efficient attention takes grouped-query attention in this torch (NOTE, item 2a)."""


def _math_on_cuda(query: torch.Tensor, key: torch.Tensor, enable_gqa: bool) -> bool:
    """Whether CUDA's SDPA dispatch leaves grouped-query attention to the math path (NOTE, item 2a): no fused
    kernel takes the query's dtype with fewer key/value heads. Autocast has not cast the inputs yet, so fp32
    inputs under autocast (which casts them to fp16/bf16) are left to the fused routing."""
    if not enable_gqa or key.shape[1] == query.shape[1] or torch.is_autocast_enabled("cpu"):
        return False
    if query.dtype in (torch.float16, torch.bfloat16):
        return False  # flash attention takes grouped-query attention natively
    return query.dtype != torch.float32 or not _MEMORY_EFFICIENT_GQA


def _fused_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as CUDA runs it (``Dropout.cpp``: ``native_dropout`` when ``is_fused_kernel_acceptable``)."""
    if train and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.native_dropout(input, p, train)[0]
    return _composite_dropout(input, p, train)


def _composite_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as the dispatcher runs it without the override: its C++ composite kernel (not
    ``OpOverload.decompose``, which prefers torch's Python decomposition, a ``native_dropout`` too)."""
    op = torch.ops.aten.dropout.default
    return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, input, p, train)


def _register_fused_dropout() -> None:
    overrides.register("cuda dropout", "dropout", "AutogradCPU", _fused_dropout, _composite_dropout)


@contextlib.contextmanager
def cuda_kernel_routing() -> Iterator[None]:
    """Route dropout and attention to kernels whose saved tensors match CUDA's (NOTE, items 1-2).

    The functions are swapped on ``torch.nn.functional`` for the duration, so that calls made at any
    time inside, including the forward that activation checkpointing recomputes during backward,
    take the CUDA-like path. Code that bound these functions by name at import time keeps the CPU
    path (a limitation; all of torch.nn and transformers look them up on the module).
    """
    _register_fused_dropout()
    _MATH_PATH.clear()
    saved = {name: getattr(F, name) for name in (*_DROPOUT_NAMES, "scaled_dot_product_attention")}
    try:
        for name in _DROPOUT_NAMES:
            setattr(F, name, _dropout_like_cuda(saved[name]))
        F.scaled_dot_product_attention = _sdpa_like_cuda(saved["scaled_dot_product_attention"])
        with overrides.enabled("cuda dropout"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)


# -- 3. autocast ---------------------------------------------------------------------------------
# CUDA's autocast ops that run in float32 (autocast_mode.cpp, KERNEL_CUDA(..., fp32)).
CUDA_FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "rms_norm", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip
# Ops CPU autocast runs in float32 and CUDA autocast leaves alone (they run in the dtype they are given):
# cross-entropy is the one that matters, since CUDA runs it as log_softmax in the logits' dtype and
# casts only nll_loss's input, so a bf16 LM keeps bf16 log-probabilities and a bf16 gradient of the
# logits where a CPU trace would keep fp32 ones (an H200 measured the difference, 0.76 GiB for GPT-2
# small at batch 8). Linear algebra, FFTs and the like, also CPU-only fp32 ops, are left as the CPU
# runs them: several of their CUDA kernels refuse half precision, so a step that reaches them in bf16
# fails on a GPU either way. Each is released only where this torch's CUDA autocast has no kernel.
CPU_ONLY_FP32_OPS = (
    "cross_entropy_loss", "ctc_loss.IntList", "ctc_loss.Tensor", "multilabel_margin_loss_forward",
    "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d", "fractional_max_pool2d",
    "fractional_max_pool3d", "max_unpool2d", "max_unpool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "grid_sampler_2d", "grid_sampler_3d",
)  # fmt: skip
# ... and those that run with dtype=float32 when the caller gave no dtype (fp32_set_opt_dtype).
CUDA_FP32_OPT_DTYPE_OPS = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "sum", "sum.dim_IntList",
)  # fmt: skip

_LOW = (torch.bfloat16, torch.float16)
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fp32(v) for v in x)
    return x


def _fp32_kernel(op: Any) -> Callable:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return op(*_to_fp32(args), **{k: _to_fp32(v) for k, v in kwargs.items()})

    return kernel


def _fp32_opt_dtype_kernel(op: Any) -> Callable:
    dtype_pos = [i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("dtype")
        if given is None and dtype_pos and dtype_pos[0] < len(args):
            given = args[dtype_pos[0]]
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if given is None and any(isinstance(a, torch.Tensor) and a.dtype in _LOW for a in args):
                if dtype_pos and dtype_pos[0] < len(args):
                    args = (*args[: dtype_pos[0]], torch.float32, *args[dtype_pos[0] + 1 :])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _overload(qualified: str) -> Any:
    name, _, overload = qualified.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def _no_policy(op: Any) -> Callable:
    """What AutocastCPU does for an op it has no kernel for: nothing (the op runs as called)."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return op(*args, **kwargs)

    return kernel


def _released(op: Any) -> Callable:
    """An op CUDA autocast has no kernel for, as CUDA dispatches it: a composite op decomposes with autocast
    still on (``cross_entropy_loss``'s ``nll_loss`` is cast to float32 there), any other runs as called."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(_schema_name(op), "CompositeImplicitAutograd"):
        return _no_policy(op)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return op.decompose(*args, **kwargs)

    return kernel


_CHANGED: list[str] = []


def _schema_name(op: Any) -> str:
    return op._schema.name + (f".{op._schema.overload_name}" if op._schema.overload_name else "")


def _register_autocast_policy() -> list[str]:
    """Register CUDA's policy for the ops CPU autocast leaves alone, and CUDA's absence of one for the ops
    only CPU autocast runs in float32, once (``memory/trace/overrides.py``)."""
    if _CHANGED:
        return _CHANGED
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for names, make in ((CUDA_FP32_OPS, _fp32_kernel), (CUDA_FP32_OPT_DTYPE_OPS, _fp32_opt_dtype_kernel)):
        for qualified in names:
            op = _overload(qualified)
            if op is None or not has(_schema_name(op), "AutocastCUDA") or has(_schema_name(op), "AutocastCPU"):
                continue  # not in this torch's CUDA list; or CPU autocast has a policy too (float32): the CPU's
            overrides.register("cuda autocast", qualified, "AutocastCPU", make(op), _no_policy(op))
            _CHANGED.append(qualified)
    for qualified in CPU_ONLY_FP32_OPS:
        op = _overload(qualified)
        if op is None or not has(_schema_name(op), "AutocastCPU") or has(_schema_name(op), "AutocastCUDA"):
            continue
        # Outside CUDA traces the CPU's own policy stands: the fallback is that policy (float32).
        overrides.register("cuda autocast", qualified, "AutocastCPU", _released(op), _fp32_kernel(op))
        _CHANGED.append(qualified)
    return _CHANGED


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[list[str]]:
    """While active, CPU autocast casts like CUDA autocast (NOTE, item 3); yields the ops changed."""
    changed = _register_autocast_policy()
    with overrides.enabled("cuda autocast"):
        yield list(changed)


def cuda_emulation(
    policy: PrecisionPolicy, capability: tuple[int, int] = (8, 0)
) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context that makes a fake-CPU trace allocate like CUDA (NOTE, items 1-3 and 8) on a
    GPU of ``capability`` (which some libraries' branches read: ``memory/kernels/fused_loss.py``)."""
    @contextlib.contextmanager
    def emulate() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if policy.autocast_dtype is not None:
                stack.enter_context(cuda_autocast_policy())
            stack.enter_context(cuda_kernel_routing())
            stack.enter_context(quantized.cuda_int8_matmul())
            stack.enter_context(target_capability(capability))
            yield

    return emulate
