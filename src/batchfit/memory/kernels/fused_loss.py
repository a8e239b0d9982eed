"""Fused linear cross-entropy losses (Liger, cut cross-entropy), traced by what they allocate.

A causal language model's default loss materialises the logits, tokens x vocabulary, in fp32 (the
largest single tensor of a 128k-vocabulary model, several times over in backward). Liger's fused
linear cross-entropy and cut cross-entropy never hold them whole: Liger computes the logits a chunk of
tokens at a time and their gradients in the forward; cut cross-entropy never writes them at all. Their
kernels are Triton, which a CPU-only machine cannot run, but their Python wrappers allocate with
ordinary torch ops around those kernels. The two autograd functions here are those wrappers, line for
line, with each kernel replaced by what it does to memory: it writes its outputs in place and
allocates nothing (NOTE [ Liger's fused linear cross-entropy ], NOTE [ Cut cross-entropy ]). They run
on fake and on real tensors alike, so the CPU estimate of a step that uses them is exact.

``fused_losses_traced`` puts them in place of the real ones while a step is traced, when the user's
own loss calls Liger or cut cross-entropy (imported, so a GPU machine's step traced elsewhere); a
workload named with ``fused_loss=`` calls them itself (``sources/fused.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import ConfigError

IGNORE_INDEX = -100
KINDS = ("liger", "cce")

_CAPABILITY: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("capability", default=(0, 0))
"""The target GPU's compute capability, (0, 0) for none: Liger's branches depend on the device."""


@contextlib.contextmanager
def target_capability(capability: tuple[int, int]) -> Iterator[None]:
    """Fused losses traced for a GPU of ``capability`` take that GPU's branches."""
    token = _CAPABILITY.set(tuple(capability))  # type: ignore[arg-type]
    try:
        yield
    finally:
        _CAPABILITY.reset(token)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _autocast_on(t: torch.Tensor) -> bool:
    try:
        return bool(torch.is_autocast_enabled(t.device.type))
    except TypeError:  # torch < 2.4 takes no device type
        return bool(torch.is_autocast_enabled())


def _addmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with no temporary, as CUDA's ``addmm`` (with an fp32 ``out_dtype`` for 16-bit
    operands) does; a CPU kernel that lacks the mixed-dtype form adds a temporary instead.

    Some torch releases (2.11) have CUDA's mixed-dtype kernel (``addmm.dtype_out``) but no fake kernel for it
    (``_fake_dtype_addmm``): the step the trace stands for writes ``out`` in place, allocating nothing, and so
    does the trace then: ``out`` keeps its storage and only its value is no longer known."""
    mixed = out.dtype != a.dtype
    if not mixed or _fake_dtype_addmm():
        try:
            torch.addmm(out, a, b, out=out, **({"out_dtype": out.dtype} if mixed else {}))
            return
        except (NotImplementedError, RuntimeError):
            pass  # the kernel lacks the form: the temporary below
    elif hasattr(torch.ops.aten.addmm, "dtype_out"):
        from ..trace.values import forget

        forget(out)
        return
    out += torch.mm(a, b).to(out.dtype)


@functools.cache
def _fake_dtype_addmm() -> bool:
    """Whether fake tensors run ``addmm``'s ``out_dtype`` form, found once per process. torch 2.11's fake mode
    hands it to the plain ``addmm`` decomposition, ``out_dtype`` landing where ``beta`` goes (a ``TypeError``,
    which the fake mode also logs: silenced for this probe); a torch without the form refuses the keyword."""
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with _disable_current_modes(), FakeTensorMode():
            out = torch.empty(2, 2)
            a, b = torch.empty(2, 3, dtype=torch.bfloat16), torch.empty(3, 2, dtype=torch.bfloat16)
            torch.addmm(out, a, b, out=out, out_dtype=torch.float32)
        return True
    except Exception:  # noqa: BLE001 - any refusal: the form is not traced on this torch
        return False
    finally:
        log.setLevel(level)


# NOTE [ Liger's fused linear cross-entropy ]
# liger_kernel/ops/fused_linear_cross_entropy.py (0.8), `fused_linear_cross_entropy_forward`, run in the
# forward (`LigerFusedLinearCrossEntropyFunction.forward`, under `amp_custom_fwd`, grad mode off):
#   - chunks of `chunk_size = next_power_of_2(ceil(BT / ceil(V / H)))` tokens (at most BT): a chunk's
#     logits are about as large as the hidden states, [chunk, V] in the input's dtype (or autocast's);
#   - `grad_input = zeros_like(input)` [BT, H]; `grad_weight = zeros_like(weight)` when the head trains
#     (none for a frozen head, as with LoRA); `loss_1d` fp32 [BT]; `target != ignore_index` [BT];
#   - `_can_use_mm_out` (CUDA, grad off, input and weight of one dtype and, under autocast, autocast's):
#     one `logits_storage` [chunk, V] reused by `torch.mm(out=)` and `grad_input[...]` written by
#     `torch.mm(out=)`; otherwise each chunk's `input_chunk @ weight.t()` is a new tensor (autocast
#     casting the weight for it) and `grad_logits @ weight` a new one copied into `grad_input`;
#   - the Triton cross-entropy kernel writes the loss into `loss_1d` and the logits' gradient over the
#     logits, in place;
#   - `grad_weight`: on sm >= 80 with 16-bit logits, an `addmm` into it (fp32 `out_dtype` for an fp32
#     weight, torch >= 2.8), the input chunk cast to the logits' dtype; else `grad_weight += mm(...).float()`;
#   - the loss is `sum(loss_1d)`; `grad_weight.to(weight.dtype)`; grad_input and grad_weight are saved
#     for backward, which scales them in place (`element_mul_kernel`) and returns them.
# `LigerForCausalLMLoss` (liger_kernel/transformers/model/loss_utils.py) shifts the labels with
# `pad(labels, (0, 1), value=-100)[..., 1:].contiguous()`, views the hidden states as [BT, H], and
# divides a summed loss by `num_items_in_batch` (the mean otherwise).
class LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy, its Triton kernels replaced by what they allocate (nothing)."""

    @staticmethod
    def forward(ctx: Any, _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                ignore_index: int = IGNORE_INDEX, reduction: str = "mean") -> torch.Tensor:  # fmt: skip
        input_requires_grad = _input.requires_grad
        weight_needs_grad = weight.requires_grad
        BT, H = _input.shape
        V = weight.shape[0]
        inc_factor = -(-V // H)
        chunk_size = min(_next_power_of_2(-(-BT // inc_factor)), BT)
        num_chunks = -(-BT // chunk_size)
        with torch.no_grad():
            grad_input = torch.zeros_like(_input)
            grad_weight = torch.zeros_like(weight) if input_requires_grad and weight_needs_grad else None
            loss_1d = torch.zeros(BT, dtype=torch.float32, device=_input.device)
            target_mask = target != ignore_index
            n_non_ignore = target_mask.sum()
            on_gpu = _CAPABILITY.get() != (0, 0)
            use_mm_out = on_gpu and _input.dtype == weight.dtype and _input.dtype in (
                torch.float16, torch.bfloat16, torch.float32)  # fmt: skip
            if use_mm_out and _autocast_on(_input):
                use_mm_out = _input.dtype == torch.get_autocast_dtype(_input.device.type)
            logits_storage = torch.empty((chunk_size, V), dtype=_input.dtype, device=_input.device) if use_mm_out \
                else None  # fmt: skip
            sm80 = _CAPABILITY.get()[0] >= 8
            for chunk_id in range(num_chunks):
                start, end = chunk_id * chunk_size, min((chunk_id + 1) * chunk_size, BT)
                input_chunk = _input[start:end]
                if logits_storage is not None:
                    logits_chunk = logits_storage[: end - start]
                    torch.mm(input_chunk, weight.t(), out=logits_chunk)
                else:
                    logits_chunk = input_chunk @ weight.t()
                logits_chunk = logits_chunk.contiguous()
                loss_1d[start:end].zero_()  # the cross-entropy kernel: loss and gradient written in place
                logits_chunk.zero_()
                grad_logits_chunk = logits_chunk
                del logits_chunk
                if input_requires_grad:
                    if use_mm_out and grad_logits_chunk.dtype == grad_input.dtype:
                        torch.mm(grad_logits_chunk, weight, out=grad_input[start:end])
                    else:
                        grad_input[start:end] = grad_logits_chunk @ weight
                if grad_weight is not None:
                    low = grad_logits_chunk.dtype in (torch.float16, torch.bfloat16)
                    if sm80 and low and grad_weight.dtype in (torch.float32, grad_logits_chunk.dtype):
                        chunk = input_chunk if input_chunk.dtype == grad_logits_chunk.dtype \
                            else input_chunk.to(grad_logits_chunk.dtype)  # fmt: skip
                        _addmm_into(grad_weight, grad_logits_chunk.t(), chunk)
                        del chunk
                    else:
                        grad_weight += torch.mm(grad_logits_chunk.t(), input_chunk).float()
                del grad_logits_chunk, input_chunk
            del logits_storage
            loss = torch.sum(loss_1d)
            if reduction == "mean":
                loss = loss / n_non_ignore
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_input, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *unused: Any) -> tuple:
        grad_input, grad_weight = ctx.saved_tensors
        with torch.no_grad():
            grad_input.mul_(grad_output)  # element_mul_kernel, in place
            if grad_weight is not None:
                grad_weight.mul_(grad_output)
        return (grad_input, grad_weight, *([None] * (len(ctx.needs_input_grad) - 2)))


def liger_loss(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, *,
               shift: bool = True, reduction: str = "mean") -> torch.Tensor:  # fmt: skip
    """``LigerForCausalLMLoss`` (``shift``: labels not yet shifted, as a transformers model takes them), or
    ``LigerFusedLinearCrossEntropyLoss`` on targets already shifted (NOTE [ Liger's fused linear cross-entropy ])."""
    if shift:
        labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    return LigerFusedLinearCrossEntropy.apply(hidden, lm_head_weight, labels.reshape(-1), IGNORE_INDEX, reduction)


# NOTE [ Cut cross-entropy ]
# cut_cross_entropy/cce.py (25.1), `cce_linear_cross_entropy` and `LinearCrossEntropyFunction`:
#   - `e.contiguous()`; `valids = (targets != ignore_index).nonzero().to(int32)` of the shifted targets
#     (None when all are valid and nothing is shifted); e flattened to [BT, D];
#   - forward (`cce_lse_forward_kernel`, `indexed_neg_dot_forward_kernel`): `lse` fp32 [B] (B: valid
#     tokens), `locks` uint32 [ceil(B / 128)], with `filter_eps` (its default, "auto", for 16-bit
#     inputs) the `logit_avg` fp32 [V]; `neg_dot` fp32 [B], to which `lse` is added in place; the loss
#     is its mean or sum; e, c, lse, the targets, valids and logit_avg are saved;
#   - backward (`cce_backward_kernel`): `argsort(logit_avg).to(int32)` when it was kept; `de =
#     zeros_like(e)`, `dc = zeros_like(c, dtype=e.dtype)` when the classifier trains, returned as
#     `dc.to(c.dtype)`. Nothing of tokens x vocabulary is ever allocated.
class CutCrossEntropy(torch.autograd.Function):
    """Cut cross-entropy's linear cross-entropy, its Triton kernels replaced by what they allocate."""

    @staticmethod
    def forward(ctx: Any, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, valids: torch.Tensor | None,
                reduction: str = "mean", filter_eps: bool = True) -> torch.Tensor:  # fmt: skip
        needs_grad = e.requires_grad or c.requires_grad
        with torch.no_grad():
            B = valids.numel() if valids is not None else e.shape[0]
            lse = e.new_full((B,), -float("inf"), dtype=torch.float32)
            locks = torch.zeros(-(-B // 128), dtype=torch.int32, device=e.device)  # uint32 in the source: 4 bytes
            logit_avg = e.new_zeros((c.shape[0],), dtype=torch.float32) if needs_grad and filter_eps else None
            del locks
            neg_dot = e.new_zeros((B,), dtype=torch.float32)
            nll = neg_dot.add_(lse)
            loss = nll.mean() if reduction == "mean" else nll.sum()
        ctx.save_for_backward(e, c, lse, targets, valids, logit_avg)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        e, c, lse, targets, valids, logit_avg = ctx.saved_tensors
        with torch.no_grad():
            vocab_ordering = torch.argsort(logit_avg).to(torch.int32) if logit_avg is not None else None
            de = torch.zeros_like(e)
            dc = torch.zeros_like(c, dtype=e.dtype) if ctx.needs_input_grad[1] else None
            del vocab_ordering
        return de, dc.to(c.dtype) if dc is not None else None, None, None, None, None


def cce_loss(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, *,
             shift: bool = True, reduction: str = "mean") -> torch.Tensor:  # fmt: skip
    """``linear_cross_entropy(hidden, weight, labels, shift=...)`` as cut cross-entropy's transformers patch
    calls it: the hidden states in the classifier's dtype under autocast (its backward takes 16-bit
    embeddings only) (NOTE [ Cut cross-entropy ])."""
    e = hidden_states.to(torch.get_autocast_dtype(hidden_states.device.type)) if _autocast_on(hidden_states) \
        else hidden_states  # fmt: skip
    if e.dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(
            f"cut cross-entropy's backward takes 16-bit hidden states, these are {e.dtype}; train with "
            "--precision bf16, fp16 or bf16-true (or use --fused-loss liger)"
        )
    e = e.contiguous()
    targets = labels.contiguous()
    flat = targets[..., 1:] if shift else targets.flatten()
    valids = (flat != IGNORE_INDEX).nonzero().to(torch.int32)
    if not shift:
        valids = valids.squeeze(1) if valids.numel() != flat.numel() else None
    else:  # cut_cross_entropy/utils.py, `_build_flat_valids`: flat offsets of the valid (shifted) positions
        for i in range(flat.ndim - 1):
            valids[:, i] *= flat.stride(i)
        valids = valids.sum(1)
    e = e.flatten(0, -2)
    return CutCrossEntropy.apply(e, lm_head_weight, targets.flatten(), valids, reduction, True)


@contextlib.contextmanager
def fused_losses_traced() -> Iterator[list[str]]:
    """While active, a step whose loss calls Liger's or cut cross-entropy's autograd function runs the
    stand-ins above instead (their kernels need Triton on a GPU); yields notes of what was replaced."""
    notes: list[str] = []
    targets = [
        ("liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction", _liger_forward,
         LigerFusedLinearCrossEntropy.backward, "Liger's fused linear cross-entropy"),
        ("cut_cross_entropy.cce", "LinearCrossEntropyFunction", _cce_forward, _cce_backward, "cut cross-entropy"),
    ]  # fmt: skip
    with contextlib.ExitStack() as stack:
        for module_name, class_name, forward, backward, label in targets:
            cls = getattr(sys.modules.get(module_name), class_name, None)
            if cls is None:
                continue
            for name, value in (("forward", forward), ("backward", backward)):
                stack.callback(setattr, cls, name, cls.__dict__[name])
                setattr(cls, name, staticmethod(value))
            notes.append(f"{label}: traced by what its Triton kernels allocate (memory/kernels/fused_loss.py)")
        yield notes


def _liger_forward(
    ctx: Any, _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Any = None,
    ce_weight: Any = None, ignore_index: int = IGNORE_INDEX, lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0, reduction: str = "mean", *args: Any, **kwargs: Any,
) -> Any:  # fmt: skip
    loss = LigerFusedLinearCrossEntropy.forward(ctx, _input, weight, target, ignore_index, reduction)
    return loss, None, None, None


def _cce_forward(ctx: Any, e: torch.Tensor, c: torch.Tensor, params: Any) -> torch.Tensor:
    ctx.params = params
    return CutCrossEntropy.forward(ctx, e, c, params.targets, params.valids, params.reduction,
                                   params.filter_eps is not None)  # fmt: skip


def _cce_backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
    de, dc, *_ = CutCrossEntropy.backward(ctx, grad_out)
    return de, dc, None
