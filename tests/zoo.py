"""A zoo of architectures at tiny sizes: the models batchfit must estimate without having been built for them.

Every entry is a zero-argument function returning a ``Workload``: transformers models built from their
config classes (no weights, no hub) through ``batchfit.sources.hub.workload_from_config`` as a named
model would be, plain-torch models written here, and peft adapters on several bases. The zoo test
(``tests/test_zoo.py``) checks each one: the CPU estimate equals the CPU allocator's peak of the same
step, and a GPU estimate succeeds. ``benchmarks/gpu_truth.py`` runs a representative part on a GPU.

Sizes are tiny (hidden 32-64, two layers, short sequences) so the whole zoo runs in CI on two cores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchfit import Workload

V = 128  # vocabulary
T = 16  # tokens per item


@dataclass(frozen=True)
class Entry:
    """One architecture of the zoo."""

    name: str
    family: str
    """decoder, moe, encoder, encoder-decoder, vision-cnn, vit, audio, multimodal, torch, peft."""
    make: Callable[[], Workload]
    batch_size: int = 2
    slow: bool = False
    """Marked slow in the test (it runs in ``make test`` all the same)."""
    tolerance: float = 0.0
    """Allowed relative CPU error; any entry above 0 says why in ``reason``."""
    reason: str = ""


# -- transformers models from config classes ------------------------------------------------------
_LM = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=V,
           max_position_embeddings=64)  # fmt: skip


def hf(config_class: str, task: str, seq_len: int | None = T, lora: Any = None, **fields: Any) -> Workload:
    import transformers

    from batchfit.sources.hub import workload_from_config

    config = getattr(transformers, config_class)(**fields)
    return workload_from_config(config, task=task, seq_len=seq_len, name=config_class.removesuffix("Config"),
                                lora=lora)  # fmt: skip


def lm(config_class: str, **fields: Any) -> Callable[[], Workload]:
    return partial(hf, config_class, "causal-lm", **{**_LM, **fields})


def enc(config_class: str, task: str = "text-classification", **fields: Any) -> Callable[[], Workload]:
    return partial(hf, config_class, task, **{**_LM, **fields})


def vision(config_class: str, **fields: Any) -> Callable[[], Workload]:
    return partial(hf, config_class, "image-classification", None, **fields)


_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8)  # fmt: skip
_MOE = dict(num_key_value_heads=2, num_experts_per_tok=2)

HF_ENTRIES = [
    # decoder language models: dense, grouped-query and multi-query attention, ALiBi, sliding windows
    Entry("gpt2", "decoder", lm("GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    Entry("llama-gqa", "decoder", lm("LlamaConfig", num_key_value_heads=2)),
    Entry("mistral-swa", "decoder", lm("MistralConfig", num_key_value_heads=2, sliding_window=8)),
    Entry("qwen2", "decoder", lm("Qwen2Config", num_key_value_heads=2)),
    Entry("gemma2", "decoder", lm("Gemma2Config", num_key_value_heads=2, head_dim=8, sliding_window=8)),
    Entry("phi3", "decoder", lm("Phi3Config", pad_token_id=0)),
    Entry("falcon", "decoder", lm("FalconConfig")),
    Entry("gpt-neox", "decoder", lm("GPTNeoXConfig")),
    Entry("opt", "decoder", lm("OPTConfig", ffn_dim=64, word_embed_proj_dim=32)),
    Entry("bloom-alibi", "decoder", lm("BloomConfig", n_layer=2, n_head=4)),
    Entry("gpt-bigcode-mqa", "decoder", lm("GPTBigCodeConfig", n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    Entry("starcoder2", "decoder", lm("Starcoder2Config", num_key_value_heads=2)),
    Entry("mamba-ssm", "decoder", lm("MambaConfig", state_size=8, expand=2)),
    # mixture of experts
    Entry("mixtral-moe", "moe", lm("MixtralConfig", num_local_experts=4, **_MOE)),
    Entry("qwen2-moe", "moe", lm("Qwen2MoeConfig", num_experts=4, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, **_MOE)),  # fmt: skip
    Entry("olmoe", "moe", lm("OlmoeConfig", num_experts=4, **_MOE)),
    Entry("granite-moe", "moe", lm("GraniteMoeConfig", num_local_experts=4, **_MOE)),
    # encoders
    Entry("bert", "encoder", enc("BertConfig")),
    Entry("roberta-mlm", "encoder", enc("RobertaConfig", "masked-lm", pad_token_id=1)),
    Entry("distilbert", "encoder", enc("DistilBertConfig", dim=32, n_layers=2, n_heads=4, hidden_dim=64)),
    Entry("albert", "encoder", enc("AlbertConfig", embedding_size=16)),
    Entry("electra-tokens", "encoder", enc("ElectraConfig", "token-classification", embedding_size=32)),
    Entry("deberta-v2", "encoder", enc("DebertaV2Config", relative_attention=True, pos_att_type=["p2c", "c2p"])),
    Entry("modernbert", "encoder", enc("ModernBertConfig", global_attn_every_n_layers=2, local_attention=8,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                       sep_token_id=2)),  # fmt: skip
    # encoder-decoders
    Entry("t5", "encoder-decoder", partial(hf, "T5Config", "seq2seq-lm", T, d_model=32, d_kv=8, d_ff=64,
                                           num_layers=2, num_heads=4, vocab_size=V, pad_token_id=0,
                                           eos_token_id=1, decoder_start_token_id=0)),  # fmt: skip
    Entry("bart", "encoder-decoder", partial(hf, "BartConfig", "seq2seq-lm", T, d_model=32, encoder_layers=2,
                                             decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                             encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V,
                                             max_position_embeddings=64)),  # fmt: skip
    # vision: convolutional networks
    Entry("resnet", "vision-cnn", vision("ResNetConfig", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                         num_labels=4)),  # fmt: skip
    Entry("convnext", "vision-cnn", vision("ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                           drop_path_rate=0.1)),  # fmt: skip
    Entry("regnet", "vision-cnn", vision("RegNetConfig", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                         groups_width=8)),  # fmt: skip
    Entry("efficientnet", "vision-cnn", vision("EfficientNetConfig", image_size=32, width_coefficient=0.25,
                                               depth_coefficient=0.1, hidden_dim=320)),  # fmt: skip
    Entry("mobilenet-v2", "vision-cnn", vision("MobileNetV2Config", image_size=32, depth_multiplier=0.25)),
    # vision transformers: plain, windowed, relative position
    Entry("vit", "vit", vision("ViTConfig", **_VIT)),
    Entry("swin-windowed", "vit", vision("SwinConfig", embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                         image_size=32, patch_size=4, window_size=4)),  # fmt: skip
    Entry("beit-relpos", "vit", vision("BeitConfig", use_relative_position_bias=True, **_VIT)),
    Entry("dinov2", "vit", vision("Dinov2Config", **_VIT)),
    # audio
    Entry("whisper", "audio", partial(hf, "WhisperConfig", "speech-seq2seq", 8, d_model=32, encoder_layers=2,
                                      decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                      encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                                      max_source_positions=32, max_target_positions=16, vocab_size=V,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      decoder_start_token_id=1)),  # fmt: skip
    # SpecAugment and LayerDrop off: both draw at random at every step (how many frames are masked, which
    # layers run), so the memory of two steps differs by chance; the trace follows one draw.
    Entry("wav2vec2-ctc", "audio", partial(hf, "Wav2Vec2Config", "ctc", 1600, **_LM, conv_dim=(16, 16),
                                           conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                           num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                                           layerdrop=0.0)),  # fmt: skip
    # multimodal
    Entry("clip", "multimodal", partial(hf, "CLIPConfig", "contrastive", 8,
                                        text_config={**_LM, "max_position_embeddings": 16},
                                        vision_config=dict(**_VIT), projection_dim=16)),  # fmt: skip
]


# -- plain torch ------------------------------------------------------------------------------------
class TorchTransformer(nn.Module):
    """``nn.TransformerEncoder`` (or a decoder over a memory) classifier over token ids."""

    def __init__(self, decoder: bool = False, norm_first: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        if decoder:
            layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
            self.body: nn.Module = nn.TransformerDecoder(layer, layers)
        else:
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.decoder = decoder
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (b, t, 32)
        x = self.body(x, x) if self.decoder else self.body(x)
        return self.head(x.mean(1))


class Recurrent(nn.Module):
    """An RNN/LSTM/GRU classifier, optionally over packed variable-length sequences."""

    def __init__(self, kind: str, bidirectional: bool, packed: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)  # so that the packed input requires grad (pack's backward runs)
        self.rnn = getattr(nn, kind)(16, 32, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(64 if bidirectional else 32, 5)
        self.packed = packed

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = self.proj(x)
        if self.packed and lengths is not None:
            x = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out, _ = self.rnn(x)
            out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        else:
            out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Convs(nn.Module):
    """1d, 2d, 3d and transposed convolutions with group, instance and batch norms."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.GELU())
        self.c2 = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.InstanceNorm2d(8, affine=True), nn.ReLU(),
                                nn.ConvTranspose2d(8, 4, 2, stride=2), nn.BatchNorm2d(4))  # fmt: skip
        self.c3 = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.GroupNorm(1, 4), nn.SiLU(),
                                nn.ConvTranspose3d(4, 2, 3))  # fmt: skip
        self.head = nn.Linear(8 + 4 + 2, 5)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        a = self.c1(batch["signal"]).mean(-1)  # (b, 8)
        b = self.c2(batch["image"]).mean((-1, -2))  # (b, 4)
        c = self.c3(batch["volume"]).mean((-1, -2, -3))  # (b, 2)
        return self.head(torch.cat([a, b, c], 1))


class BagOfEmbeddings(nn.Module):
    """``nn.EmbeddingBag`` (mean and sum) over a flat id list with per-item offsets."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.EmbeddingBag(V, 16, mode="mean")
        self.sum = nn.EmbeddingBag(V, 16, mode="sum")
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.mean(ids), self.sum(ids)], 1))


class IndexAddMoE(nn.Module):
    """Mixture of experts written with ``index_add`` (the pre-grouped-GEMM way).

    With ``hashed`` each token goes to two experts chosen by its id (hash layers, Roller et al. 2021),
    so the tokens per expert follow from the batch's ids, which the trace knows; otherwise a learned
    router picks them, and the trace, which cannot know a router's choices, assumes every token
    reaches every expert (an upper bound, noted in the estimate).
    """

    def __init__(self, dim: int = 32, experts: int = 4, hashed: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, dim)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, dim))
                                     for _ in range(experts))  # fmt: skip
        self.head = nn.Linear(dim, V)
        self.hashed = hashed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.flatten()  # (n,)
        x = self.embed(flat)  # (n, dim)
        probs = self.router(x).softmax(-1)  # (n, experts)
        n_experts = len(self.experts)
        if self.hashed:
            chosen = torch.stack([flat % n_experts, (flat // n_experts + 1 + flat) % n_experts], 1)  # (n, 2)
        else:
            chosen = probs.topk(2, dim=-1).indices  # (n, 2)
        weights = probs.gather(1, chosen)  # (n, 2)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)  # the tokens routed to expert e
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return self.head(out).view(*ids.shape, V)


class WindowAttention(nn.Module):
    """Local attention over non-overlapping windows with a learned relative-position bias."""

    def __init__(self, dim: int = 32, heads: int = 4, window: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.zeros(heads, 2 * window - 1))
        idx = torch.arange(window)
        self.register_buffer("rel", idx[None, :] - idx[:, None] + window - 1, persistent=False)
        self.heads, self.window = heads, window
        self.head = nn.Linear(dim, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (b, t, d)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t // self.window, self.window, 3, self.heads, d // self.heads).unbind(3)
        scores = torch.einsum("bnihc,bnjhc->bnhij", q, k) / (d // self.heads) ** 0.5
        scores = scores + self.bias[:, self.rel]  # (b, n, h, w, w)
        out = torch.einsum("bnhij,bnjhc->bnihc", scores.softmax(-1), v).reshape(b, t, d)
        return self.head(out.mean(1))


class LazyMLP(nn.Module):
    """``nn.LazyLinear`` layers: their weights exist only after a first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.LazyLinear(64), nn.ReLU(), nn.LazyLinear(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class LateBuffer(nn.Module):
    """A causal mask registered as a buffer on the first forward (a late buffer), then reused."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if getattr(self, "mask", None) is None or self.mask.shape[0] != t:
            self.register_buffer("mask", torch.triu(torch.ones(t, t, dtype=torch.bool), 1), persistent=False)
        x = self.embed(ids)
        return self.head(self.attn(x, x, x, attn_mask=self.mask, need_weights=False)[0].mean(1))


def _features(b: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, width), torch.randint(0, 5, (b,))


def _ids(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, V, (b, T)), torch.randint(0, 5, (b,))


def _seq(b: int, packed: bool = False) -> tuple[torch.Tensor, ...]:
    x, y = torch.randn(b, 10, 16), torch.randint(0, 5, (b,))
    if packed:
        return x, torch.arange(b) % 10 + 1, y  # CPU lengths, 1..10
    return x, y


def _ce(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    *inputs, y = batch
    return F.cross_entropy(model(*inputs), y)


def _multi(b: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    data = {"signal": torch.randn(b, 3, 24), "image": torch.randn(b, 3, 9, 9), "volume": torch.randn(b, 1, 6, 6, 6)}
    return data, torch.randint(0, 5, (b,))


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids[:, :-1])
    targets = ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum"), targets.numel()


def torch_workload(model: Callable[[], nn.Module], batch: Callable[[int], Any], loss: Any = _ce,
                   name: str = "torch") -> Workload:  # fmt: skip
    return Workload(model=model, batch=batch, loss=loss, name=name)


TORCH_ENTRIES = [
    Entry("torch-encoder", "torch", partial(torch_workload, partial(TorchTransformer, layers=2), _ids)),
    Entry("torch-encoder-prenorm", "torch", partial(torch_workload, partial(TorchTransformer, norm_first=True,
                                                                             layers=2), _ids)),  # fmt: skip
    Entry("torch-decoder", "torch", partial(torch_workload, partial(TorchTransformer, decoder=True, layers=2), _ids)),
    Entry("lstm-bi", "torch", partial(torch_workload, partial(Recurrent, "LSTM", True), _seq)),
    Entry("gru", "torch", partial(torch_workload, partial(Recurrent, "GRU", False), _seq)),
    Entry("rnn-tanh-bi", "torch", partial(torch_workload, partial(Recurrent, "RNN", True), _seq)),
    Entry("lstm-packed", "torch", partial(torch_workload, partial(Recurrent, "LSTM", True, True),
                                          partial(_seq, packed=True))),  # fmt: skip
    Entry("convs-1d-2d-3d", "torch", partial(torch_workload, Convs, _multi)),
    Entry("embedding-bag", "torch", partial(torch_workload, BagOfEmbeddings, _ids)),
    Entry("index-add-moe", "torch", partial(torch_workload, IndexAddMoE, lambda b: torch.randint(0, V, (b, T + 1)),
                                            _lm_loss)),  # fmt: skip
    Entry("window-attention", "torch", partial(torch_workload, WindowAttention, _ids)),
    Entry("lazy-mlp", "torch", partial(torch_workload, LazyMLP, partial(_features, width=24))),
    Entry("late-buffer", "torch", partial(torch_workload, LateBuffer, _ids)),
]


# -- peft adapters ------------------------------------------------------------------------------------
def peft_workload(base: Callable[[], Workload], make_config: Callable[[], Any], name: str) -> Workload:
    """``base``'s workload with its model wrapped by ``peft.get_peft_model(model, make_config())``."""
    import dataclasses

    import peft

    wl = base()

    def model() -> nn.Module:
        return peft.get_peft_model(wl.build_model(), make_config())

    return dataclasses.replace(wl, model=model, name=name)


def _peft(kind: str, **kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        import peft

        return getattr(peft, kind)(**kw)

    return make


_LLAMA = lm("LlamaConfig", num_key_value_heads=2)
_BERT = enc("BertConfig")
_QV = ["q_proj", "v_proj"]
_LORA = _peft("LoraConfig", r=4, target_modules=_QV)
_LORA_ALL = _peft("LoraConfig", r=4, lora_dropout=0.1, target_modules="all-linear")
_IA3 = _peft("IA3Config", target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
_LORA_SAVE = _peft("LoraConfig", r=4, target_modules=["query", "value"], modules_to_save=["classifier"])
_ADALORA = _peft("AdaLoraConfig", init_r=4, target_r=2, total_step=10, target_modules=_QV)
_PREFIX = _peft("PrefixTuningConfig", task_type="CAUSAL_LM", num_virtual_tokens=4)
_PROMPT = _peft("PromptTuningConfig", task_type="CAUSAL_LM", num_virtual_tokens=4)
PEFT_ENTRIES = [
    Entry("lora-llama", "peft", partial(peft_workload, _LLAMA, _LORA, "lora-llama")),
    Entry("lora-all-linear-llama", "peft", partial(peft_workload, _LLAMA, _LORA_ALL, "lora-all-linear")),
    Entry("ia3-llama", "peft", partial(peft_workload, _LLAMA, _IA3, "ia3-llama")),
    Entry("lora-bert-modules-to-save", "peft", partial(peft_workload, _BERT, _LORA_SAVE, "lora-bert")),
    Entry("adalora-llama", "peft", partial(peft_workload, _LLAMA, _ADALORA, "adalora")),
    Entry("prefix-tuning-gpt2", "peft", partial(peft_workload, HF_ENTRIES[0].make, _PREFIX, "prefix-gpt2")),
    Entry("prompt-tuning-llama", "peft", partial(peft_workload, _LLAMA, _PROMPT, "prompt-llama")),
]

ZOO: list[Entry] = HF_ENTRIES + TORCH_ENTRIES + PEFT_ENTRIES
BY_NAME = {e.name: e for e in ZOO}

LAYER_FIELDS = frozenset({"num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
                          "layers"})  # fmt: skip
"""The arguments by which the zoo's factories set a number of layers."""


def deeper(make: Any, layers: int) -> Any:
    """``make`` (an entry's factory, or anything inside it) with every number of layers it sets (a config
    field, a ``layers=`` argument, in nested ``functools.partial``s and config dicts) at ``layers``."""
    if isinstance(make, partial):
        keywords = {k: layers if k in LAYER_FIELDS else deeper(v, layers) for k, v in make.keywords.items()}
        return partial(deeper(make.func, layers), *(deeper(a, layers) for a in make.args), **keywords)
    if isinstance(make, dict):
        return {k: layers if k in LAYER_FIELDS else deeper(v, layers) for k, v in make.items()}
    return make
