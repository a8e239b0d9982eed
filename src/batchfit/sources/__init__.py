"""Where workloads come from: a preset name, a function of the user's, or a model they name.

``load(spec)`` accepts, in this order:

- a preset name (``gpt``, ``hf-llama-7b``; ``batchfit presets`` lists them);
- ``path/to/file.py:function`` or ``package.module:function``: a function returning a ``Workload``;
- a Hugging Face hub id (``meta-llama/Llama-3.1-8B``), a local model directory or a ``config.json``:
  the model is built from its config alone (``sources/hub.py``), its task head from the config's
  ``architectures`` (or ``task=``).

Any of them can be fine-tuned through adapters (``lora=``, a ``LoraSpec`` or a ``--lora`` string), and
trained with an optimizer by name (``optimizer="paged_adamw_8bit"``; ``optimizer_factory``, ``sources/optim.py``);
a causal language model can be trained with a fused linear cross-entropy (``fused_loss="liger"`` or
``"cce"``, ``sources/fused.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, UnknownNameError
from . import presets
from .presets import call_workload_function, make_optimizer
from .presets import load as load_module_function

if TYPE_CHECKING:  # torch is imported when a workload is loaded, not by ``batchfit presets``
    from ..workload import Workload
    from .lora import LoraSpec, parse_lora
    from .optim import optimizer_factory

__all__ = ["LoraSpec", "as_workload", "load", "optimizer_factory", "parse_lora"]
_LAZY = {"LoraSpec": ".lora", "parse_lora": ".lora", "optimizer_factory": ".optim"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)

_HUB_KEYS = ("seq_len", "optimizer", "lr")


def _from_file(path: str, attr: str, spec: str) -> Any:
    file = Path(path).expanduser()
    if not file.exists():
        raise ConfigError(f"workload file {path!r} does not exist (from {spec!r})")
    name = f"batchfit_user_{abs(hash(str(file.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"cannot import {path!r}; a workload file must be a Python source file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    sys.path.insert(0, str(file.resolve().parent))  # the file's own imports of its neighbours
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ConfigError(f"importing {path!r} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(str(file.resolve().parent))
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{path!r} has no attribute {attr!r}; check the name after ':'")
        target = getattr(target, part)
    return target


def _function_spec(spec: str, overrides: dict[str, Any]) -> Workload:
    path, _, attr = spec.rpartition(":")
    if path.endswith(".py") or "/" in path or "\\" in path:
        if not attr:
            raise ConfigError(f"workload {spec!r} is malformed; write it as 'path/to/file.py:function'")
        return call_workload_function(_from_file(path, attr, spec), spec, overrides)
    return load_module_function(spec, **overrides)


def _hub_workload(spec: str, task: str | None, overrides: dict[str, Any]) -> Workload:
    from .hub import load_config, workload_from_config

    config = load_config(spec)
    fields = {k: v for k, v in overrides.items() if k not in _HUB_KEYS}
    for key, value in fields.items():
        if not hasattr(config, key):
            raise ConfigError(f"the {getattr(config, 'model_type', '?')} config has no field {key!r} to --set")
        setattr(config, key, value)
    optimizer = None
    if overrides.get("optimizer") is not None or overrides.get("lr") is not None:  # None given: the default
        optimizer = make_optimizer(str(overrides.get("optimizer") or "adamw"), overrides.get("lr"))
    return workload_from_config(config, task=task, seq_len=overrides.get("seq_len"), name=spec, optimizer=optimizer)


def with_lora(workload: Workload, lora: LoraSpec | str) -> Workload:
    """``workload`` fine-tuning adapters on its model (the base frozen).

    Raises:
        ConfigError: the workload's model is an instance (give a factory), or a bad spec.
    """
    from torch import nn

    from .lora import parse_lora, with_adapters

    spec = parse_lora(lora) if isinstance(lora, str) else lora
    if isinstance(workload.model, nn.Module):
        raise ConfigError("adapters need the workload's model as a factory (model=lambda: MyNet()), not an instance")
    rebuild = workload.at_seq_len
    return dataclasses.replace(
        workload,
        model=partial(with_adapters, workload.model, spec),
        name=f"{workload.name} + {spec.describe()}",
        config={**workload.config, "adapters": spec.describe()},
        at_seq_len=None if rebuild is None else partial(_with_lora_at, rebuild, spec),
        checkpoint_blocks=spec.checkpoint_blocks(workload.checkpoint_blocks),
    )


def _with_lora_at(rebuild: Any, spec: LoraSpec, seq_len: int) -> Workload:
    """The adapted workload at ``seq_len``: the base rebuilt there, then adapted alike."""
    return with_lora(rebuild(seq_len), spec)


def as_workload(workload: Any) -> Workload:
    """``workload`` itself, or the workload a string names (``load``): what the public functions accept.

    Raises:
        ConfigError: neither a ``Workload`` nor a string (or a string ``load`` refuses).
    """
    from ..workload import Workload

    if isinstance(workload, Workload):
        return workload
    if isinstance(workload, str):
        return load(workload)
    raise ConfigError(f"expected a Workload or a preset name, got {type(workload).__name__}")


def load(
    spec: str,
    *,
    task: str | None = None,
    lora: LoraSpec | str | None = None,
    fused_loss: str | None = None,
    **overrides: Any,
) -> Workload:
    """The workload ``spec`` names (see the module docstring), with ``overrides`` applied.

    Args:
        spec: a preset name, ``file.py:function`` / ``module:function``, a hub id, a model directory or
            a ``config.json``.
        task: the training task of a hub model (``causal-lm``, ``text-classification``, ...).
        lora: adapters to fine-tune instead of the whole model.
        fused_loss: ``"liger"`` or ``"cce"``: the loss of a causal language model as a fused linear
            cross-entropy computes it (no logits materialised).
        overrides: preset knobs / function arguments; for a hub model ``seq_len``, ``optimizer`` (a name:
            ``sources.optim.names()``), ``lr`` and any config field (``num_hidden_layers=2``).

    Raises:
        ConfigError: one line naming the fix (unknown name, unreadable file, missing config, a fused loss on
            a model that is not a causal language model, ...).
    """
    from .hub import looks_like_config

    spec = (spec or "").strip()
    if not spec:
        raise ConfigError("no model given; name a preset (batchfit presets), file.py:function or a hub id")
    hub = False
    if spec in presets.names():
        workload = presets.get(spec, **overrides)
    elif ":" in spec:
        workload = _function_spec(spec, overrides)
    elif looks_like_config(spec):
        workload, hub = _hub_workload(spec, task, overrides), True
    elif spec in presets.all_names():
        workload = presets.get(spec, **overrides)  # an hf-* preset without transformers: its own error
    else:
        raise UnknownNameError(
            "model", spec, presets.names(),
            hint="(a preset; or a hub id like 'org/name', a model directory, a config.json, or file.py:function)",
        )  # fmt: skip
    if task is not None and not hub:
        raise ConfigError("--task applies to hub models and config files, not to presets or workload functions")
    if fused_loss is not None:
        from .fused import with_fused_loss

        workload = with_fused_loss(workload, fused_loss)
    return with_lora(workload, lora) if lora else workload
