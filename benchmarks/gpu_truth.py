"""GPU truth: batchfit's estimates against real training steps on this machine's GPU.

For presets and a representative part of the zoo (``tests/zoo.py``: dense and MoE language models, a
LoRA fine-tune, CNNs, a ViT, an RNN), at a few batch sizes each, it runs two real training steps and
records ``max_memory_allocated``, ``max_memory_reserved`` and NVML's used memory of the process (what
nvidia-smi shows), beside ``batchfit.estimate`` for the detected GPU with the default context and with
a calibrated device profile. For some cases it also compares ``fit``'s estimated maximum micro-batch with
the real one, found by running real steps at b and b + 1 (``fit(device="cuda")``).

Each case runs in a fresh worker process (a fresh CUDA context and caching allocator, as a training
run has; the parent never touches CUDA, so its context takes no memory from the workers), and every
row is measured inside its own try/except: a failure is an error row, never a crash. Without a stored
profile of this GPU it first runs ``batchfit calibrate --quick`` and uses the profile it writes.

It prints a table with the error of every row ((estimate - real) / real: negative is an
under-estimate, the dangerous side), the median and p90 of |error| and the worst under-estimate, checks
them against the targets (reserved: median <= 3%, p90 <= 8%, no under-estimate beyond -5%; fit's maximum
runs for real and is >= 95% of the real maximum), and writes every row to
``benchmarks/results/gpu_truth-<gpu>-<date>.csv``.

Run: ``PYTHONPATH=src python benchmarks/gpu_truth.py [--quick] [--profile PATH] [--out DIR] [--cases a,b]``
(``--quick``: fewer cases and sizes, a few minutes). Exit status: 0 targets met, 1 missed, 2 no GPU here.

``--replay CSV [CSV ...] [--profile PATH]`` needs no GPU: it keeps the measured columns of CSVs this script
wrote (``benchmarks/results/``) and estimates every step and probe row again with the code as it is now, for
the GPU the row names, so that a change to the estimator is checked against real steps on any machine; the
summary adds a table per class of model (transformers, LoRA, CNNs, RNNs, MoE) with what ``fit`` keeps free.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.append(str(ROOT / "benchmarks"))  # after tests/: benchmarks/zoo.py is a script, tests/zoo.py the zoo

import torch  # noqa: E402
from torch import nn  # noqa: E402

TARGETS = {"median": 0.02, "p90": 0.05, "worst_under": -0.03, "fit_ratio": 0.97}
"""Reserved: median and p90 of |error|, the worst under-estimate; fit: its answer runs and is at least this
share of the real maximum."""
FIELDS = ("kind", "case", "family", "precision", "batch", "gpu", "real_allocated", "real_reserved", "real_nvml",
          "est_allocated", "est_reserved", "est_total", "est_total_profile", "est_reserved_profile", "err_allocated",
          "err_reserved", "err_total", "err_total_profile", "fit_est_max", "fit_est_max_profile", "fit_real_max",
          "fit_ratio", "context_default", "context_profile", "error", "seconds", "result", "est_fits", "torch",
          "snapshot", "capacity")  # fmt: skip


# -- the cases ----------------------------------------------------------------------------------------
class VGG11(nn.Module):
    """VGG-11 with batch norm (Simonyan & Zisserman 2015, configuration A): 224x224 images, 1000 classes."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
            if width == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, int(width), 3, padding=1), nn.BatchNorm2d(int(width)), nn.ReLU()]
                channels = int(width)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4096, 1000),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class LSTMClassifier(nn.Module):
    """A two-layer bidirectional LSTM over 128 steps of 256 features (the zoo's ``Recurrent``, at scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(256, 512, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def _images(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 3, 224, 224), torch.randint(0, 1000, (b,))


def _sequences(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 128, 256), torch.randint(0, 10, (b,))


def _preset(name: str, **overrides: Any) -> Any:
    from batchfit import presets

    return presets.get(name, **overrides)


_LLAMA = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
              intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048)  # fmt: skip
_MIXTRAL = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                max_position_embeddings=1024)  # fmt: skip


def _zoo_lm(config: str, seq_len: int, fields: dict[str, Any]) -> Any:
    from zoo import hf

    return hf(config, "causal-lm", seq_len, **fields)


def _zoo_vision(config: str, **fields: Any) -> Any:
    from zoo import hf

    return hf(config, "image-classification", None, **fields)


def _lora_llama() -> Any:
    from zoo import peft_workload

    def config() -> Any:
        import peft

        return peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])

    return peft_workload(partial(_zoo_lm, "LlamaConfig", 512, _LLAMA), config, "lora-llama")


def _torch(model: Callable[[], nn.Module], batch: Callable[[int], Any], name: str) -> Any:
    from zoo import torch_workload

    return torch_workload(model, batch, name=name)


# -- the plain-loop cases of an H100 (benchmarks/results/README.md) -------------------------------------
def _hub_lora(config: str, targets: str, seq_len: int, quant: str = "", recipe: str = "", **overrides: Any) -> Any:
    """A hub config of ``benchmarks/configs`` fine-tuned with LoRA r=16, alpha=32 on ``targets`` (``quant``:
    QLoRA's base, e.g. ``nf4``; ``recipe``: more ``--lora`` options, such as ``adapter_dtype=bf16``;
    ``overrides``: config fields such as ``num_hidden_layers``)."""
    from batchfit.sources import load

    lora = f"r=16,alpha=32,targets={targets}" + (f",quant={quant}" if quant else "") + (f",{recipe}" if recipe else "")
    return load(str(ROOT / "benchmarks" / "configs" / config), lora=lora, seq_len=seq_len, **overrides)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _adamw_1e4(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _tv(model: str, optimizer: Callable[[Any], torch.optim.Optimizer], image_size: int = 224) -> Any:
    """A torchvision classifier (``benchmarks/vision_models.py``) on random images, cross-entropy."""
    from vision_models import MODELS
    from zoo import _ce

    from batchfit import Workload

    def images(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 3, image_size, image_size), torch.randint(0, 1000, (b,))

    return Workload(model=MODELS[model], batch=images, loss=_ce, optimizer=optimizer, name=f"tv-{model}")


def _t5_model() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(decoder_start_token_id=0, pad_token_id=0))


def _t5_batch(b: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 32128, (b, 512)), "labels": torch.randint(0, 32128, (b, 128))}


def _t5_small() -> Any:
    from batchfit import Workload
    from batchfit.sources.hf_tasks import model_loss

    return Workload(model=_t5_model, batch=_t5_batch, loss=model_loss, optimizer=_adamw_1e4, name="t5-small")


class LSTMLanguageModel(nn.Module):
    """Embedding(10000, 512) -> 2-layer LSTM(512, 1024) -> Linear(1024, 10000)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10000, 512)
        self.rnn = nn.LSTM(512, 1024, num_layers=2, batch_first=True)
        self.head = nn.Linear(1024, 10000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


def _token_ids(b: int) -> torch.Tensor:
    return torch.randint(0, 10000, (b, 128))


def _next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, 10000), ids.roll(-1, dims=1).reshape(-1))


def _lstm_lm() -> Any:
    from batchfit import Workload

    return Workload(model=LSTMLanguageModel, batch=_token_ids, loss=_next_token_loss, optimizer=_adam,
                    name="lstm-lm")  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One workload, the (precision, batch sizes) to run it at, and whether to compare fit's maximum."""

    name: str
    family: str
    make: Callable[[], Any]
    runs: tuple[tuple[str, tuple[int, ...]], ...]
    quick: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """The runs of ``--quick`` (empty: the case is left out)."""
    fit: str | None = None
    """Precision of the fit comparison (None: no comparison); in ``--quick`` only where ``quick_fit``."""
    quick_fit: bool = False
    checkpointing: bool = False
    """Activation checkpointing of the workload's blocks, in the real steps and the estimates alike."""
    probes: tuple[int, ...] = ()
    """Batch sizes to run near the capacity, each recorded as a ``probe`` row: ran or out of memory."""
    empty_weights: bool = False
    """Real steps give the model uninitialised storage (``build_for_steps(empty_weights=True)``): the same
    allocations, without minutes of CPU initialisation for billions of parameters."""

    @property
    def blocks(self) -> str | None:
        """``checkpointing=`` of ``batchfit.estimate`` and ``fit`` for this case."""
        return "blocks" if self.checkpointing else None


_PLAIN_LOOP = "adapter_dtype=bf16,reentrant=false"
"""The ``--lora`` recipe of the H100 rows' plain training loop (``benchmarks/results/README.md``)."""

CASES = (
    Case("mlp", "preset", partial(_preset, "mlp", in_features=1024, hidden=4096, depth=4),
         (("fp32", (512, 4096)),), (("fp32", (4096,)),)),
    Case("cnn-resnet18", "preset", partial(_preset, "cnn", image_size=224, width=64, stages=4),
         (("fp32", (16, 32, 64)), ("bf16", (32, 64))), (("fp32", (32, 64)),), fit="fp32", quick_fit=True),
    Case("gpt2-small", "preset", partial(_preset, "gpt"), (("fp32", (4, 8)), ("bf16", (8, 16))),
         (("bf16", (8, 16)),), fit="bf16", quick_fit=True),
    Case("hf-gpt2", "preset", partial(_preset, "hf-gpt2"), (("bf16", (8,)),)),
    Case("hf-bert-large", "preset", partial(_preset, "hf-bert-large"), (("fp32", (4, 8)),), fit="fp32"),
    Case("hf-vit-base", "vit", partial(_preset, "hf-vit-base"), (("bf16", (32, 64)),), (("bf16", (32,)),)),
    Case("hf-resnet50", "vision-cnn", partial(_preset, "hf-resnet50"), (("fp32", (32,)), ("bf16", (32, 64))),
         (("bf16", (32,)),), fit="bf16"),
    Case("llama-gqa", "decoder", partial(_zoo_lm, "LlamaConfig", 512, _LLAMA), (("bf16", (4, 8, 16)),),
         (("bf16", (8,)),), fit="bf16"),
    Case("mixtral-moe", "moe", partial(_zoo_lm, "MixtralConfig", 256, _MIXTRAL), (("bf16", (4, 8)),),
         (("bf16", (8,)),)),
    Case("lora-llama", "peft", _lora_llama, (("bf16", (8, 16)),), (("bf16", (8,)),)),
    Case("convnext-tiny", "vision-cnn", partial(_zoo_vision, "ConvNextConfig"), (("bf16", (32,)),)),
    Case("efficientnet-b0", "vision-cnn", partial(_zoo_vision, "EfficientNetConfig", width_coefficient=1.0,
                                                  depth_coefficient=1.0, image_size=224, hidden_dim=1280),
         (("fp32", (32,)),)),
    Case("mobilenet-v2", "vision-cnn", partial(_zoo_vision, "MobileNetV2Config"), (("fp32", (64,)),)),
    Case("vgg11-bn", "vision-cnn", partial(_torch, VGG11, _images, "vgg11-bn"), (("fp32", (16, 32)),)),
    Case("lstm-bi", "rnn", partial(_torch, LSTMClassifier, _sequences, "lstm-bi"), (("fp32", (64, 256)),),
         (("fp32", (64,)),), fit="fp32"),
    # The plain-loop cases first measured on an H100 (benchmarks/results/README.md), with the probes that
    # decide a fit: the batch the estimate says is the largest, and the ones around it.
    Case("llama31-8b-lora-qv-ckpt-s2048", "lora", partial(_hub_lora, "llama-3.1-8b", "q_proj+v_proj", 2048),
         (("bf16-true", (8,)),), checkpointing=True, probes=(14, 15, 16, 17), empty_weights=True),
    Case("qwen25-7b-lora-all-ckpt-s4096", "lora", partial(_hub_lora, "qwen2.5-7b", "all-linear", 4096),
         (("bf16-true", (4,)),), checkpointing=True, probes=(6, 7, 8, 9), empty_weights=True),
    # The H100 rows' plain loop: the model cast to bf16 as a whole after peft wrapped it (bf16 adapters),
    # checkpointing with use_reentrant=False.
    Case("llama31-8b-lora-qv-ckpt-s2048-plain", "lora",
         partial(_hub_lora, "llama-3.1-8b", "q_proj+v_proj", 2048, recipe=_PLAIN_LOOP),
         (("bf16-true", (8,)),), checkpointing=True, probes=(15, 16), empty_weights=True),
    Case("qwen25-7b-lora-all-ckpt-s4096-plain", "lora",
         partial(_hub_lora, "qwen2.5-7b", "all-linear", 4096, recipe=_PLAIN_LOOP),
         (("bf16-true", (4,)),), checkpointing=True, probes=(7, 8), empty_weights=True),
    Case("t5-small-adamw", "transformer", _t5_small, (("fp32", (32,)),)),
    Case("tv-resnet50-sgd", "vision-cnn", partial(_tv, "resnet50", _sgd), (("fp32", (64, 128)),)),
    Case("tv-resnet50-sgd-bf16", "vision-cnn", partial(_tv, "resnet50", _sgd), (("bf16", (128,)),)),
    Case("tv-densenet121-sgd", "vision-cnn", partial(_tv, "densenet121", _sgd), (("fp32", (64,)),)),
    Case("tv-vgg16-adam", "vision-cnn", partial(_tv, "vgg16", _adam), (("fp32", (32,)),)),
    Case("tv-inception_v3-299-adam", "vision-cnn", partial(_tv, "inception_v3", _adam, 299), (("fp32", (32,)),)),
    Case("lstm-lm-adam", "rnn", _lstm_lm, (("fp32", (64,)),)),
    # bitsandbytes on the GPU: a QLoRA base (Llama-3.1-8B's layers, two of them, so that the model builds and
    # quantises on the CPU in seconds) and 8-bit / paged AdamW states.
    Case("llama31-8b-2l-qlora-qv-ckpt-s2048", "lora",
         partial(_hub_lora, "llama-3.1-8b", "q_proj+v_proj", 2048, "nf4", num_hidden_layers=2),
         (("bf16-true", (4, 8)),), checkpointing=True),
    Case("hf-gpt2-adamw8bit", "preset", partial(_preset, "hf-gpt2", optimizer="adamw_8bit"), (("bf16", (8,)),)),
    Case("hf-gpt2-paged-adamw8bit", "preset", partial(_preset, "hf-gpt2", optimizer="paged_adamw_8bit"),
         (("bf16", (8,)),)),
)  # fmt: skip
BY_NAME = {c.name: c for c in CASES}

CLASSES = {
    "transformer": ("gpt2-small", "hf-gpt2", "hf-bert-large", "hf-vit-base", "llama-gqa", "t5-small-adamw",
                    "hf-gpt2-adamw8bit", "hf-gpt2-paged-adamw8bit"),
    "LoRA/QLoRA": ("lora-llama", "llama31-8b-lora-qv-ckpt-s2048", "qwen25-7b-lora-all-ckpt-s4096",
                   "llama31-8b-lora-qv-ckpt-s2048-plain", "qwen25-7b-lora-all-ckpt-s4096-plain",
                   "llama31-8b-2l-qlora-qv-ckpt-s2048"),
    "CNN": ("cnn-resnet18", "hf-resnet50", "convnext-tiny", "efficientnet-b0", "mobilenet-v2", "vgg11-bn",
            "tv-resnet50-sgd", "tv-resnet50-sgd-bf16", "tv-densenet121-sgd", "tv-vgg16-adam",
            "tv-inception_v3-299-adam"),
    "RNN": ("lstm-bi", "lstm-lm-adam"),
    "MoE": ("mixtral-moe",),
    "other": ("mlp",),
}  # fmt: skip
"""The class of model each case is, for the per-class table; ``KNOWN_FAMILY`` says which measured error
``fit`` keeps free for it (``batchfit.planning.known_error``: the family its trace falls in)."""
CLASS_OF = {case: cls for cls, cases in CLASSES.items() for case in cases}
KNOWN_FAMILY = {"transformer": ("attention",), "LoRA/QLoRA": ("adapters", "4-bit"), "CNN": ("convolutional",),
                "RNN": ("recurrent",), "MoE": ("attention",), "other": ()}  # fmt: skip


@dataclass(frozen=True)
class Run:
    """``--runs`` item ``CASE[:PRECISION][@CAPACITY]=B1,B2,...``: real steps of one case at these batch sizes,
    in this precision (default: the case's fit precision, else its first); with ``CAPACITY`` (``16GiB``, bytes)
    the allocator is capped there by ``set_capacity`` and each step is a probe row (ran or out of memory)."""

    case: str
    batches: tuple[int, ...]
    precision: str | None = None
    capacity: int | None = None

    @classmethod
    def parse(cls, text: str) -> Run:
        from batchfit.units import parse_bytes

        head, sep, batches = text.partition("=")
        head, _, capacity = head.partition("@")
        case, _, precision = head.partition(":")
        if not sep or case not in BY_NAME:
            raise ValueError(f"--runs {text!r}: expected CASE[:PRECISION][@CAPACITY]=B1,B2 with a known case")
        return cls(case, tuple(int(b) for b in batches.split(",")), precision or None,
                   parse_bytes(capacity) if capacity else None)  # fmt: skip

    def argv(self) -> list[str]:
        """The worker's arguments for this run."""
        spec = f"{self.case}{':' + self.precision if self.precision else ''}"
        spec += f"@{self.capacity}" if self.capacity else ""
        return ["--runs", f"{spec}={','.join(map(str, self.batches))}"]


# -- a worker: one case in a fresh process -----------------------------------------------------------
def _relative(estimate: int | None, real: int | None) -> float | None:
    return None if not estimate or not real else (estimate - real) / real


def _real_step(workload: Any, batch: int, policy: Any, gpu: Any, snapshot: Path | None = None,
               checkpointing: str | None = None, empty_weights: bool = False) -> dict[str, Any]:  # fmt: skip
    """Two real steps from a clean allocator: the peaks and NVML's used memory of this process after them.

    ``snapshot``: where to write the allocator's history of the two steps (``torch.cuda.memory``'s snapshot,
    every allocation, free, segment and out-of-memory error, gzip-compressed), recorded from an empty cache
    and before the model is built, so that ``benchmarks/snapshot_replay.py`` replays it exactly. A step
    that runs out of memory is an ``error`` row, its snapshot kept: the OOM is what it records.
    """
    import gc

    from batchfit.activation_checkpointing import checkpoint_classes
    from batchfit.memory.steps import build_for_steps, run_workload_steps

    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()  # a fresh process has no cuBLAS workspace yet
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = optimizer = None
    if snapshot is not None:
        # Python frames only: C++ frames make the snapshot minutes slower and stream_diff does not read them
        torch.cuda.memory._record_memory_history(max_entries=10_000_000, stacks="python")
    out: dict[str, Any] = {"torch": torch.__version__}
    try:
        classes = checkpoint_classes(checkpointing, workload.checkpoint_blocks)
        model, optimizer = build_for_steps(workload, policy.param_dtype, classes, device="cuda",
                                           empty_weights=empty_weights)  # fmt: skip
        run_workload_steps(workload, model, optimizer, batch, param_dtype=policy.param_dtype,
                           autocast=policy.autocast("cuda"), move=lambda t: t.to("cuda"))  # fmt: skip
        torch.cuda.synchronize()
        out.update(real_allocated=int(torch.cuda.max_memory_allocated()),
                   real_reserved=int(torch.cuda.max_memory_reserved()), real_nvml=gpu.process_used(),
                   result="ran")  # fmt: skip
    except torch.OutOfMemoryError:
        out.update(error="real step ran out of memory", result="out of memory")
    finally:
        if snapshot is not None:
            recorded = torch.cuda.memory._snapshot()
            recorded["recorded_with"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                                         "total_bytes": torch.cuda.get_device_properties(0).total_memory,
                                         "allowed_bytes": _ALLOWED.get("bytes")}  # fmt: skip
            with gzip.open(snapshot, "wb") as f:
                pickle.dump(recorded, f, protocol=4)
            torch.cuda.memory._record_memory_history(enabled=None)
            out["snapshot"] = snapshot.name
        del model, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    return out


_ALLOWED: dict[str, int] = {}
"""The capacity ``--capacity`` set in this worker (``allowed_memory_maximum``), written into every snapshot."""


def set_capacity(capacity: int) -> int:
    """Cap what this process's caching allocator may reserve at ``capacity`` bytes, as
    ``torch.cuda.set_per_process_memory_fraction`` does it, and return the exact cap the allocator keeps.

    ``CUDACachingAllocator.cpp`` sets ``allowed_memory_maximum = size_t(fraction * device_total)`` with
    ``device_total`` from ``cudaMemGetInfo``, and refuses a new segment when reserved + its size would pass
    it: the same test as running out of device memory, at a capacity chosen here, so that a large GPU
    behaves near the capacity of a smaller one.
    """
    total = torch.cuda.mem_get_info()[1]
    fraction = min(1.0, capacity / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    _ALLOWED["bytes"] = int(fraction * total)
    return _ALLOWED["bytes"]


def _capped(device: Any, capacity: int | str | None) -> Any:
    """``device`` with ``capacity`` bytes for the caching allocator (a row run under ``set_capacity``: the
    context stays beside the cap), else as it is."""
    return device.with_overrides(total_bytes=int(capacity) + device.context_bytes) if capacity else device


def _profiled(device: Any, profile_path: str | None) -> Any:
    """``device`` with the device profile at ``profile_path`` applied (None without a profile)."""
    if not profile_path:
        return None
    from batchfit.gpu import profiles

    return profiles.load(profile_path).apply(device, profile_path)


def _estimates(workload: Any, batch: int, precision: str, device: Any, profiled: Any,
               checkpointing: str | None = None) -> dict[str, Any]:  # fmt: skip
    import batchfit

    est = batchfit.estimate(workload, batch, device=device, precision=precision, checkpointing=checkpointing)
    # torch.cuda.max_memory_allocated counts whole blocks, as the allocator model's replay does
    allocated = est.allocator_allocated_bytes if est.allocator_allocated_bytes is not None else est.peak_allocated_bytes
    out = {"est_allocated": allocated, "est_reserved": est.peak_reserved_bytes,
           "est_total": est.device_total_bytes, "context_default": est.context_bytes, "est_fits": est.fits}  # fmt: skip
    if profiled is not None:
        p = batchfit.estimate(workload, batch, device=profiled, precision=precision, checkpointing=checkpointing)
        out.update(est_total_profile=p.device_total_bytes, est_reserved_profile=p.peak_reserved_bytes,
                   context_profile=p.context_bytes)  # fmt: skip
    return out


def worker(name: str, quick: bool, profile_path: str | None, snapshots: str | None = None, run: Run | None = None,
           real_only: bool = False) -> int:  # fmt: skip
    """Run one case and print one JSON object per row (never raises for a row). ``run``: only these probes
    (at this capacity); ``real_only``: real steps alone, their estimates left to ``--replay``."""
    from batchfit.gpu.real_gpu import cuda_device
    from batchfit.runtime.calibrate import TorchGpu

    gpu = TorchGpu()  # NVML's baseline is read now, before this process has a CUDA context
    case = BY_NAME[name]
    base: dict[str, Any] = {"case": case.name, "family": case.family, "gpu": torch.cuda.get_device_name(0)}
    if run is not None and run.capacity is not None:
        base["capacity"] = set_capacity(run.capacity)
    device = _capped(cuda_device(), base.get("capacity"))
    profiled = _profiled(device, profile_path)
    try:
        workload = case.make()
    except Exception as e:  # noqa: BLE001 - a case that cannot be built is an error row
        print(json.dumps({**base, "kind": "step", "error": f"building: {type(e).__name__}: {e}"[:300]}), flush=True)
        return 0
    folder = Path(snapshots) if snapshots else None
    runs = [("step", precision, batch) for precision, batches in (case.quick if quick else case.runs)
            for batch in batches]  # fmt: skip
    if not quick and case.probes:
        runs += [("probe", case.runs[0][0], batch) for batch in case.probes]
    if run is not None:
        kind = "step" if run.capacity is None else "probe"  # a capped step is a probe: ran or out of memory
        runs = [(kind, run.precision or case.fit or case.runs[0][0], batch) for batch in run.batches]
    for kind, precision, batch in runs:
        print(json.dumps(_measured_row(kind, case, workload, precision, batch, None if real_only else device,
                                       profiled, gpu, folder, base)), flush=True)  # fmt: skip
    if case.fit and run is None and not real_only and (case.quick_fit or not quick):
        # --quick leaves out the profile's fit: four more traces per case
        row = _fit_row(case, workload, device, None if quick else profiled, base)
        print(json.dumps(row), flush=True)
        if folder is not None and row.get("fit_est_max"):  # the estimated largest batch and the next one
            for batch in (row["fit_est_max"], row["fit_est_max"] + 1):
                print(json.dumps(_measured_row("probe", case, workload, case.fit, batch, device, None, gpu, folder,
                                               base)), flush=True)  # fmt: skip
    return 0


def _measured_row(kind: str, case: Case, workload: Any, precision: str, batch: int, device: Any, profiled: Any,
                  gpu: Any, folder: Path | None, base: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """A real step at ``batch`` (with its snapshot when ``folder`` is given) beside the estimates of it
    (``device`` None: the real step alone)."""
    from batchfit.precision import policy_for

    policy = policy_for(precision, bf16_supported=torch.cuda.is_bf16_supported(), device_name=base["gpu"])
    row: dict[str, Any] = {**base, "kind": kind, "precision": precision, "batch": batch}
    start = time.perf_counter()
    capped = f"-cap{base['capacity']}" if base.get("capacity") else ""
    snapshot = None if folder is None else folder / f"snapshot-{case.name}-{precision}-{batch}{capped}.pickle.gz"
    parts = [partial(_real_step, workload, batch, policy, gpu, snapshot, case.blocks, case.empty_weights)]
    if device is not None:
        parts.append(partial(_estimates, workload, batch, precision, device, profiled, case.blocks))
    for part in parts:
        try:
            row.update(part())
        except Exception as e:  # noqa: BLE001 - recorded, the next part still runs
            row["error"] = (row.get("error", "") + f" {type(e).__name__}: {e}")[:300].strip()
    if kind == "probe" and row.get("result") == "out of memory":
        row.pop("error", None)  # a probe that runs out of memory has measured what it was for
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _fit_row(case: Case, workload: Any, device: Any, profiled: Any, base: dict[str, Any]) -> dict[str, Any]:
    import batchfit

    row: dict[str, Any] = {**base, "kind": "fit", "precision": case.fit}
    start = time.perf_counter()
    try:
        fit = partial(batchfit.fit, workload, precision=case.fit, checkpointing=case.blocks)
        row["fit_est_max"] = fit(device).max_batch_size
        if profiled is not None:
            row["fit_est_max_profile"] = fit(profiled).max_batch_size
        # Real steps at the traced guess and its neighbours until b fits and b + 1 does not.
        row["fit_real_max"] = fit("cuda").max_batch_size
        row["fit_ratio"] = row["fit_est_max"] / row["fit_real_max"]
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


# -- the parent: workers, table, CSV -----------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _profile(args: argparse.Namespace, out_dir: Path) -> tuple[str | None, str]:
    """The profile to compare with: given, stored for this GPU (found by a worker), or calibrated now."""
    if args.profile:
        return args.profile, "given"
    path = out_dir / "profile-calibrated.json"
    cmd = [sys.executable, "-m", "batchfit", "calibrate", "--quick", "--output", str(path), "--json"]
    try:
        done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, "calibration timed out"
    if done.returncode != 0:
        return None, f"calibration failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    return str(path), "calibrated now"


def run_case(case: Case, args: argparse.Namespace, profile: str | None, run: Run | None = None
             ) -> list[dict[str, Any]]:  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", case.name]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--real-only"] if args.real_only else []
    cmd += run.argv() if run is not None else []
    cmd += ["--profile", profile] if profile else []
    cmd += ["--snapshots", args.snapshots] if args.snapshots else []
    try:
        done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=args.timeout)
        stdout, failure = done.stdout, None
        if done.returncode != 0:
            failure = f"worker exited {done.returncode}: {' '.join(done.stderr.strip().splitlines()[-1:])}"
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        failure = f"worker timed out after {args.timeout} s"
    rows = []
    for line in stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if failure:
        rows.append({"kind": "step", "case": case.name, "family": case.family, "error": failure[:300]})
    for row in rows:
        row.setdefault("family", case.family)
        _add_errors(row)
    return rows


def _add_errors(row: dict[str, Any]) -> None:
    row["err_allocated"] = _relative(row.get("est_allocated"), row.get("real_allocated"))
    row["err_reserved"] = _relative(row.get("est_reserved"), row.get("real_reserved"))
    row["err_total"] = _relative(row.get("est_total"), row.get("real_nvml"))
    row["err_total_profile"] = _relative(row.get("est_total_profile"), row.get("real_nvml"))


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """Median and p90 of |error| and the worst (most negative) error of column ``key``."""
    errors = [r[key] for r in rows if r.get("kind") == "step" and r.get(key) is not None]
    if not errors:
        return None
    mags = sorted(abs(e) for e in errors)
    p90 = mags[min(len(mags) - 1, int(0.9 * len(mags) + 0.5) - 1 if len(mags) > 1 else 0)]
    return {"n": len(errors), "median": statistics.median(mags), "p90": p90, "worst_under": min(errors)}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def report(rows: list[dict[str, Any]], profile_note: str) -> bool:
    """Print the tables and the summary; True when every target is met."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title="real steps vs estimate (MiB; error = (estimate - real) / real)", title_justify="left")
    for col in ("case", "prec", "batch", "real alloc", "err", "real reserved", "est reserved", "err", "nvml used",
                "est total", "err", "est total (profile)", "err", "s", "note"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("case", "prec", "note") else "right")
    for r in (r for r in rows if r.get("kind") == "step"):
        table.add_row(r["case"], r.get("precision", "-"), str(r.get("batch", "-")), _mib(r.get("real_allocated")),
                      _pct(r.get("err_allocated")), _mib(r.get("real_reserved")), _mib(r.get("est_reserved")),
                      _pct(r.get("err_reserved")), _mib(r.get("real_nvml")), _mib(r.get("est_total")),
                      _pct(r.get("err_total")), _mib(r.get("est_total_profile")), _pct(r.get("err_total_profile")),
                      str(r.get("seconds", "-")), (r.get("error") or "")[:60])  # fmt: skip
    console.print(table)
    fits = Table(title="fit: estimated maximum micro-batch vs the real one", title_justify="left")
    for col in ("case", "prec", "estimated", "estimated (profile)", "real", "estimated / real", "note"):
        fits.add_column(col, justify="left" if col in ("case", "prec", "note") else "right")
    fit_rows = [r for r in rows if r.get("kind") == "fit"]
    for r in fit_rows:
        ratio = r.get("fit_ratio")
        fits.add_row(r["case"], r.get("precision", "-"), str(r.get("fit_est_max", "-")),
                     str(r.get("fit_est_max_profile", "-")), str(r.get("fit_real_max", "-")),
                     "-" if ratio is None else f"{ratio:.3f}", (r.get("error") or "")[:60])  # fmt: skip
    console.print(fits)
    console.print(class_table(rows))
    probe_rows = [r for r in rows if r.get("kind") == "probe"]
    unsafe = 0
    if probe_rows:
        probes = Table(title="probes near the capacity: does the estimate say the step fits, as the GPU did?",
                       title_justify="left")  # fmt: skip
        for col in ("case", "prec", "batch", "real", "real reserved", "est total", "estimate says", "note"):
            words = col in ("case", "prec", "real", "estimate says", "note")
            probes.add_column(col, justify="left" if words else "right")
        for r in probe_rows:
            said = {True: "fits", False: "does not fit"}.get(r.get("est_fits"), "-")
            wrong = r.get("est_fits") is True and r.get("result") == "out of memory"
            unsafe += wrong
            note = "fits said, ran out of memory" if wrong else (r.get("error") or "")[:60]
            probes.add_row(r["case"], r.get("precision", "-"), str(r.get("batch", "-")), r.get("result") or "-",
                           _mib(r.get("real_reserved")), _mib(r.get("est_total")), said, note)  # fmt: skip
        console.print(probes)
    console.print(f"device profile: {profile_note}")
    ok = True
    for key, what in (("err_reserved", "reserved"), ("err_allocated", "allocated"),
                      ("err_total", "nvidia-smi, default"), ("err_total_profile", "nvidia-smi, profile")):  # fmt: skip
        s = summary(rows, key)
        if s is None:
            console.print(f"{what}: no rows")
            ok &= key != "err_reserved"
            continue
        line = (f"{what}: {s['n']} rows, median |error| {100 * s['median']:.1f}%, p90 {100 * s['p90']:.1f}%, "
                f"worst under-estimate {100 * s['worst_under']:+.1f}%")  # fmt: skip
        if key == "err_reserved":
            met = (s["median"] <= TARGETS["median"] and s["p90"] <= TARGETS["p90"]
                   and s["worst_under"] >= TARGETS["worst_under"])  # fmt: skip
            targets = (f"median <= {100 * TARGETS['median']:g}%, p90 <= {100 * TARGETS['p90']:g}%, "
                       f"worst >= {100 * TARGETS['worst_under']:g}%")  # fmt: skip
            line += f" (targets: {targets}: " + ("met" if met else "MISSED") + ")"
            ok &= met
        console.print(line)
    ratios = [r["fit_ratio"] for r in fit_rows if r.get("fit_ratio") is not None]
    if ratios:
        met = all(1.0 >= x >= TARGETS["fit_ratio"] for x in ratios)
        verdict = "met" if met else "MISSED"
        console.print(f"fit: estimated / real maximum from {min(ratios):.3f} to {max(ratios):.3f} "
                      f"(target: runs for real, >= {TARGETS['fit_ratio']:g}: {verdict})")  # fmt: skip
        ok &= met
    if probe_rows:
        console.print(f"probes: {unsafe} of {len(probe_rows)} said to fit ran out of memory (target: none)")
        ok &= unsafe == 0
    errors = sum(1 for r in rows if r.get("error"))
    console.print(f"{len(rows)} rows, {errors} with errors")
    return ok and errors == 0


def class_table(rows: list[dict[str, Any]]) -> Any:
    """Per class of model: the step rows' errors (median and worst under-estimate) and what fit keeps free."""
    from rich.table import Table

    from batchfit.planning.known_error import KNOWN_ERRORS

    table = Table(title="by class of model: median |error| / worst under-estimate, and what fit keeps free",
                  title_justify="left")  # fmt: skip
    for col in ("class", "rows", "allocated", "reserved", "nvidia-smi", "fit keeps free", "cases"):
        table.add_column(col, justify="left" if col in ("class", "cases", "fit keeps free") else "right")
    steps = [r for r in rows if r.get("kind") == "step" and r.get("err_reserved") is not None]
    for cls in CLASSES:
        mine = [r for r in steps if CLASS_OF.get(r["case"]) == cls]
        if not mine:
            continue
        cells = []
        for key in ("err_allocated", "err_reserved", "err_total"):
            s = summary(mine, key)
            cells.append("-" if s is None else f"{100 * s['median']:.1f}% / {100 * min(0.0, s['worst_under']):+.1f}%")
        kept = "; ".join(f"{100 * known.fraction:.3g}% ({known.family}, {known.peak})" if known else f"nothing ({f})"
                         for f, known in ((f, KNOWN_ERRORS.get(f)) for f in KNOWN_FAMILY[cls])) or "nothing"
        table.add_row(cls, str(len(mine)), *cells, kept, ", ".join(sorted({r["case"] for r in mine})))
    return table


def write_csv(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), "unknown-gpu")
    path = out_dir / f"gpu_truth-{re.sub(r'[^A-Za-z0-9.]+', '_', gpu).strip('_')}-{date.today().isoformat()}.csv"
    out_dir.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def replay(path: Path, profile_path: str | None, cases: set[str] | None = None, refit: bool = False
           ) -> list[dict[str, Any]]:  # fmt: skip
    """The step and probe rows of a measured CSV with their estimates made again now; ``cases``: only these
    cases' rows; ``refit``: the fit rows' answers made again too (else as measured)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in ("kind", "case", "precision", "batch", "gpu") if k not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path} has no column {', '.join(missing)}: pass a CSV this script wrote "
                             f"(benchmarks/results/gpu_truth-*.csv), which names the GPU of every row")  # fmt: skip
        measured = [r for r in reader if cases is None or r["case"] in cases]
    devices: dict[tuple[str, Any], tuple[Any, Any]] = {}  # per GPU and cap: the catalog's device, the profiled one
    workloads: dict[str, Any] = {}  # per case: one workload for all its rows, as a worker has
    rows = [replay_row(old, profile_path, devices, workloads) for old in measured]
    if refit:
        for row in rows:
            if row.get("kind") == "fit" and row.get("case") in BY_NAME and row.get("fit_real_max"):
                _refit(row, workloads, devices)
    return rows


def _refit(row: dict[str, Any], workloads: dict[str, Any], devices: dict[tuple[str, Any], tuple[Any, Any]]) -> None:
    """A measured fit row's estimated maximum made again now (the real maximum kept)."""
    import batchfit

    case = BY_NAME[row["case"]]
    try:
        workload = workloads.setdefault(row["case"], case.make())
        device = _replay_device(row["gpu"], row.get("capacity"), None, devices)[0]
        with allocator_of(row.get("torch")):
            row["fit_est_max"] = batchfit.fit(workload, device, precision=row["precision"],
                                              checkpointing=case.blocks).max_batch_size  # fmt: skip
        row.pop("fit_est_max_profile", None)  # a profile of the GPU is not replayed
        row["fit_ratio"] = row["fit_est_max"] / row["fit_real_max"]
    except Exception as e:  # noqa: BLE001 - an error row, the others still run
        row["error"] = f"{type(e).__name__}: {e}"[:300]


def _replay_device(gpu: str, capacity: Any, profile_path: str | None, devices: dict[tuple[str, Any], tuple[Any, Any]]
                   ) -> tuple[Any, Any]:  # fmt: skip
    """The catalog's device a row names (capped as it ran) and its profiled twin, made once per GPU and cap."""
    from batchfit.gpu.catalog import get_device

    key = (gpu, capacity or None)
    if key not in devices:
        device = _capped(get_device(gpu), capacity)
        devices[key] = (device, _profiled(device, profile_path))
    return devices[key]


def replay_row(old: dict[str, str], profile_path: str | None = None,
               devices: dict[tuple[str, Any], tuple[Any, Any]] | None = None, workloads: dict[str, Any] | None = None
               ) -> dict[str, Any]:  # fmt: skip
    """One row of a measured CSV (as ``csv.DictReader`` reads it) with its estimates made again now; rows
    that are neither a measured step nor a probe of a known case come back as they were. ``devices`` and
    ``workloads`` keep what was built for the rows before."""
    devices = {} if devices is None else devices
    workloads = {} if workloads is None else workloads
    row: dict[str, Any] = {k: _number(v) for k, v in old.items() if k in FIELDS}
    measured_step = old["kind"] == "step" and old.get("real_allocated")
    if not (measured_step or old["kind"] == "probe") or old["case"] not in BY_NAME:
        return row
    for key in [k for k in row if k.startswith(("est_", "err_", "context_"))] + ["error"]:
        row[key] = None
    try:
        device, profiled = _replay_device(old["gpu"], old.get("capacity"), profile_path, devices)
        if old["case"] not in workloads:
            workloads[old["case"]] = BY_NAME[old["case"]].make()
        with allocator_of(old.get("torch")):
            row.update(_estimates(workloads[old["case"]], int(old["batch"]), old["precision"], device, profiled,
                                  BY_NAME[old["case"]].blocks))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - an error row, the others still run
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    _add_errors(row)
    return row


@contextlib.contextmanager
def allocator_of(torch_version: str | None) -> Iterator[None]:
    """Estimates made meanwhile replay the caching allocator of the torch that measured the row (its tie order
    between equal free blocks changed in 2.13: ``memory/estimate.allocator_tie_order``); None: the installed one."""
    from batchfit.memory.estimate import ALLOCATOR_TORCH

    saved = os.environ.get(ALLOCATOR_TORCH)
    if torch_version:
        os.environ[ALLOCATOR_TORCH] = torch_version
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ALLOCATOR_TORCH, None)
        else:
            os.environ[ALLOCATOR_TORCH] = saved


def _number(value: str) -> Any:
    """A CSV cell as this script wrote it: an int, a float, or text (empty: None)."""
    if value == "":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and batch sizes (a few minutes)")
    parser.add_argument("--profile", help="a device profile to compare with (default: calibrate one now)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where the CSV goes")
    parser.add_argument("--cases", help="comma-separated case names (default: all, or the quick ones)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per worker")
    parser.add_argument("--snapshots", help="a folder for each real step's allocator snapshot (one file per row)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--replay", nargs="+", help="measured CSVs: estimate their rows again with this code (no GPU)")
    parser.add_argument("--runs", nargs="+", type=Run.parse, metavar="CASE[:PRECISION][@CAPACITY]=B1,B2",
                        help="probes of these cases at these batch sizes (with the allocator capped at CAPACITY) "
                             "instead of the cases' own runs")  # fmt: skip
    parser.add_argument(
        "--real-only",
        action="store_true",
        help="real steps alone (no estimates, no calibration): estimate them later with --replay",
    )
    args = parser.parse_args(argv)
    if args.replay:
        cases = set(args.cases.split(",")) if args.cases else None
        try:
            rows = [row for path in args.replay for row in replay(Path(path), args.profile, cases, refit=True)]
        except (OSError, ValueError) as e:
            print(f"gpu_truth: {e}")
            return 2
        return 0 if report(rows, args.profile or "none (catalog defaults only)") else 1
    if not torch.cuda.is_available():
        print("gpu_truth: no CUDA GPU is visible here; run it on a machine with one (nothing was measured)")
        return 2
    if args.worker:
        return worker(args.worker, args.quick, args.profile, args.snapshots, (args.runs or [None])[0], args.real_only)
    names = args.cases.split(",") if args.cases else [c.name for c in CASES if c.quick or not args.quick]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"gpu_truth: unknown case(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
        return 2
    jobs: list[tuple[str, Run | None]] = [(n, None) for n in names] if args.cases or not args.runs else []
    jobs += [(r.case, r) for r in args.runs or []]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.snapshots:
        Path(args.snapshots).mkdir(parents=True, exist_ok=True)
    profile, note = (None, "none (--real-only)") if args.real_only else _profile(args, out_dir)
    rows: list[dict[str, Any]] = []
    partial_rows = out_dir / "rows.jsonl"  # every case's rows as it ends: a run stopped half-way keeps them
    partial_rows.write_text("")
    for name, run in jobs:
        start = time.perf_counter()
        done = run_case(BY_NAME[name], args, profile, run)
        rows += done
        with partial_rows.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in done)
        print(f"gpu_truth: {name} done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    ok = report(rows, f"{profile} ({note})" if profile else note)
    print(f"rows written to {write_csv(rows, out_dir)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
