"""The model a user names: a Hugging Face hub id, a local model directory or a ``config.json``.

Only the configuration is read (a few KB: never weights), then the model is built from it on fake
tensors like any other workload. The hub is asked only for ``config.json``, through the local cache
first: ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) never touches the network, and without a
network the error says how to get the file instead of retrying for half a minute.
"""

from __future__ import annotations

import os
import socket
import threading
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from torch import nn

from ..activation_checkpointing import model_layers
from ..errors import ConfigError
from ..memory.trace.construct import buildable_under_fake_mode
from ..workload import Workload
from .hf_tasks import (
    choose_task,
    default_length,
    item_shape,
    make_batch_fn,
    max_positions,
    model_class_for,
    model_loss,
)
from .lora import with_adapters

_CONFIG = "config.json"


def looks_like_config(spec: str) -> bool:
    """Whether ``spec`` names a config: an existing directory or JSON file, or an ``org/name`` hub id."""
    path = Path(spec).expanduser()
    if path.is_dir() or (path.suffix == ".json" and path.exists()):
        return True
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~")) and ":" not in spec


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))  # fmt: skip


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether the hub's host resolves within ``timeout`` seconds (DNS only: no request is made)."""
    host = urlparse(url).hostname or "huggingface.co"
    result: list[bool] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, 443)
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _how_to_get(repo: str) -> str:
    return (
        f"download it with `huggingface-cli download {repo} config.json` (gated models need "
        "`huggingface-cli login` first) on a machine with network, or pass a local directory or config.json"
    )


def config_file(spec: str) -> Path:
    """The ``config.json`` that ``spec`` names (from the hub's local cache, or fetched when online).

    Raises:
        ConfigError: no such file, offline and not cached, unreachable, gated, or unknown on the hub.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        found = path / _CONFIG
        if not found.exists():
            raise ConfigError(f"{spec!r} is a directory without a config.json; point at a model directory")
        return found
    if path.suffix == ".json":
        if not path.exists():
            raise ConfigError(f"config file {spec!r} does not exist")
        return path
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.constants import ENDPOINT
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise ConfigError("reading a hub id needs transformers: install batchfit[hf]") from None
    try:
        return Path(hf_hub_download(spec, _CONFIG, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or a malformed id): decide below
        pass
    if _offline():
        raise ConfigError(f"the config of {spec!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                          + _how_to_get(spec))  # fmt: skip
    if not _reachable(ENDPOINT):
        raise ConfigError(f"the config of {spec!r} is not cached and the hub cannot be reached; " + _how_to_get(spec))
    try:
        return Path(hf_hub_download(spec, _CONFIG, etag_timeout=10))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one line
        kind = type(e).__name__
        if "Gated" in kind or "401" in str(e) or "403" in str(e):
            why = "it is gated: accept its licence on the hub and run `huggingface-cli login`"
        elif "NotFound" in kind or "404" in str(e):
            why = "no such model on the hub (check the id)"
        else:
            why = f"{kind}: {str(e).splitlines()[0][:200] if str(e) else kind}"
        raise ConfigError(f"could not fetch the config of {spec!r}: {why}; or " + _how_to_get(spec)) from e


def load_config(spec: str) -> Any:
    """The transformers config ``spec`` names (see ``config_file``).

    Raises:
        ConfigError: transformers missing, the file unreadable, or a model type transformers lacks.
    """
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("reading a model config needs transformers: install batchfit[hf]") from None
    file = config_file(spec)
    try:
        return AutoConfig.from_pretrained(str(file.parent if file.name == _CONFIG else file))
    except Exception as e:  # noqa: BLE001
        text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        if "trust_remote_code" in str(e) or "custom code" in str(e):
            text = "it needs the model's own code (trust_remote_code); write a workload file for it instead"
        raise ConfigError(f"cannot read the config of {spec!r}: {text}") from e


def build_from_config(config: Any, class_name: str) -> nn.Module:
    """A freshly initialised ``class_name`` model of ``config`` (on whatever tensors are active)."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise ConfigError(f"transformers {transformers.__version__} has no class {class_name}; upgrade transformers")

    with buildable_under_fake_mode():
        return cls(config)


def config_layers(config: Any, class_name: str) -> tuple[type[nn.Module], ...]:
    """The layer classes ``class_name``'s model of ``config`` checkpoints (``checkpointing.model_layers``),
    read off the model built on the meta device (no memory, a fraction of a second for 8B); none when
    it cannot be built there."""
    import warnings

    import torch

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_from_config(config, class_name)
    except Exception:  # noqa: BLE001 - a model meta cannot build: the trace itself will say what fails
        return ()
    return model_layers(model)


def workload_from_config(
    config: Any,
    *,
    task: str | None = None,
    seq_len: int | None = None,
    name: str | None = None,
    optimizer: Any = None,
    lora: Any = None,
) -> Workload:
    """A workload training ``config``'s model on ``task`` (the config's own by default).

    Args:
        config: a transformers ``PretrainedConfig``.
        task: a task name (``batchfit.sources.hf_tasks.TASKS``); None picks it from ``architectures``.
        seq_len: tokens per item (samples, for waveforms); None: 512, or less if the model's positions are fewer.
        optimizer: ``params -> Optimizer`` (AdamW by default).
        lora: a ``LoraSpec`` (``batchfit.sources.lora``) to fine-tune adapters only.

    Raises:
        ConfigError: no head for the task, a sequence longer than the model's positions, a bad LoRA spec.
    """
    import copy

    chosen = choose_task(config, task)
    class_name = model_class_for(config, chosen)
    config = copy.deepcopy(config)
    for cfg in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: config)())}.values():
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False  # training: no key/value cache
    length = default_length(config, chosen) if seq_len is None else int(seq_len)
    if length < 1:
        raise ConfigError(f"--seq-len must be at least 1, got {length}")
    limit = max_positions(config)
    if chosen.modality in ("text", "seq2seq") and limit and length > limit:
        raise ConfigError(f"--seq-len {length} is longer than the model's {limit} positions; pass --seq-len {limit}")
    batch, tokens = make_batch_fn(config, chosen, length)
    model: Any = partial(build_from_config, config, class_name)
    named = name or getattr(config, "_name_or_path", "") or class_name
    label = f"{named} ({chosen.name}, {item_shape(config, chosen, length)})"
    blocks = config_layers(config, class_name)
    if lora is not None:
        model = partial(with_adapters, model, lora)
        label = f"{label} + {lora.describe()}"
        blocks = lora.checkpoint_blocks(blocks)
    kwargs: dict[str, Any] = {}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    if chosen.modality != "image":  # every other task's items have a length: tokens, or a waveform's samples
        kwargs["at_seq_len"] = partial(_at_seq_len, config, chosen.name, name, optimizer, lora)
        kwargs["max_seq_len"] = None if chosen.modality == "audio" else limit
    return Workload(
        model=model,
        batch=batch,
        loss=model_loss,
        name=label,
        tokens_per_item=tokens,
        checkpoint_blocks=blocks,
        config={"task": chosen.name, "model_class": class_name, "seq_len": length,
                "model_type": getattr(config, "model_type", "?"),
                **({"seq_unit": "samples"} if chosen.modality == "audio" else {})},  # fmt: skip
        **kwargs,
    )


def _at_seq_len(config: Any, task: str, name: str | None, optimizer: Any, lora: Any, seq_len: int) -> Workload:
    """The same model, head, optimizer and adapters at ``seq_len`` (``Workload.at_seq_len``)."""
    return workload_from_config(config, task=task, seq_len=seq_len, name=name, optimizer=optimizer, lora=lora)
