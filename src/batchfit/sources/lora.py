"""Parameter-efficient fine-tuning from the command line: ``--lora r=16,alpha=32,targets=q_proj+v_proj``.

The adapters come from ``peft`` itself (``get_peft_model``), so what is estimated is the model a user
trains: the base frozen (no gradients, no optimizer state), the adapters trainable, and the forward
through peft's own layers (their dropout and scaling included). QLoRA (``quant=nf4``) quantises the
base first and prepares it as peft's ``prepare_model_for_kbit_training`` does (``sources/quant.py``).

NOTE [ The fine-tuning recipe, said ]
Recipes for the same adapters differ in memory by a fifth or more, so each choice is an option, with the
mainstream recipe (peft and TRL today) as its default:

* ``kbit_prep`` (QLoRA): peft's ``prepare_model_for_kbit_training`` casts every parameter that is not
  quantised to fp32 (embeddings, norms, the head: the residual stream then runs in fp32 and the
  checkpointed layer inputs double) and makes the embeddings' output require grad. TRL and peft's own
  examples call it; LitGPT and Answer.AI's fsdp_qlora keep those weights in bf16 (``kbit_prep=false``).
* ``adapter_dtype``: the adapters' weights. By default they are what peft makes them: fp32 on a bf16 or
  fp16 base (``get_peft_model(..., autocast_adapter_dtype=True)``; each adapted layer then casts its input
  to fp32), as the HF Trainer and TRL train them. A loop that casts the whole model after wrapping it
  (``model.to(torch.bfloat16)``, Lightning's bf16-true) has ``bf16`` adapters: say ``adapter_dtype=bf16``.
  (Under ``bf16-true`` the cast is not the default yet: with it, the estimate of a Llama-3.1-8B LoRA on an
  H100 says a batch of 16 fits, completing after the allocator model releases its cache, where the GPU ran
  out of memory; ``benchmarks/results/README.md``.)
* ``quantize_head`` (QLoRA): transformers keeps the output head unquantised; Lightning's bitsandbytes
  precision (LitGPT's ``--quantize bnb.nf4``) quantises every linear layer, the head included.
* ``reentrant``: with checkpointing, ``use_reentrant=True`` (peft's and transformers' default before
  transformers 5.0) or ``False``; unset, transformers' own default.

``LoraSpec.describe`` says which recipe an estimate assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..activation_checkpointing import with_reentrant
from ..errors import ConfigError
from .quant import COMPUTE_DTYPES, QuantSpec, prepare_for_training, quantize

METHODS = ("lora", "ia3")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


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
    kbit_prep: bool = True
    """With ``quant``: peft's ``prepare_model_for_kbit_training`` (NOTE [ The fine-tuning recipe, said ])."""
    adapter_dtype: str | None = None
    """The adapters' weights: ``fp32``, ``bf16``, ``fp16``, or None for peft's own (fp32 on a half-precision
    base; NOTE [ The fine-tuning recipe, said ])."""
    reentrant: bool | None = None
    """Checkpointing with ``use_reentrant`` True or False; None: transformers' own default."""

    def __post_init__(self) -> None:
        if self.adapter_dtype is not None and self.adapter_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"unknown adapter dtype {self.adapter_dtype!r}; use one of {', '.join(COMPUTE_DTYPES)}")

    def describe(self) -> str:
        base = f" ({self.quant.describe()})" if self.quant is not None else ""
        if self.method == "ia3":
            return "IA3" + base + self._recipe()
        targets = self.targets if isinstance(self.targets, str) else "+".join(self.targets or ("default",))
        name = "QLoRA" if self.quant is not None and self.quant.kind != "int8" else "LoRA"
        return f"{name} r={self.r} on {targets}{base}{self._recipe()}"

    def checkpoint_blocks(self, blocks: tuple[type[nn.Module], ...]) -> tuple[type[nn.Module], ...]:
        """A workload's ``checkpoint_blocks`` with the recipe's ``reentrant`` choice among them (a marker
        ``checkpointing.checkpoint_classes`` carries to every place that checkpoints)."""
        if self.reentrant is None:
            return blocks

        return with_reentrant(blocks, self.reentrant)

    def _recipe(self) -> str:
        """The recipe's choices, where a quantised base or a non-default option makes them matter."""
        said = []
        if self.quant is not None:
            said.append("kbit prep" if self.kbit_prep else "no kbit prep")
        if self.adapter_dtype is not None:
            said.append(f"{self.adapter_dtype} adapters")
        if self.reentrant is not None:
            said.append("reentrant" if self.reentrant else "non-reentrant")
        return f"; {', '.join(said)}" if said else ""

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
    keys = ("r", "alpha", "dropout", "targets", "method", "quant", "double_quant", "compute", "quantize_head",
            "kbit_prep", "adapter_dtype", "reentrant")
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
    quant = _parse_quant(values)
    if quant is None and "kbit_prep" in values:
        raise ConfigError("--lora kbit_prep applies to quantised bases; add quant=nf4 (or fp4, int8)")
    kbit_prep = _flag(values, "kbit_prep")
    dtype = values.get("adapter_dtype")
    return LoraSpec(method=method, r=r, alpha=alpha, dropout=dropout, targets=parsed, quant=quant,
                    kbit_prep=True if kbit_prep is None else kbit_prep, adapter_dtype=dtype and dtype.lower(),
                    reentrant=_flag(values, "reentrant"))  # fmt: skip


def _flag(values: dict[str, str], key: str) -> bool | None:
    """A true/false value of ``--lora`` (None: not given)."""
    if key not in values:
        return None
    text = values[key].lower()
    if text not in _TRUE + _FALSE:
        raise ConfigError(f"--lora {key} must be true or false, got {values[key]!r}")
    return text in _TRUE


def _parse_quant(values: dict[str, str]) -> QuantSpec | None:
    """``quant=nf4[,double_quant=false][,compute=fp16]`` as a ``QuantSpec`` (None without ``quant``)."""
    if "quant" not in values:
        if "double_quant" in values or "compute" in values or "quantize_head" in values:
            raise ConfigError("--lora double_quant, compute and quantize_head apply to quantised bases; add quant=nf4 "
                              "(or fp4, int8)")  # fmt: skip
        return None
    double = _flag(values, "double_quant")
    return QuantSpec(kind=values["quant"].lower(), double_quant=True if double is None else double,
                     compute_dtype=values.get("compute", "bf16").lower(),
                     quantize_head=bool(_flag(values, "quantize_head")))  # fmt: skip


def with_adapters(factory: Callable[[], nn.Module], spec: LoraSpec) -> nn.Module:
    """``factory()``'s model wrapped by peft with ``spec``'s adapters (base frozen).

    Raises:
        ConfigError: peft missing, or peft refused the spec for this model (e.g. no such target module).
    """
    config = spec.peft_config()
    import peft

    base = factory()
    if spec.quant is not None:
        base = quantize(base, spec.quant)
        if spec.kbit_prep:
            base = prepare_for_training(base)
    try:
        model = peft.get_peft_model(base, config)
    except (ValueError, KeyError, TypeError) as e:
        text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise ConfigError(f"peft could not add {spec.describe()}: {text}") from e
    if spec.adapter_dtype is not None:
        _cast_trainable(model, COMPUTE_DTYPES[spec.adapter_dtype])
    return model


def _cast_trainable(model: nn.Module, dtype: Any) -> None:
    """The trainable modules (the adapters, and modules peft saves whole) in ``dtype``, as a cast of the whole
    model after wrapping leaves them (the frozen base keeps the dtype it was built in)."""
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own and all(p.requires_grad for p in own) and any(p.is_floating_point() and p.dtype != dtype for p in own):
            module.to(dtype)
