"""What the commands share: option types, the workload and device a command names, output helpers.

Imported by every command module and by none of the library: no command module imports another
(``main`` registers them), and nothing here imports torch, so ``batchfit --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Iterator
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import ConfigError
from ..gpu.context import resolve_device

if TYPE_CHECKING:
    from ..workload import Workload

PresetArg = Annotated[
    str,
    typer.Argument(
        help="A preset (see `batchfit presets`), a Hugging Face hub id, a model directory or config.json, "
        "or path/to/file.py:function / module.path:function returning a Workload."
    ),
]
TaskOpt = Annotated[
    str | None,
    typer.Option("--task", help="Training task of a hub model (default: from its config), e.g. causal-lm."),
]
LoraOpt = Annotated[
    str | None,
    typer.Option("--lora", help="Fine-tune LoRA adapters only: r=16,alpha=32,targets=q_proj+v_proj (method=ia3 too)."),
]
LoraTargetsOpt = Annotated[
    str | None, typer.Option("--lora-targets", help="Modules to adapt: all-linear, or names joined by +.")
]
FusedLossOpt = Annotated[
    str | None,
    typer.Option(
        "--fused-loss",
        help="Train a causal LM with a fused linear cross-entropy: liger (Liger's) or cce (cut cross-entropy); "
        "the logits are never materialised.",
    ),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", "-d", help="A catalog GPU (see `batchfit gpus`), a capacity like 24GiB, or cpu.")
]
PrecisionOpt = Annotated[
    str, typer.Option("--precision", "-p", help="fp32, bf16, fp16, bf16-true or bf16-true-autocast.")
]
SeqLenOpt = Annotated[int | None, typer.Option("--seq-len", help="Sequence length (language-model presets).")]
OptimizerOpt = Annotated[
    str | None,
    typer.Option(
        "--optimizer",
        help="adamw (default), adam, sgd, or a Hugging Face optim name: adamw_torch, adamw_8bit, paged_adamw_8bit, "
        "paged_adamw_32bit, lion (lion_32bit), lion_8bit, paged_lion_8bit, adafactor, adamw_torch_8bit, "
        "adamw_torch_4bit, ... (presets and hub models).",
    ),
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="A preset override KEY=VALUE (repeatable), e.g. --set n_layer=4.")
]
CheckpointingOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpointing",
        metavar="[K|i,j,k|selective|K+selective|auto]",
        help="Activation checkpointing: alone, every block; K, the first K blocks; 0,4,8, blocks by index; selective, "
        "every block recomputing only what is cheap (matmul and attention outputs kept); K+selective, the first K "
        "blocks whole and the rest selectively; auto (fit), the fewest first blocks the largest micro-batch (or -b B) "
        "needs.",
    ),
]
CheckpointBlocksOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoint-blocks",
        help="Checkpoint only some blocks: K (the first K blocks) or block indices such as 0,4,8.",
    ),
]
CHECKPOINTING_VALUE = re.compile(r"^(auto|selective|blocks|none|\d+(,\d+)*(\+selective)?)$")
"""What ``--checkpointing`` of estimate and fit takes after it; anything else after a bare one is the next argument."""
VALUED_CHECKPOINTING = ("estimate", "fit")


def take_checkpointing(argv: list[str]) -> list[str]:
    """``argv`` with a bare ``--checkpointing`` of estimate or fit written ``--checkpointing=blocks``: the option
    takes an optional value (``--checkpointing``, ``--checkpointing 12``, ``--checkpointing auto``), which typer's
    options cannot, so a bare one (followed by nothing, another option or the model) gets its value here."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in VALUED_CHECKPOINTING:
        return argv
    out = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--checkpointing" and (i + 1 == len(argv) or not CHECKPOINTING_VALUE.match(argv[i + 1])):
            out[i] = "--checkpointing=blocks"
    return out


def checkpointing(value: str | None, some: str | None) -> str | tuple[int | str, ...] | None:
    """``--checkpointing [VALUE]`` and ``--checkpoint-blocks`` as ``checkpointing=`` takes them.

    Raises:
        ConfigError: both given, or a value that is none of those ``--checkpointing`` takes.
    """
    if value is not None and some is not None:
        raise ConfigError("give --checkpointing (every block) or --checkpoint-blocks (some blocks), not both")
    if some is not None:
        parts = [p.strip() for p in some.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ConfigError(
                f"--checkpoint-blocks takes a number of blocks (12) or block indices (0,4,8), got {some!r}"
            )
        value = ",".join(parts)
    if value is None or value.strip().lower() == "none":
        return None
    value = value.strip().lower().replace(" ", "")
    if not CHECKPOINTING_VALUE.match(value):
        raise ConfigError(f"--checkpointing takes nothing (every block), a number of blocks (12), block indices "
                          f"(0,4,8), selective, 12+selective or auto; got {value!r}")  # fmt: skip
    if value in ("auto", "selective", "blocks"):
        return value
    if value.endswith("+selective"):
        from ..activation_checkpointing import checked_checkpointing  # torch: not imported for --help

        return checked_checkpointing(value)  # type: ignore[return-value]
    parts = value.split(",")
    if len(parts) == 1:
        return tuple(range(int(parts[0]))) or None
    return tuple(sorted({int(p) for p in parts}))


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
AccumulationOpt = Annotated[
    int,
    typer.Option(
        "--accumulation-steps",
        help="Micro-batches per optimizer step: above 1, earlier gradients stay alive through later micro-batches.",
    ),
]


class Maximize(str, Enum):
    """What ``fit`` searches: the largest micro-batch, or the longest sequence at a given batch."""

    batch_size = "batch-size"
    seq_len = "seq-len"


MaximizeOpt = Annotated[
    Maximize,
    typer.Option(
        "--maximize", help="batch-size: the largest micro-batch; seq-len: the longest sequence at --batch-size."
    ),
]
FitBatchSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        "-b",
        help="With --maximize seq-len: the batch to fit the sequence at; with --checkpointing auto: the micro-batch to "
        "fit with the fewest blocks checkpointed.",
    ),
]
SeqMultipleOpt = Annotated[
    int,
    typer.Option("--seq-multiple", help="With --maximize seq-len: only lengths that are multiples of this (e.g. 64)."),
]
ContextOpt = Annotated[
    float | None, typer.Option("--context-mib", help="Override the device's CUDA context size (MiB).")
]


class CudaLoading(str, Enum):
    """CUDA's module-loading mode, which decides the context's size."""

    lazy = "lazy"
    eager = "eager"


CudaLoadingOpt = Annotated[
    CudaLoading | None,
    typer.Option(
        "--cuda-loading",
        help="lazy (CUDA >= 11.7, PyTorch's default) or eager (every kernel loaded at start-up, a context over "
        "1 GiB); default: from CUDA_MODULE_LOADING and the CUDA version.",
    ),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        help="A device profile written by `batchfit calibrate` (its measured context and workspaces); by default "
        "the stored profile of this machine's GPU is used when the device is that GPU.",
    ),
]
CudnnBenchmarkOpt = Annotated[
    bool,
    typer.Option(
        "--cudnn-benchmark",
        help="The step runs with torch.backends.cudnn.benchmark = True: faster convolution engines, larger workspaces.",
    ),
]


def console() -> Any:
    from rich.console import Console

    return Console()


def console_err() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def overrides(seq_len: int | None, optimizer: str | None, sets: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set takes KEY=VALUE, got {item!r}; e.g. --set n_layer=4")
        out[key.strip()] = parse_value(value.strip())
    if seq_len is not None:
        out["seq_len"] = seq_len
    if optimizer is not None:
        out["optimizer"] = optimizer
    return out


def workload(
    preset: str,
    seq_len: int | None,
    optimizer: str | None,
    sets: list[str] | None,
    task: str | None = None,
    lora: str | None = None,
    lora_targets: str | None = None,
    fused_loss: str | None = None,
) -> Workload:
    from ..sources import load, parse_lora

    adapters = None
    if lora is not None or lora_targets is not None:
        adapters = parse_lora(lora or "", targets=lora_targets)
    return load(preset, task=task, lora=adapters, fused_loss=fused_loss, **overrides(seq_len, optimizer, sets))


def device(
    name: str,
    context_mib: float | None,
    profile: str | None = None,
    cuda_loading: CudaLoading | None = None,
    cudnn_benchmark: bool = False,
) -> Any:
    """The device a command names, with its CUDA context chosen (``context.resolve_device``).

    What was detected (a stored profile used, eager loading assumed) goes to stderr, one line each.
    """
    resolved = resolve_device(
        name,
        context_mib=context_mib,
        profile=profile,
        cuda_loading=None if cuda_loading is None else CudaLoading(cuda_loading).value,
        cudnn_benchmark=True if cudnn_benchmark else None,
    )
    for note in resolved.notes:
        sys.stderr.write(f"batchfit: {note}\n")
    return resolved.device


class InterconnectName(str, Enum):
    """How the plan's GPUs talk to each other (for its time predictions)."""

    nvlink = "nvlink"
    pcie = "pcie"
    ib = "ib"


InterconnectOpt = Annotated[
    InterconnectName,
    typer.Option("--interconnect", help="How the GPUs talk, for predicted times: nvlink, pcie or ib."),
]


TensorParallelOpt = Annotated[
    int | None,
    typer.Option(
        "--tp", help="Tensor-parallel GPUs per group (inside a node; 1: none). Default: as the ladder needs."
    ),
]
SequenceParallelOpt = Annotated[
    bool | None,
    typer.Option("--sp/--no-sp", help="Fix sequence parallelism with tensor parallelism (default: as needed)."),
]
GpusPerNodeOpt = Annotated[
    int, typer.Option("--gpus-per-node", help="GPUs sharing one node's NVLink (bounds the tensor-parallel degree).")
]


@contextlib.contextmanager
def progress(quiet: bool) -> Iterator[Any]:
    """A callback showing what is being traced on a terminal (None with ``--json`` or without a TTY)."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    with console_err().status("planning") as status:
        yield lambda text: status.update(text)


def emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")


class LrRule(str, Enum):
    """How ``--base-lr`` is scaled to the planned global batch."""

    auto = "auto"
    linear = "linear"
    sqrt = "sqrt"


BaseLrOpt = Annotated[
    float | None, typer.Option("--base-lr", help="A learning rate known to work at --base-batch-size.")
]
BaseBatchSizeOpt = Annotated[
    int | None, typer.Option("--base-batch-size", help="The global batch --base-lr was tuned at.")
]
LrRuleOpt = Annotated[
    LrRule, typer.Option("--lr-rule", help="auto (sqrt for Adam-type, linear otherwise), linear or sqrt.")
]
HfArgsOpt = Annotated[
    str | None,
    typer.Option(
        "--hf-args",
        help="Plan for the Hugging Face Trainer (equal micro-batches, its precision and checkpointing options) and "
        "write the TrainingArguments fields to set to this JSON file.",
    ),
]
