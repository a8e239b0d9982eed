"""Built-in workloads by name (``mlp``, ``cnn``, ``gpt``, ``hf-*``) and loading of a user's own workload.

Presets are plain Workloads made of picklable pieces (module-level functions, ``functools.partial``), so
they trace on fake tensors, travel to worker processes and record their knobs in ``Workload.config``.
Importing this module does not import ``transformers``.

Example:
    >>> from batchfit import presets
    >>> wl = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
    >>> wl.tokens_per_item
    32
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, UnknownNameError
from ..models import hf
from .optim import default_lr, optimizer_factory

if TYPE_CHECKING:  # the presets' models import torch when a preset is built, not when listed
    import torch
    from torch import nn

    from ..workload import Workload

Knobs = dict[str, tuple[type, Any]]
"""Name -> (type, default) of the overrides a preset accepts."""

_COMMON: Knobs = {"optimizer": (str, "adamw"), "lr": (float, None)}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def item_seed(seed: int, item_id: int) -> int:
    """A 63-bit seed mixing ``seed`` and ``item_id`` (splitmix64), so nearby ids get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + item_id + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def per_item(
    item_ids: torch.Tensor, seed: int, make: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
) -> tuple[torch.Tensor, ...]:
    """Stack ``make(generator)`` over items, each with its own generator seeded by ``(seed, id)``.

    Item ``i`` therefore depends only on ``(item_ids[i], seed)``: the same items reach the model whatever
    the micro-batch split or the number of workers. Real tensors only (reads the ids).
    """
    import torch

    ids = torch.as_tensor(item_ids).reshape(-1).tolist()
    if not ids:
        return tuple(t[None][:0] for t in make(torch.Generator().manual_seed(0)))
    rows = [make(torch.Generator().manual_seed(item_seed(int(seed), int(i)))) for i in ids]
    return tuple(torch.stack(column) for column in zip(*rows, strict=True))


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the items of ``(inputs, labels)``."""
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(model(x), y)


def make_optimizer(name: str, lr: float | None = None) -> Callable[..., torch.optim.Optimizer]:
    """``params -> Optimizer`` for an optimizer name at ``lr`` (None: its default).

    ``adamw``, ``adam``, ``sgd`` (momentum 0.9) and the Hugging Face ``optim`` names that matter for memory
    (``adamw_8bit``, ``paged_adamw_8bit``, ``adafactor``, ``lion``, ...): ``batchfit.sources.optim``.

    Raises:
        UnknownNameError: another optimizer name (the message lists the valid ones).
        MissingExtraError: the package of its class is not installed.
    """
    return optimizer_factory(name, lr)


def _coerce(preset: str, key: str, typ: type, value: Any) -> Any:
    """``value`` as ``typ``; strings are parsed too, so CLI ``key=value`` pairs can be passed as they are."""
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _BOOLS:
                return _BOOLS[value.lower()]
        elif typ is int and not isinstance(value, bool):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, (int, str)):
                return int(value)
        elif typ is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
            return float(value)
        elif typ is list and isinstance(value, (str, list, tuple)):
            parts = value.split(",") if isinstance(value, str) else value
            if all(not isinstance(p, bool) for p in parts):
                return [int(p) for p in parts]
        elif typ is str and isinstance(value, str):
            return value
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"preset {preset!r}: {key}={value!r} is not a valid {typ.__name__}")


def _resolve(preset: str, knobs: Knobs, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults updated by ``overrides``, type-checked and range-checked; the optimizer's lr filled in."""
    unknown = sorted(set(overrides) - set(knobs))
    if unknown:
        raise ConfigError(
            f"unknown override{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for preset {preset!r}; "
            f"valid: {', '.join(knobs)}"
        )
    cfg = {k: list(d) if isinstance(d, list) else d for k, (_, d) in knobs.items()}
    for key, value in overrides.items():
        typ, default = knobs[key]
        if value is None and default is None:  # None is the default itself ("derive it")
            continue
        value = _coerce(preset, key, typ, value)
        numbers = value if isinstance(value, list) else [value]
        if typ in (int, list) and any(v < 1 for v in numbers):
            raise ConfigError(f"preset {preset!r}: {key} must be at least 1, got {value!r}")
        if typ is float and key == "dropout" and not 0.0 <= value < 1.0:
            raise ConfigError(f"preset {preset!r}: dropout must be in [0, 1), got {value!r}")
        if typ is float and key != "dropout" and not value > 0.0:
            raise ConfigError(f"preset {preset!r}: {key} must be positive, got {value!r}")
        cfg[key] = value

    if cfg["lr"] is None:
        cfg["lr"] = default_lr(cfg["optimizer"])  # an unknown name: one error listing the valid ones
    return cfg


def _assemble(
    name: str,
    cfg: dict[str, Any],
    model: Callable[[], nn.Module],
    loss: Callable[..., Any],
    blocks: tuple[type[nn.Module], ...],
    batch_fn: Callable[..., Any],
    item_fn: Callable[..., Any],
    data: dict[str, Any],
    item_extra: dict[str, Any] | None = None,
    tokens: int | None = None,
) -> Workload:
    """A Workload whose tracing batches and synthetic items take the same shape arguments ``data``."""
    from ..workload import Workload

    return Workload(
        model=model,
        batch=partial(batch_fn, **data),
        loss=loss,
        optimizer=make_optimizer(cfg["optimizer"], cfg["lr"]),
        name=name,
        tokens_per_item=tokens,
        checkpoint_blocks=blocks,
        items=partial(per_item, make=partial(item_fn, **data, **(item_extra or {}))),
        config=cfg,
    )


def _mlp(overrides: Mapping[str, Any]) -> Workload:
    from ..models.mlp import MLP, MLPBlock, mlp_batch, mlp_item

    knobs: Knobs = {"in_features": (int, 32), "hidden": (int, 64), "depth": (int, 3), "classes": (int, 10)}
    cfg = _resolve("mlp", {**knobs, "dropout": (float, 0.0), **_COMMON}, overrides)
    model = partial(MLP, *(cfg[k] for k in ("in_features", "hidden", "depth", "classes", "dropout")))
    data = dict(in_features=cfg["in_features"], classes=cfg["classes"])
    return _assemble("mlp", cfg, model, classification_loss, (MLPBlock,), mlp_batch, mlp_item, data)


def _cnn(overrides: Mapping[str, Any]) -> Workload:
    from ..models.cnn import BasicBlock, ResNet, image_batch, image_item

    knobs: Knobs = {"image_size": (int, 32), "channels": (int, 3), "width": (int, 16), "stages": (int, 3)}
    knobs.update({"blocks": (int, 2), "classes": (int, 10), "dropout": (float, 0.0)})
    cfg = _resolve("cnn", {**knobs, **_COMMON}, overrides)
    args = ("channels", "width", "stages", "blocks", "classes", "dropout")
    model = partial(ResNet, *(cfg[k] for k in args))
    data = dict(channels=cfg["channels"], image_size=cfg["image_size"], classes=cfg["classes"])
    return _assemble("cnn", cfg, model, classification_loss, (BasicBlock,), image_batch, image_item, data)


def _gpt(overrides: Mapping[str, Any]) -> Workload:
    from ..models.gpt import GPT, Block, GPTConfig, gpt_loss, token_batch, token_item

    knobs: Knobs = {"n_layer": (int, 12), "n_head": (int, 12), "n_embd": (int, 768), "seq_len": (int, 1024)}
    knobs.update({"vocab_size": (int, 50257), "block_size": (int, None), "dropout": (float, 0.0)})
    knobs.update({"bias": (bool, True), "pad": (bool, False)})
    cfg = _resolve("gpt", {**knobs, **_COMMON}, overrides)
    if cfg["n_embd"] % cfg["n_head"]:
        raise ConfigError(f"preset 'gpt': n_embd={cfg['n_embd']} must be divisible by n_head={cfg['n_head']}")
    if cfg["block_size"] is None:  # GPT-2's 1,024 positions, more if the sequences are longer
        cfg["block_size"] = max(1024, cfg["seq_len"])
    elif cfg["seq_len"] > cfg["block_size"]:
        raise ConfigError(f"preset 'gpt': seq_len={cfg['seq_len']} exceeds block_size={cfg['block_size']}")
    model = partial(GPT, GPTConfig(**{k: cfg[k] for k in GPTConfig.__dataclass_fields__}))
    data = dict(seq_len=cfg["seq_len"], vocab_size=cfg["vocab_size"])
    extra, seq = {"pad": cfg["pad"]}, cfg["seq_len"]
    wl = _assemble("gpt", cfg, model, gpt_loss, (Block,), token_batch, token_item, data, extra, seq)
    return dataclasses.replace(wl, tp_plan=GPT_TP_PLAN)


GPT_TP_PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
"""The ``gpt`` preset's tensor-parallel plan: the feed-forward of every block (column-wise up, row-wise
down). Its attention projects q, k and v with one fused layer (``c_attn``), whose rows a column-wise
split would cut into q, k and v unevenly, so attention stays whole on every rank."""


def _hf_workload(name: str, overrides: Mapping[str, Any]) -> Workload:
    from ..models import hf_data
    from ..models.cnn import image_batch, image_item
    from ..models.gpt import token_batch, token_item

    if not hf.available():
        raise ConfigError(f"preset {name!r} needs transformers; install batchfit[hf]")
    cfg = _resolve(name, {**hf.knobs(name), **_COMMON}, overrides)
    fields = hf.config_fields(name, cfg, overrides)
    kind, blocks = hf.SPECS[name].kind, (hf.block_class(name),)
    model = partial(hf.build_model, name, fields)
    if kind == "causal-lm":
        data = dict(seq_len=cfg["seq_len"], vocab_size=cfg["vocab_size"])
        extra = {"pad": cfg["pad"]}
        loss = hf_data.causal_lm_loss
        return _assemble(name, cfg, model, loss, blocks, token_batch, token_item, data, extra, cfg["seq_len"])
    if kind == "text-cls":
        data = dict(seq_len=cfg["seq_len"], vocab_size=cfg["vocab_size"], num_labels=cfg["num_labels"])
        batch_fn, item_fn, loss = hf_data.text_cls_batch, hf_data.text_cls_item, hf_data.text_cls_loss
        return _assemble(name, cfg, model, loss, blocks, batch_fn, item_fn, data, None, cfg["seq_len"])
    data = dict(channels=cfg["num_channels"], image_size=cfg["image_size"], classes=cfg["num_labels"])
    return _assemble(name, cfg, model, hf_data.image_cls_loss, blocks, image_batch, image_item, data)


_OWN: dict[str, tuple[str, Callable[[Mapping[str, Any]], Workload]]] = {
    "mlp": ("small MLP classifier (32 -> 64 -> 64 -> 10), pure torch", _mlp),
    "cnn": ("small ResNet-style CNN with BatchNorm, 32x32 images, 10 classes, pure torch", _cnn),
    "gpt": ("GPT-2 small shaped decoder (124M, tied embeddings), seq_len 1024, pure torch", _gpt),
}


def names() -> list[str]:
    """The preset names available here (the ``hf-*`` ones only when ``transformers`` is installed)."""
    return list(_OWN) + (list(hf.SPECS) if hf.available() else [])


def all_names() -> list[str]:
    """Every preset name, available here or not."""
    return list(_OWN) + list(hf.SPECS)


def describe() -> list[tuple[str, str]]:
    """``(name, one-line description)`` of every available preset, for listings."""
    own = [(name, desc) for name, (desc, _) in _OWN.items()]
    return own + ([(name, spec.description) for name, spec in hf.SPECS.items()] if hf.available() else [])


_POSITIONS = {"gpt": "block_size", **{name: spec.position_field for name, spec in hf.SPECS.items()}}
"""The knob holding a preset's number of positions: the longest sequence its model takes."""


def _with_sequence(name: str, workload: Workload, overrides: Mapping[str, Any]) -> Workload:
    """``workload`` able to be rebuilt at another sequence length (``Workload.at_seq_len``), when it has one.

    The positions are pinned at the number this workload's model has, so that only the sequence changes
    (left to themselves they grow with ``seq_len``); that number is the longest sequence it takes.
    """
    import dataclasses

    if "seq_len" not in workload.config:
        return workload
    knob = _POSITIONS.get(name)
    limit = workload.config.get(knob) if knob else None
    pinned = {k: v for k, v in overrides.items() if k != "seq_len"}
    if knob and limit is not None:
        pinned[knob] = limit
    return dataclasses.replace(workload, at_seq_len=partial(_at_seq_len, name, pinned), max_seq_len=limit)


def _at_seq_len(name: str, overrides: dict[str, Any], seq_len: int) -> Workload:
    return get(name, **overrides, seq_len=seq_len)


def get(name: str, **overrides: Any) -> Workload:
    """The preset ``name`` with its knobs changed by ``overrides`` (e.g. ``seq_len=256``, ``lr=3e-4``).

    Every preset accepts ``optimizer`` (``adamw``, ``adam``, ``sgd`` or a Hugging Face ``optim`` name such
    as ``paged_adamw_8bit``: ``batchfit.sources.optim.names()``) and ``lr``; the others are listed in the
    error raised for an unknown one.

    Raises:
        UnknownNameError: no preset of that name (the message suggests close ones).
        ConfigError: an unknown or invalid override, or ``transformers`` missing for an ``hf-*`` preset.
    """
    if name in _OWN:
        return _with_sequence(name, _OWN[name][1](overrides), overrides)
    if name in hf.SPECS:
        return _with_sequence(name, _hf_workload(name, overrides), overrides)
    hint = "; for your own workload pass 'module.path:function'"
    if not hf.available():
        hint += "; the hf-* presets need transformers: install batchfit[hf]"
    raise UnknownNameError("preset", name, names(), hint=hint)


def load(spec: str, **overrides: Any) -> Workload:
    """A preset name, or ``"module.path:function"``: a function of the user's returning a Workload.

    The function is called with ``overrides`` as keyword arguments; a module-level Workload instance
    is accepted too (without overrides).

    Raises:
        ConfigError: a one-line message naming the fix (module not importable, attribute missing,
            wrong arguments, or a result that is not a Workload).
    """
    if ":" not in spec:
        return get(spec, **overrides)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"workload {spec!r} is malformed; write it as 'module.path:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"cannot import {module_name!r} for workload {spec!r} ({e}); check the module path and PYTHONPATH"
        ) from e
    except Exception as e:
        raise ConfigError(
            f"importing {module_name!r} for workload {spec!r} failed: {type(e).__name__}: {e}"
        ) from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}; check the name after ':'")
        target = getattr(target, part)
    return call_workload_function(target, spec, overrides)


def call_workload_function(target: Any, spec: str, overrides: Mapping[str, Any]) -> Workload:
    """``target(**overrides)`` checked to be a Workload (``target`` may be a Workload itself).

    Raises:
        ConfigError: not callable, arguments it does not take, it raised, or it returned something else.
    """
    from ..workload import Workload

    if isinstance(target, Workload):
        if overrides:
            raise ConfigError(f"{spec!r} is a Workload, not a function: it takes no overrides")
        return target
    if not callable(target):
        raise ConfigError(
            f"{spec!r} is not callable ({type(target).__name__}); point it at a function returning a Workload"
        )
    try:
        inspect.signature(target).bind(**overrides)
    except TypeError as e:
        raise ConfigError(f"{spec!r} does not accept the overrides {sorted(overrides)}: {e}") from e
    except ValueError:  # no signature to check (some builtins): let the call decide
        pass
    try:
        result = target(**overrides)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{spec!r} raised {type(e).__name__}: {e}") from e
    if not isinstance(result, Workload):
        raise ConfigError(f"{spec!r} returned {type(result).__name__}, not a batchfit.Workload")
    if result.at_seq_len is None and _takes_seq_len(target):  # the function itself rebuilds it at any length
        import dataclasses

        rest = {k: v for k, v in overrides.items() if k != "seq_len"}
        result = dataclasses.replace(result, at_seq_len=partial(_call_at_seq_len, target, spec, rest))
    return result


def _takes_seq_len(target: Any) -> bool:
    try:
        return "seq_len" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _call_at_seq_len(target: Any, spec: str, overrides: dict[str, Any], seq_len: int) -> Workload:
    return call_workload_function(target, spec, {**overrides, "seq_len": seq_len})
