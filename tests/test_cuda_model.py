"""The CUDA kernel model (``memory/kernels/cuda.py``): one test per correction of its NOTE, with exact bytes.

Each test traces a tiny model the way ``batchfit.estimate`` does for a device (``trace_for_device``) and
compares what the corrections keep against byte counts derived here from the shapes. Sizes are
multiples of 512 bytes so that the CUDA allocator's rounding (``round_size``) does not blur them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchfit
from batchfit import Workload
from batchfit.gpu.catalog import get_device
from batchfit.memory.allocator.caching import round_size
from batchfit.memory.categories import Category
from batchfit.memory.estimate import trace_for_device
from batchfit.memory.trace.fake_step import MemoryTrace
from batchfit.precision import policy_for
from batchfit.third_party import torch_release

B, D = 512, 64  # rows and width of the small models: B*D fp32 = 128 KiB
F32, BF16, BOOL = 4, 2, 1  # bytes per element


def trace(workload: Workload, batch_size: int, device: str, precision: str = "fp32") -> tuple[MemoryTrace, bool]:
    """The trace ``estimate`` makes for ``device``, and whether its sizes are rounded (CUDA)."""
    dev = get_device(device)
    policy = policy_for(precision, bf16_supported=dev.bf16 or dev.exact, device_name=dev.name)
    return trace_for_device(workload, batch_size, dev, policy, ()), not dev.exact


def _size(t: MemoryTrace, sid: int, rounded: bool) -> int:
    return round_size(t.nbytes[sid]) if rounded else t.nbytes[sid]


def _phase_bounds(t: MemoryTrace, phase: str, step: int) -> tuple[int, int]:
    starts = [i for i, _, _ in t.phases]
    start = next(i for i, p, s in t.phases if (p, s) == (phase, step))
    later = [i for i in starts if i > start]
    return start, min(later) if later else len(t.events)


def _alive_before(t: MemoryTrace, index: int) -> set[int]:
    alive: set[int] = set()
    for e in t.events[:index]:
        if e >= 0:
            alive.add(e)
        else:
            alive.discard(~e)
    return alive


def saved_bytes(workload: Workload, batch_size: int, device: str, precision: str = "fp32") -> int:
    """Bytes autograd holds for backward when the steady-state (second) backward starts."""
    t, rounded = trace(workload, batch_size, device, precision)
    start, _ = _phase_bounds(t, "backward", 1)
    return sum(_size(t, s, rounded) for s in _alive_before(t, start) if t.role.get(s) == Category.ACTIVATIONS)


def _sum_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().sum()  # SumBackward keeps nothing, so only the model's saved tensors count


# -- 1. dropout ---------------------------------------------------------------------------------
class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(D, D), nn.Dropout(0.1), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.fc1(x)))


def test_dropout_keeps_a_one_byte_mask_on_cuda() -> None:
    wl = Workload(model=DropoutNet, batch=lambda b: torch.randn(b, D), loss=_sum_loss)
    # fc2 keeps the dropped activations (B*D fp32) on both devices. The CPU's composite dropout keeps
    # its mask in the input's dtype (B*D fp32); CUDA's fused native_dropout keeps a bool mask (B*D bytes).
    assert saved_bytes(wl, B, "cpu") == B * D * F32 + B * D * F32
    assert saved_bytes(wl, B, "A100-40GB") == B * D * F32 + B * D * BOOL


def test_cuda_dropout_allocates_its_mask_before_its_output() -> None:
    """CUDA's ``dropout_cuda`` makes the mask first (NOTE, item 1): the order decides which cached blocks the two
    take (a GPT-2 step with paged 8-bit AdamW on an H200: reserved +13% with the output first, -0.02% with the mask
    first)."""
    wl = Workload(model=DropoutNet, batch=lambda b: torch.randn(b, D), loss=_sum_loss)
    t, _ = trace(wl, B, "A100-40GB")
    made = [s for s in t.events if s >= 0 and t.op.get(s) == "aten.native_dropout.default"]
    assert [t.nbytes[s] for s in made] == [B * D * BOOL, B * D * F32] * 2  # two steps: the mask, then the output


# -- 2. attention -------------------------------------------------------------------------------
T, H, HEAD = 64, 2, 32  # sequence, heads, head size
E = H * HEAD


class Attention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.qkv = nn.Linear(E, 3 * E, bias=False)
        self.proj = nn.Linear(E, E, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, HEAD).permute(2, 0, 3, 1, 4)  # 3 x (b, h, t, head)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)  # (b, h, t, head)
        return self.proj(y.transpose(1, 2).reshape(b, t, E))  # (b, t, e)


def _attention(dropout: float) -> Workload:
    return Workload(model=lambda: Attention(dropout), batch=lambda b: torch.randn(b, T, E), loss=_sum_loss)


def test_attention_with_dropout_keeps_no_t_by_t_matrix_on_cuda() -> None:
    b = 2
    bhtt, bhtd, bht = b * H * T * T, b * H * T * HEAD, b * H * T
    # CUDA's flash / memory-efficient kernels keep q, k, v (one qkv projection), the output and a fp32
    # log-sum-exp, and regenerate dropout from a seed: dropout changes nothing.
    flash = (b * T * 3 * E + bhtd + bht) * F32
    assert saved_bytes(_attention(0.1), b, "A100-40GB") == flash
    assert saved_bytes(_attention(0.0), b, "A100-40GB") == flash
    # The CPU falls back to the math path whenever there is dropout: softmax probabilities, the fp32
    # dropout mask and the dropped probabilities (three B*H*T*T tensors), plus copies of the scaled
    # q and k, of v and of the output for the projection.
    math = (3 * bhtt + 4 * bhtd) * F32
    assert saved_bytes(_attention(0.1), b, "cpu") == math
    assert math - flash == (3 * bhtt + 3 * bhtd - b * T * 3 * E - bht) * F32  # what the correction removes


@pytest.mark.parametrize(("precision", "dtype_bytes"), [("bf16", 2), ("fp32", 4)])
def test_a_fused_attention_backward_takes_a_workspace_after_its_gradients(precision: str, dtype_bytes: int) -> None:
    """B*H*T*(D + 1)*4 + 256 bytes, after dq, dk, dv, freed at once (measured on an H200 to the byte; NOTE,
    item 2b); none for fp32, which takes memory-efficient attention."""
    b = 2
    t, _ = trace(_attention(0.0), b, "H200", precision)
    events = [e for e in t.events]
    spaces = [i for i, e in enumerate(events) if e >= 0 and t.op.get(e) == "attention backward workspace"]
    if precision == "fp32":
        assert spaces == []
        return
    assert [t.nbytes[events[i]] for i in spaces] == [b * H * T * (HEAD + 1) * 4 + 256] * 2  # two steps
    for i in spaces:
        grads = events[i - 3 : i]
        assert all(t.op.get(g) == "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" for g in grads)
        assert [t.nbytes[g] for g in grads] == [b * H * T * HEAD * dtype_bytes] * 3
        assert events[i + 1] == ~events[i]


class BiasedAttention(Attention):
    """Attention with a learned additive bias (T5's relative positions): a mask that needs a gradient."""

    def __init__(self) -> None:
        super().__init__(0.1)
        self.bias = nn.Parameter(torch.zeros(1, H, T, T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, HEAD).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=self.dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, E))


def test_dropout_inside_cpp_composites_keeps_a_one_byte_mask_on_cuda() -> None:
    # A mask that needs a gradient sends attention down the math path on both devices; its dropout of the
    # B*H*T*T probabilities is aten::dropout called from C++ (not F.dropout): a bool mask on CUDA.
    wl = Workload(model=BiasedAttention, batch=lambda b: torch.randn(b, T, E), loss=_sum_loss)
    b = 2
    bhtt = b * H * T * T
    assert saved_bytes(wl, b, "cpu") - saved_bytes(wl, b, "A100-40GB") == bhtt * (F32 - BOOL)


HQ, HKV = 4, 2  # query heads, key/value heads of grouped-query attention


class GroupedQueryAttention(nn.Module):
    """Causal attention with half as many key/value heads as query heads: SDPA's ``enable_gqa``, or the
    key/value heads repeated first (transformers' ``repeat_kv``)."""

    def __init__(self, native: bool) -> None:
        super().__init__()
        self.native = native
        self.q = nn.Linear(HQ * HEAD, HQ * HEAD, bias=False)
        self.kv = nn.Linear(HQ * HEAD, 2 * HKV * HEAD, bias=False)
        self.proj = nn.Linear(HQ * HEAD, HQ * HEAD, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HQ, HEAD).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, HKV, HEAD).permute(2, 0, 3, 1, 4)
        if self.native:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, HQ * HEAD))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grouped_query_attention_in_fp32_runs_the_math_path_on_cuda_before_torch_2_14(precision: str) -> None:
    def workload(native: bool) -> Workload:
        return Workload(model=lambda: GroupedQueryAttention(native), batch=lambda n: torch.randn(n, T, HQ * HEAD),
                        loss=_sum_loss)  # fmt: skip

    def saved(native: bool) -> int:
        return saved_bytes(workload(native), 2, "A100-40GB", precision)

    bhtt, bht = 2 * HQ * T * T, 2 * HQ * T
    # Flash attention takes bf16 with fewer key/value heads natively, keeping the key and value as given where
    # the repeated version keeps them repeated per query head (NOTE, item 2c); no fused kernel took fp32 with
    # them before torch 2.14 (memory-efficient attention had no grouped-query attention), so CUDA ran the math
    # path, which keeps the B*H*T*T probabilities where a fused kernel keeps a B*H*T log-sum-exp.
    math = precision == "fp32" and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 14)
    itemsize = F32 if precision == "fp32" else BF16
    repeated_kv = 2 * 2 * (HQ - HKV) * T * HEAD * itemsize  # the key and value, two items, the extra heads
    assert saved(native=True) - saved(native=False) == ((bhtt - bht) * F32 if math else -repeated_kv)
    said = [n for n in trace(workload(True), 2, "A100-40GB", precision)[0].notes if "math path" in n]
    assert said == (["attention with fewer key/value heads than query heads, in float32, runs PyTorch's math path "
                     "on CUDA before torch 2.14 (no fused kernel takes it) and keeps its B x H x T x T scores; bf16 "
                     "autocast (or kbit_prep=false for QLoRA) keeps flash attention"] if math else [])


@pytest.mark.skipif(torch_release() >= (2, 14), reason="fp32 grouped-query attention takes a fused kernel from 2.14")
def test_the_math_path_adds_the_mask_to_the_scores_in_place_as_cuda_does() -> None:
    """CUDA's ``_scaled_dot_product_attention_math`` adds the (causal) mask to the scores in place on plain tensors:
    the B x H x T x T tensors a step makes are the scores and their softmax, per attention call, and no sum."""
    t, _ = trace(Workload(model=lambda: GroupedQueryAttention(True), batch=lambda n: torch.randn(n, T, HQ * HEAD),
                          loss=_sum_loss), 2, "A100-40GB", "fp32")  # fmt: skip
    made = [t.op[s] for s in t.events if s >= 0 and t.nbytes[s] == 2 * HQ * T * T * F32]
    assert sorted(set(made)) == ["aten._safe_softmax.default", "aten._softmax_backward_data.default",
                                 "aten.bmm.default"]  # fmt: skip
    assert made.count("aten._safe_softmax.default") == 2  # one attention call per step, two steps


def test_grouped_query_attention_backward_makes_its_own_heads_gradients_and_a_larger_workspace() -> None:
    """bf16 grouped-query attention (NOTE, item 2c): the fused backward's gradients of the key and value have the
    key/value head count, and its one workspace is ``B*H*T*D*4`` bytes larger than item 2b's (H the query heads:
    787.06 MiB for a real Qwen2.5-7B step at 7 x 4096 tokens on an H200, 395.06 without it)."""
    b = 2
    wl = Workload(model=lambda: GroupedQueryAttention(True), batch=lambda n: torch.randn(n, T, HQ * HEAD),
                  loss=_sum_loss)  # fmt: skip
    t, _ = trace(wl, b, "H200", "bf16")
    events = list(t.events)
    spaces = [i for i, e in enumerate(events) if e >= 0 and t.op.get(e) == "attention backward workspace"]
    assert [t.nbytes[events[i]] for i in spaces] == [b * HQ * T * (2 * HEAD + 1) * 4 + 256] * 2  # two steps
    for i in spaces:
        grads = events[i - 3 : i]
        assert all(t.op.get(g) == "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" for g in grads)
        assert [t.nbytes[g] for g in grads] == [b * h * T * HEAD * BF16 for h in (HQ, HKV, HKV)]
    from batchfit.memory.kernels.cuda import attention_backward_workspace

    query = torch.empty(7, 28, 4096, 128, dtype=torch.bfloat16, device="meta")
    key = torch.empty(7, 4, 4096, 128, dtype=torch.bfloat16, device="meta")
    assert attention_backward_workspace((None, query, key)) == 825_295_104


# -- 3. autocast --------------------------------------------------------------------------------
class NormSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln = nn.Linear(D, D, bias=False), nn.LayerNorm(D)
        self.fc2, self.fc3 = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.softmax(self.fc2(self.ln(self.fc1(x))), dim=-1))


def test_autocast_bf16_runs_layer_norm_and_softmax_in_fp32_on_cuda() -> None:
    wl = Workload(model=NormSoftmax, batch=lambda b: torch.randn(b, D), loss=_sum_loss)
    common = (
        B * D * BF16  # fc1's input, cast to bf16
        + 2 * B * F32  # layer norm's mean and rstd
        + 2 * D * D * BF16  # the autocast copies of fc2's and fc3's weights (fc1's input needs no grad)
    )
    # CPU autocast runs both in bf16: layer norm keeps its bf16 input, fc2 the bf16 norm output, and the
    # softmax output (bf16) is also fc3's input.
    assert saved_bytes(wl, B, "cpu", "bf16") == common + 3 * B * D * BF16
    # CUDA autocast (fp32 list, fp32_set_opt_dtype): layer norm keeps a fp32 copy of its input, its
    # fp32 output is cast back to bf16 for fc2; softmax keeps a fp32 output, cast to bf16 for fc3.
    cuda = common + B * D * F32 + B * D * BF16 + B * D * F32 + B * D * BF16
    assert saved_bytes(wl, B, "A100-40GB", "bf16") == cuda


V = 256  # classes of the cross-entropy head


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_autocast_bf16_cross_entropy_keeps_bf16_log_probs_on_cuda() -> None:
    wl = Workload(model=Head, batch=lambda b: (torch.randn(b, D), torch.randint(0, V, (b,))), loss=_cross_entropy)
    x = B * D * BF16  # the head's input, cast to bf16 (its weight needs no saving: x needs no grad)
    # CPU autocast runs cross_entropy_loss in fp32: a fp32 copy of the logits, whose fp32 log-softmax is
    # kept (nll_loss's input too), and nll_loss's 4-byte total weight.
    assert saved_bytes(wl, B, "cpu", "bf16") == x + B * V * F32 + 4
    # CUDA autocast has no policy for cross_entropy_loss: log_softmax runs in bf16 (kept), and only
    # nll_loss (fp32 list) casts its input to fp32 (kept as well); the total weight is one 512-byte block.
    assert saved_bytes(wl, B, "A100-40GB", "bf16") == x + B * V * BF16 + B * V * F32 + 512
    t, _ = trace(wl, B, "A100-40GB", "bf16")
    start, end = _phase_bounds(t, "backward", 1)
    grads = [t.nbytes[s] for s in t.events[start:end] if s >= 0 and t.op.get(s) in (
        "aten.nll_loss_backward.default", "aten._log_softmax_backward_data.default")]  # fmt: skip
    assert grads == [B * V * F32, B * V * BF16]  # the logits' gradient comes back in bf16


# -- 4. cuBLAS workspaces -----------------------------------------------------------------------
@pytest.mark.parametrize("device, per_handle", [("A100-40GB", 8_519_680), ("H100-80GB", 32 * 2**20)])
def test_one_cublas_workspace_per_handle(device: str, per_handle: int) -> None:
    wl = Workload(model=DropoutNet, batch=lambda b: torch.randn(b, D), loss=_sum_loss)
    t, _ = trace(wl, 8, device)
    workspaces = sorted(op for op in t.op.values() if op.startswith("cuBLAS workspace"))
    assert workspaces == ["cuBLAS workspace (autograd thread)", "cuBLAS workspace (main thread)"]
    assert get_device(device).cublas_handles == len(workspaces)
    sizes = {t.nbytes[sid] for sid, op in t.op.items() if op.startswith("cuBLAS workspace")}
    assert sizes == {per_handle}
    est = batchfit.estimate(wl, 8, device=device)
    assert est.workspace_bytes == 2 * per_handle
    assert not any(op.startswith("cuBLAS") for op in trace(wl, 8, "cpu")[0].op.values())


# -- 5. foreach optimizer -----------------------------------------------------------------------
N_LAYERS = 4


def _layers() -> nn.Module:
    return nn.Sequential(*(nn.Linear(D, D, bias=False) for _ in range(N_LAYERS)))


def optimizer_scratch(device: str) -> tuple[int, set[str]]:
    """Peak temporaries during the second optimizer step above those live when it starts; foreach ops."""
    wl = Workload(model=_layers, batch=lambda b: torch.randn(b, D), loss=_sum_loss)  # AdamW, foreach=None
    t, rounded = trace(wl, 8, device)
    start, end = _phase_bounds(t, "optimizer", 1)
    live = peak = 0
    for e in t.events[start:end]:
        sid = e if e >= 0 else ~e
        if t.role.get(sid) == Category.TEMPORARIES:
            live += _size(t, sid, rounded) if e >= 0 else -_size(t, sid, rounded)
            peak = max(peak, live)
    return peak, {op for op in t.op.values() if op.startswith("aten._foreach")}


def test_optimizer_runs_foreach_on_cuda_only() -> None:
    param = D * D * F32
    # On a CUDA device torch resolves foreach=None to the multi-tensor AdamW: _foreach_sqrt makes one
    # temporary per parameter, the whole group at once.
    peak, foreach = optimizer_scratch("A100-40GB")
    assert peak == N_LAYERS * param
    assert "aten._foreach_sqrt.default" in foreach
    # On the CPU it is the per-parameter loop: sqrt and its division for one parameter, while the
    # previous parameter's ``denom`` is still referenced (plus a few bytes of scalar scratch).
    peak, foreach = optimizer_scratch("cpu")
    assert not foreach
    assert 3 * param <= peak < 3 * param + 512 < N_LAYERS * param


# -- 5. recurrent layers: cuDNN's reserve space ---------------------------------------------------------
class _LSTM(nn.Module):
    def __init__(self, bidirectional: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2, bidirectional=bidirectional)
        self.head = nn.Linear(64 if bidirectional else 32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][-1])


def _lstm_workload(bidirectional: bool) -> Workload:
    return Workload(
        model=lambda: _LSTM(bidirectional),
        batch=lambda b: (torch.randn(10, b, 16), torch.randint(0, 3, (b,))),  # (T, B, features)
        loss=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
    )


@pytest.mark.parametrize("bidirectional", [False, True])
def test_cuda_lstm_keeps_a_cudnn_reserve_per_layer_and_direction(bidirectional: bool) -> None:
    from batchfit.memory.kernels.cuda import cudnn_rnn_reserve_bytes

    t, _ = trace(_lstm_workload(bidirectional), 8, "A100-40GB")
    start, end = _phase_bounds(t, "forward", 1)
    layers = [s for s in t.events[start:end] if s >= 0 and t.op.get(s) == "aten.mkldnn_rnn_layer.default"]
    first = cudnn_rnn_reserve_bytes(10 * 8, 32, 2, F32)
    assert first == 10 * 8 * 32 * 5 * 4  # LSTM: 4 gates, the cell and the hidden state, less the layer's output
    # a bidirectional stack's second layer reads the first's concatenation, which the trace keeps for it
    second = cudnn_rnn_reserve_bytes(10 * 8, 32, 2, F32, takes_concatenation=bidirectional)
    reserves = [s for s in layers if t.nbytes[s] in (first, second) and t.nbytes[s] > 10 * 8 * 32 * 4]
    assert sorted(t.nbytes[s] for s in reserves) == sorted([first, second] * (2 if bidirectional else 1))
    back_start, _ = _phase_bounds(t, "backward", 1)
    assert set(reserves) <= _alive_before(t, back_start)  # kept from the forward for the backward


def _measured_lstms() -> list[dict]:
    """The first time-major LSTM of each depth, direction and dtype among the recurrent problems measured on an
    H200 (``benchmarks/cudnn_workspaces.py --rnn-seconds``), each cuDNN call's outputs recorded."""
    import gzip
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/cudnn-H200-2026-11-28/rnn_events.jsonl.gz"
    chosen: dict[tuple, dict] = {}
    with gzip.open(path, "rt") as f:
        for row in map(json.loads, f):
            if (row["mode"] == "LSTM" and not row["proj"] and not row["batch_first"] and "error" not in row
                    and row["dtype"] != "fp16" and row["seq"] > 1 and row["seq"] * row["batch"] * row["hidden"] < 2e6):
                chosen.setdefault((row["layers"], row["bidirectional"], row["dtype"]), row)
    return [chosen[k] for k in sorted(chosen)]


def _lstm_id(row: dict) -> str:
    return f"{row['layers']}x{'bi' if row['bidirectional'] else 'uni'}-{row['dtype']}"


@pytest.mark.parametrize("row", _measured_lstms(), ids=_lstm_id)
def test_cuda_lstm_keeps_for_backward_what_cudnn_kept_on_an_h200(row: dict) -> None:
    """What the traced LSTM keeps for its backward (as requested, before the allocator rounds it) is what cuDNN kept
    on an H200: the reserve and the output ``y`` (the ``_cudnn_rnn`` call's recorded outputs), less the 256 to 296 bytes
    cuDNN adds to the reserve; the trace also keeps the initial states and each layer's final ones,
    ``4 x layers x directions`` vectors of ``B x H``."""
    dtype = torch.float32 if row["dtype"] == "fp32" else torch.bfloat16
    directions = 2 if row["bidirectional"] else 1
    workload = Workload(
        model=lambda: nn.LSTM(row["input"], row["hidden"], row["layers"], bidirectional=row["bidirectional"]).to(dtype),
        batch=lambda b: torch.randn(row["seq"], b, row["input"], dtype=dtype),
        loss=lambda m, x: m(x)[0].float().sum(),
    )
    forward = next(call for call in row["calls"][1] if call["op"] == "_cudnn_rnn")
    y, _, _, reserve, _ = forward["outputs"]
    states = 4 * row["layers"] * directions * row["batch"] * row["hidden"] * (4 if row["dtype"] == "fp32" else 2)
    t, _ = trace(workload, row["batch"], "H200", "fp32" if row["dtype"] == "fp32" else "bf16-true")
    start, _ = _phase_bounds(t, "backward", 1)
    kept = sum(t.nbytes[s] for s in _alive_before(t, start) if t.role.get(s) == Category.ACTIVATIONS)
    assert 256 <= reserve + y - (kept - states) <= 296  # cuDNN's alignment: 256-296 bytes in all 975 problems


def _rnn_problems() -> list[dict]:
    """The 975 recurrent problems measured on an H200 (``benchmarks/cudnn_workspaces.py --rnn-seconds``)."""
    import gzip
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/cudnn-H200-2026-11-28/rnn_events.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _workspaces(row: dict) -> list[int]:
    """The workspace of each cuDNN allocation in a problem's second step: the ``_cudnn_rnn`` block taken just before
    the reserve (freed on return), then the two ``_cudnn_rnn_backward`` blocks freed as soon as taken."""
    out = []
    for call in row["calls"][1]:
        events = call["events"]
        allocs = [(i, size, block) for i, (action, size, block) in enumerate(events) if action == "alloc"]
        if call["op"] == "_cudnn_rnn":
            reserve = call["outputs"][3]
            out += [size for (_, size, _), (_, nxt, _) in zip(allocs, allocs[1:]) if nxt == reserve][:1]
        else:
            out += [size for i, size, block in allocs
                    if i + 1 < len(events) and events[i + 1][0] == "free_requested" and events[i + 1][2] == block]
    return out


def _standard_algo(row: dict) -> bool:
    """PyTorch asks cuDNN for its standard algorithm, forward and backward (``get_algo`` in ``cudnn/RNN.cpp``): above
    the persistent small-hidden kernels' 192 / 128 and, in fp16, outside the persistent heuristics (none sampled)."""
    return row["hidden"] > 192 and not (
        row["dtype"] == "fp16" and row["layers"] == 1 and not row["bidirectional"] and row["hidden"] <= 1024
        and row["hidden"] % 128 == 0 and row["input"] % 128 == 0 and row["batch"] % 8 == 0 and row["batch"] <= 128)


def test_cudnn_lstm_workspace_follows_the_rule_measured_on_an_h200() -> None:
    """cuDNN's LSTM workspace (standard algorithm, no projection) against ``cudnn_rnn_workspace_bytes`` for every such
    problem of the sample: each call's three allocations are one size, and where ``rnn_workspace_covered`` holds it is
    the rule's, as the caching allocator rounds it, in all but the few stacks of one or two steps (and a handful
    of hidden sizes that are no multiple of 16: a few bytes of alignment), never more than 3% above it; outside, the
    rule stays within -5% and +25% of the GPU's."""
    from batchfit.memory.kernels.cuda import cudnn_rnn_workspace_bytes, rnn_workspace_covered

    counts = {"covered": 0, "exact": 0, "outside": 0}
    for row in _rnn_problems():
        if row["mode"] != "LSTM" or row["proj"] or not _standard_algo(row):
            continue
        sizes = _workspaces(row)
        assert len(sizes) == 3 and len(set(sizes)) == 1  # forward, backward data, backward weights: one size
        real = sizes[0]
        itemsize = 4 if row["dtype"] == "fp32" else 2
        rule = cudnn_rnn_workspace_bytes(itemsize, row["input"], row["hidden"], row["layers"], row["bidirectional"],
                                         row["batch"], row["seq"])  # fmt: skip
        if rnn_workspace_covered(row["input"], row["hidden"], row["layers"], row["bidirectional"], row["seq"]):
            counts["covered"] += 1
            counts["exact"] += round_size(rule) == round_size(real)
            assert -0.03 <= (rule - real) / real <= 0
        else:
            counts["outside"] += 1
            assert -0.05 <= (rule - real) / real <= 0.25
    assert counts == {"covered": 220, "exact": 205, "outside": 27}


def test_cudnn_lstm_workspace_of_the_recorded_steps() -> None:
    """The workspaces of the two LSTM steps recorded on an H200 (three per step, ``snapshots-H200-2026-11-26``): the
    2-layer bidirectional classifier (256 -> 512, batch 64 x 128 steps) and the 2-layer language model (512 -> 1024)."""
    from batchfit.memory.kernels.cuda import cudnn_rnn_workspace_bytes

    assert cudnn_rnn_workspace_bytes(4, 256, 512, 2, True, 64, 128) == 320865024
    assert cudnn_rnn_workspace_bytes(4, 512, 1024, 2, False, 64, 128) == 265290496


@pytest.mark.parametrize("bidirectional", [False, True])
def test_cuda_lstm_takes_cudnn_workspace_in_forward_and_twice_in_backward(bidirectional: bool) -> None:
    """One transient of the rule's size inside the stack's forward, two in its backward (data, then weights), each
    sized again at another batch size from the stack's geometry (the rule rounds the batch: not a line)."""
    from batchfit.memory.kernels.cuda import cudnn_rnn_workspace_bytes
    from batchfit.memory.synthesis.scaling import TraceLine

    def workspaces(t: MemoryTrace, phase: str) -> list[int]:
        start, end = _phase_bounds(t, phase, 1)
        return [s for s in t.events[start:end] if s >= 0 and "cuDNN RNN workspace" in str(t.op.get(s))]

    low, _ = trace(_lstm_workload(bidirectional), 6, "H200")
    high, _ = trace(_lstm_workload(bidirectional), 13, "H200")
    expected = cudnn_rnn_workspace_bytes(F32, 16, 32, 2, bidirectional, 6, 10)
    forward, backward = workspaces(low, "forward"), workspaces(low, "backward")
    assert [low.nbytes[s] for s in forward + backward] == [expected] * 3
    assert [low.op[s] for s in backward] == ["cuDNN RNN workspace (backward data)",
                                             "cuDNN RNN workspace (backward weights)"]  # fmt: skip
    assert all(~s in low.events[low.events.index(s) + 1 :][:1] for s in forward + backward)  # freed at once
    predicted = TraceLine(low, 6, high, 13).at(11)
    assert predicted.nbytes[workspaces(high, "forward")[0]] == cudnn_rnn_workspace_bytes(F32, 16, 32, 2, bidirectional,
                                                                                         11, 10)  # fmt: skip


def test_cpu_lstm_counts_onednn_workspace() -> None:
    t, _ = trace(_lstm_workload(False), 8, "cpu")
    start, end = _phase_bounds(t, "forward", 1)
    outputs = [s for s in t.events[start:end] if s >= 0 and t.op.get(s) == "aten.mkldnn_rnn_layer.default"]
    assert max(t.nbytes[s] for s in outputs) > 10 * 8 * 32 * 4  # the real kernel's workspace, not the meta's 0


# -- 6. grouped GEMM --------------------------------------------------------------------------------------
class _GroupedExperts(nn.Module):
    """Three experts applied to sorted token groups with ``_grouped_mm``: 5 output features (20 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 16, 5) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        offs = torch.tensor([n // 3, 2 * n // 3, n], dtype=torch.int32)
        return torch._grouped_mm(x, self.w, offs=offs)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_cuda_grouped_mm_output_rows_are_padded_to_16_bytes() -> None:
    wl = Workload(model=_GroupedExperts, batch=lambda b: torch.randn(b, 16), loss=lambda m, x: m(x).square().mean())
    for device, row_bytes in (("A100-40GB", 8 * F32), ("cpu", 5 * F32)):
        t, _ = trace(wl, 96, device)
        start, end = _phase_bounds(t, "forward", 1)
        out = [s for s in t.events[start:end] if s >= 0 and t.op.get(s) == "aten._grouped_mm.default"]
        assert [t.nbytes[s] for s in out] == [96 * row_bytes - (3 * F32 if device != "cpu" else 0)]


class _OldLibrary:
    """``torch.library.Library`` before ``impl`` took ``allow_override`` (torch <= 2.11): a second Python
    registration of an op and key raises, as torch 2.11 did for ``_grouped_mm``'s Python meta kernel."""

    ns = "aten"

    def __init__(self) -> None:
        self.kernels: list[tuple[str, str]] = []

    def impl(self, op_name: str, fn: object, dispatch_key: str = "") -> None:
        key = f"aten/{op_name}/{dispatch_key}"
        if key in torch.library._impls:
            raise RuntimeError("This is not allowed since there's already a kernel registered from python")
        torch.library._impls.add(key)
        self.kernels.append((op_name, dispatch_key))


def test_an_override_takes_the_place_of_torchs_own_python_kernel_on_older_torch(monkeypatch) -> None:
    from batchfit.memory.trace.overrides import _impl

    monkeypatch.setattr(torch.library, "_impls", {"aten/_grouped_mm/Meta"})  # torch's meta registration
    old = _OldLibrary()
    _impl(old, "_grouped_mm", lambda *a: None, "Meta")
    assert old.kernels == [("_grouped_mm", "Meta")] and torch.library._impls == {"aten/_grouped_mm/Meta"}

    class NewLibrary(_OldLibrary):
        def impl(self, op_name: str, fn: object, dispatch_key: str = "", *, allow_override: bool = False) -> None:
            self.kernels.append((op_name, dispatch_key, allow_override))

    new = NewLibrary()
    _impl(new, "_grouped_mm", lambda *a: None, "Meta")
    assert new.kernels == [("_grouped_mm", "Meta", True)]


# -- 9. reduction staging (memory/kernels/cuda_reduce.py) --------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "dims", "dtype", "staging", "semaphores"),
    [
        # measured on an H200 (132 multiprocessors): benchmarks/results/snapshots-H200-2026-11-26, the bias
        # gradients of the mlp preset's 4096-wide layers and of ViT-base's fc1 and fc2 (32 x 197 tokens)
        ((4096, 4096), [0], torch.float32, 128 * 2**20, 128),
        ((32, 197, 3072), [0, 1], torch.bfloat16, 132 * 2**20, 96),
        ((6304, 768), [0], torch.bfloat16, 38_928_384, 24),
        ((4096, 4096), [1], torch.float32, 0, 0),  # along the rows: each block reduces its own outputs
        ((64, 1000), [0], torch.float32, 0, 0),  # too few inputs per output to split them across blocks
    ],
)
def test_a_cuda_reduction_stages_partial_sums_when_blocks_split_an_output(shape, dims, dtype, staging,
                                                                          semaphores) -> None:  # fmt: skip
    from batchfit.memory.kernels.cuda_reduce import reduction_of

    x = torch.empty(shape, dtype=dtype, device="meta")
    h200 = get_device("H200")
    reduction = reduction_of(torch.ops.aten.sum.dim_IntList, (x, dims, False), {}, h200.multiprocessors, 2048)
    assert reduction is not None and reduction.sizes() == (staging, semaphores)


class _Biased(nn.Module):
    """Two biased linear layers: each bias gradient sums the batch's rows of a 4096-wide gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 4096), nn.Linear(4096, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_line_through_two_small_batches_sizes_the_reduction_staging_at_a_large_one() -> None:
    """The bias gradients stage nothing at 2 and 3 rows and fc1's 128 MiB at 4096 (fp32 on an H200): a line
    through the sizes would say nothing; the trace predicted from the two small traces sizes each buffer from
    its input at 4096 rows, and is the trace made there, storage for storage."""
    from batchfit.memory.synthesis.scaling import TraceLine

    wl = Workload(model=_Biased, batch=lambda b: torch.randn(b, 64), loss=_sum_loss)
    small, smaller, large = (trace(wl, b, "H200")[0] for b in (3, 2, 4096))
    staged = [s for s in large.events if s >= 0 and large.op.get(s) == "CUDA reduction staging"]
    # fc1's bias gradient, in each of the two steps (fc2's sums the loss's expanded gradient, with zero strides)
    assert [large.nbytes[s] for s in staged].count(128 * 2**20) == 2
    assert all(smaller.nbytes[s] == 0 for s in smaller.events if s >= 0 and smaller.op.get(s, "").startswith("CUDA"))
    predicted = TraceLine(smaller, 2, small, 3).at(4096)
    assert [predicted.nbytes[s] for s in predicted.events if s >= 0] == [large.nbytes[s] for s in large.events
                                                                        if s >= 0]  # fmt: skip


# -- 10. batch norm statistics on a float32 copy (memory/kernels/cuda_reduce.py) ----------------------------
_BN = torch.ops.aten.native_batch_norm.default
_INT32 = 2**31 - 1


def _bn_args(x: torch.Tensor, training: bool = True) -> tuple:
    c = x.shape[1]
    return (x, torch.empty(c, device="meta"), torch.empty(c, device="meta"), torch.empty(c, device="meta"),
            torch.empty(c, device="meta"), training, 0.1, 1e-5)  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "layout", "dtype", "training", "copy"),
    [
        # a real ResNet-50 step at 3,299 images on an H200 (bf16 autocast) took 10,103 MiB for the 64-channel
        # 112 x 112 maps: 2.65e9 elements, past 32-bit indexing (benchmarks/results/snapshots-H200-2026-11-28-capacity)
        ((3299, 64, 112, 112), "contiguous", torch.bfloat16, True, 3299 * 64 * 112 * 112 * 4),
        ((3298, 256, 56, 56), "contiguous", torch.bfloat16, True, 3298 * 256 * 56 * 56 * 4),
        ((1, 1, 1, _INT32), "contiguous", torch.bfloat16, True, _INT32 * 4),  # 2**31 - 1 elements: not 32-bit
        ((1, 1, 1, _INT32 - 1), "contiguous", torch.bfloat16, True, 0),
        ((32, 64, 56, 56), "contiguous", torch.bfloat16, True, 0),  # a kernel of its own, no copy
        ((32, 64, 56, 56), "channels_last", torch.bfloat16, True, 0),
        ((32, 64, 56, 56), "transposed", torch.bfloat16, True, 32 * 64 * 56 * 56 * 4),  # no dense layout: General
        ((3299, 64, 112, 112), "contiguous", torch.float16, True, None),  # make_reduction reads fp16 as it is
        ((3299, 64, 112, 112), "contiguous", torch.float32, True, None),  # cuDNN's, or statistics in its own dtype
        ((3299, 64, 112, 112), "contiguous", torch.bfloat16, False, None),  # evaluation: the running statistics
    ],
)
def test_a_bf16_batch_norm_past_32_bit_indexing_takes_a_float32_copy(shape, layout, dtype, training, copy) -> None:
    from batchfit.memory.kernels.cuda_reduce import stats_upcast_of

    x = torch.empty(shape, dtype=dtype, device="meta")
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = torch.empty(shape[:2] + shape[:1:-1], dtype=dtype, device="meta").transpose(2, 3)
    upcast = stats_upcast_of(_BN, _bn_args(x, training), {})
    assert (None if upcast is None else upcast.sizes()[0]) == copy


class _ConvNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


def test_a_line_through_two_small_batches_takes_the_batch_norms_copy_where_the_batch_needs_it() -> None:
    """Below 2**31 elements a bf16 batch norm takes no copy; at 16,384 images of 8 x 128 x 128 (2**31 elements)
    it takes 8 GiB, right after its output and statistics, freed before the op returns. The trace predicted from
    two small batches has it, storage for storage, as the trace made there."""
    from batchfit.memory.synthesis.scaling import TraceLine

    wl = Workload(model=_ConvNorm, batch=lambda b: torch.randn(b, 3, 128, 128), loss=_sum_loss)
    smaller, small, large = (trace(wl, b, "H200", "bf16")[0] for b in (2, 3, 16384))
    copies = [i for i, s in enumerate(large.events) if s >= 0 and large.op.get(s) == "batch norm statistics in float32"]
    assert [large.nbytes[large.events[i]] for i in copies] == [16384 * 8 * 128 * 128 * 4] * 2  # one per step
    for i in copies:
        assert large.events[i + 1] == ~large.events[i]  # freed before the op returns
        assert large.op.get(large.events[i - 1]) == "aten.native_batch_norm.default"  # after its three outputs
    assert all(smaller.nbytes[s] == 0 for s in smaller.events if s >= 0 and smaller.op.get(s, "").startswith("batch"))
    predicted = TraceLine(smaller, 2, small, 3).at(16384)
    assert [predicted.nbytes[s] for s in predicted.events if s >= 0] == [large.nbytes[s] for s in large.events
                                                                        if s >= 0]  # fmt: skip
