"""Parameter-efficient fine-tuning from the command line: ``--lora r=16,alpha=32,targets=q_proj+v_proj``.

The adapters come from ``peft`` itself (``get_peft_model``), so what is estimated is the model a user
trains: the base frozen (no gradients, no optimizer state), the adapters trainable, and the forward
through peft's own layers (their dropout and scaling included). QLoRA (``quant=nf4``) quantises the
base first and prepares it as peft's ``prepare_model_for_kbit_training`` does (``sources/quant.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import ConfigError
from .quant import QuantSpec

METHODS = ("lora", "ia3")


@dataclass(frozen=True)
class LoraSpec:
    """The adapters to add to a model."""

    method: str = "lora"
    """``lora`` or ``ia3``."""
    r: int = 8
    """LoRA rank."""
    alpha: float | None = None
    """LoRA scaling numerator (``lora_alpha``); None: twice the rank."""
    dropout: float = 0.0
    targets: tuple[str, ...] | str | None = None
    """Module names to adapt, ``"all-linear"``, or None for peft's defaults for the model type."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other peft config fields, passed through (e.g. ``modules_to_save``)."""
    quant: QuantSpec | None = None
    """Quantised base weights (QLoRA: ``QuantSpec("nf4")``); None keeps the base in the load dtype."""

    def describe(self) -> str:
        base = f" ({self.quant.describe()})" if self.quant is not None else ""
        if self.method == "ia3":
            return "IA3" + base
        targets = self.targets if isinstance(self.targets, str) else "+".join(self.targets or ("default",))
        name = "QLoRA" if self.quant is not None and self.quant.kind != "int8" else "LoRA"
        return f"{name} r={self.r} on {targets}{base}"

    def peft_config(self) -> Any:
        """The ``peft`` config object (imports peft).

        Raises:
            ConfigError: peft is not installed.
        """
        try:
            import peft
        except ImportError:
            raise ConfigError("LoRA needs peft: pip install peft (or batchfit[peft])") from None
        targets = list(self.targets) if isinstance(self.targets, tuple) else self.targets
        if self.method == "ia3":
            return peft.IA3Config(target_modules=targets, **self.extra)
        alpha = self.alpha if self.alpha is not None else 2 * self.r
        return peft.LoraConfig(r=self.r, lora_alpha=alpha, lora_dropout=self.dropout, target_modules=targets,
                               **self.extra)  # fmt: skip


def parse_lora(text: str, *, targets: str | None = None, method: str = "lora") -> LoraSpec:
    """``"r=16,alpha=32,targets=q_proj+v_proj,dropout=0.05"`` as a ``LoraSpec``.

    ``targets`` (``--lora-targets``) overrides the spec's; ``all-linear`` adapts every linear layer but
    the output head.

    Raises:
        ConfigError: an unknown key or a value of the wrong kind, with the valid keys.
    """
    values: dict[str, Any] = {}
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            raise ConfigError(f"--lora takes KEY=VALUE pairs separated by commas, got {part!r}; e.g. r=16,alpha=32")
        values[key] = value
    keys = ("r", "alpha", "dropout", "targets", "method", "quant", "double_quant", "compute")
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise ConfigError(f"unknown --lora key {', '.join(unknown)}; valid: {', '.join(keys)}")
    method = values.pop("method", method).lower()
    if method not in METHODS:
        raise ConfigError(f"unknown adapter method {method!r}; use one of {', '.join(METHODS)}")
    try:
        r = int(values.get("r", 8))
        alpha = float(values["alpha"]) if "alpha" in values else None
        dropout = float(values.get("dropout", 0.0))
    except ValueError as e:
        raise ConfigError(f"--lora: {e}; r is a whole number, alpha and dropout are numbers") from None
    if r < 1:
        raise ConfigError(f"--lora r must be at least 1, got {r}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"--lora dropout must be in [0, 1), got {dropout}")
    chosen = targets if targets is not None else values.get("targets")
    parsed: tuple[str, ...] | str | None = None
    if chosen:
        chosen = chosen.strip()
        parsed = chosen if chosen == "all-linear" else tuple(t for t in chosen.replace(",", "+").split("+") if t)
    return LoraSpec(method=method, r=r, alpha=alpha, dropout=dropout, targets=parsed, quant=_parse_quant(values))


def _parse_quant(values: dict[str, str]) -> QuantSpec | None:
    """``quant=nf4[,double_quant=false][,compute=fp16]`` as a ``QuantSpec`` (None without ``quant``)."""
    if "quant" not in values:
        if "double_quant" in values or "compute" in values:
            raise ConfigError("--lora double_quant and compute apply to quantised bases; add quant=nf4 (or fp4, int8)")
        return None
    double = values.get("double_quant", "true").lower()
    if double not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"--lora double_quant must be true or false, got {double!r}")
    return QuantSpec(kind=values["quant"].lower(), double_quant=double in ("true", "1", "yes"),
                     compute_dtype=values.get("compute", "bf16").lower())  # fmt: skip


def with_adapters(factory: Callable[[], nn.Module], spec: LoraSpec) -> nn.Module:
    """``factory()``'s model wrapped by peft with ``spec``'s adapters (base frozen).

    Raises:
        ConfigError: peft missing, or peft refused the spec for this model (e.g. no such target module).
    """
    config = spec.peft_config()
    import peft

    base = factory()
    if spec.quant is not None:
        from .quant import prepare_for_training, quantize

        base = prepare_for_training(quantize(base, spec.quant))
    try:
        return peft.get_peft_model(base, config)
    except (ValueError, KeyError, TypeError) as e:
        text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise ConfigError(f"peft could not add {spec.describe()}: {text}") from e
