"""Quantised base weights, as a QLoRA script loads them: bitsandbytes 4-bit (NF4 / FP4) or 8-bit linears.

A QLoRA script calls ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``, then peft's
``prepare_model_for_kbit_training`` and ``get_peft_model``. There are no weights to load here, so the
model is built from its config and then converted the way transformers' bitsandbytes quantizer
converts it while loading (``transformers/quantizers/quantizer_bnb_4bit.py``,
``_process_model_before_weight_loading``: ``replace_with_bnb_linear`` on every exact ``nn.Linear``
but the modules it keeps, ``lm_head`` among them), each weight quantised by bitsandbytes itself.
NOTE [ A 4-bit weight's storages ] says what that leaves in memory.

On real tensors the weights are bitsandbytes' own ``Params4bit`` / ``Int8Params``. Fake tensors cannot
be wrapped in those subclasses, so on fake tensors a weight is a plain frozen ``Parameter`` holding
the same storages with the same ``quant_state`` (or ``SCB``) attribute, which is all the forward and
backward of ``Linear4bit`` / ``Linear8bitLt`` read.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

QUANT_TYPES = ("nf4", "fp4", "int8")
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class QuantSpec:
    """How the frozen base weights are quantised (a ``BitsAndBytesConfig``)."""

    kind: str = "nf4"
    """``nf4`` or ``fp4`` (4-bit, ``load_in_4bit``), or ``int8`` (``load_in_8bit``, LLM.int8())."""
    double_quant: bool = True
    """4-bit only: quantise the per-block scales again (``bnb_4bit_use_double_quant``), as QLoRA does."""
    compute_dtype: str = "bf16"
    """4-bit only: the dtype the matmul runs in (``bnb_4bit_compute_dtype``): bf16, fp16 or fp32."""
    blocksize: int = 64
    """4-bit only: values per scale (bitsandbytes' default)."""
    quantize_head: bool = False
    """Quantise the output head too, as Lightning's bitsandbytes precision does; transformers keeps it in the
    load dtype (``get_keys_to_not_convert``). A head tied to the input embeddings stays unquantised."""

    def __post_init__(self) -> None:
        if self.kind not in QUANT_TYPES:
            raise ConfigError(f"unknown quantisation {self.kind!r}; use one of {', '.join(QUANT_TYPES)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"unknown compute dtype {self.compute_dtype!r}; use one of {', '.join(COMPUTE_DTYPES)}")

    def describe(self) -> str:
        head = ", head quantised" if self.quantize_head else ""
        if self.kind == "int8":
            return f"int8 base, outlier columns assumed none{head}"
        return f"{self.kind}{' double-quant' if self.double_quant else ''} base, {self.compute_dtype} compute{head}"

    def bnb_config(self) -> Any:
        """The transformers ``BitsAndBytesConfig`` a QLoRA script passes to ``from_pretrained``."""
        from transformers import BitsAndBytesConfig

        if self.kind == "int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.kind,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=COMPUTE_DTYPES[self.compute_dtype],
        )


def require_bitsandbytes() -> Any:
    """``import bitsandbytes``, or one line naming the extra that installs it.

    Raises:
        ConfigError: bitsandbytes (or transformers, whose quantizer the conversion follows) is missing.
    """
    try:
        with quiet_bitsandbytes():
            import bitsandbytes
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"quantised base weights need bitsandbytes and transformers ({e.name or e} is missing): "
            "pip install 'batchfit[qlora]'"
        ) from None
    return bitsandbytes


@contextlib.contextmanager
def quiet_bitsandbytes() -> Iterator[None]:
    """bitsandbytes' notices about kernels a CPU-only machine lacks are not the user's concern here."""
    import logging

    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


# NOTE [ A 4-bit weight's storages ]
# bitsandbytes/functional.py, `quantize_4bit` (0.4x-0.50): a weight of n values becomes
#   - the packed values, uint8, ceil(n/2) (two 4-bit codes a byte), shape [ceil(n/2), 1];
#   - with double quantisation (`compress_statistics`, QLoRA's default): the per-block scales
#     quantised again, uint8, ceil(n/blocksize); their own scales, fp32, ceil(ceil(n/blocksize)/256);
#     the 256-entry fp32 dynamic code of that second quantisation; and the 0-d fp32 offset subtracted
#     before it (the scales' mean);
#   - without it: the scales themselves, fp32, ceil(n/blocksize);
#   - the 16-entry fp32 code of NF4 / FP4 (`get_4bit_type`), one per weight.
# About 4.13 bits a value at blocksize 64 with double quantisation. 8-bit (`Linear8bitLt`, LLM.int8()):
# the int8 weight [out, in] and its fp32 row scales `SCB` [out] (bitsandbytes/nn/modules.py,
# `Int8Params._quantize`). Nothing else of the linear stays: its bias keeps the load dtype.


def quantized_weight_bytes(numel: int, spec: QuantSpec) -> int:
    """Bytes a weight of ``numel`` values takes once quantised (NOTE [ A 4-bit weight's storages ]);
    for int8 ``numel`` is out x in and the row scales are counted by ``int8_scale_bytes``."""
    if spec.kind == "int8":
        return numel
    blocks = -(-numel // spec.blocksize)
    scales = blocks + 4 * -(-blocks // 256) + 256 * 4 + 4 if spec.double_quant else 4 * blocks
    return -(-numel // 2) + scales + 16 * 4


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _shapes_only(t: torch.Tensor) -> bool:
    """A tensor without values (fake, or on ``meta``: the build depth synthesis plans from), quantised by the
    library's kernels' shape rules instead of by its parameter classes (which leave a meta tensor as it is)."""
    return _is_fake(t) or t.is_meta


@contextlib.contextmanager
def _parameters_of_fakes() -> Iterator[None]:
    """bitsandbytes' parameter classes accept fake data while active: ``Params4bit(fake)`` and
    ``Int8Params(fake)`` give a plain frozen ``Parameter`` with the same attributes (a tensor subclass
    cannot wrap a fake tensor, and ``Linear4bit.__init__`` makes one of its empty weight)."""
    import inspect

    import bitsandbytes as bnb

    classes = (bnb.nn.Params4bit, bnb.nn.Int8Params)
    originals = {cls: cls.__dict__["__new__"] for cls in classes}

    def patched(cls: type, *args: Any, **kwargs: Any) -> Any:
        original = originals[cls]
        bound = inspect.signature(original).bind(cls, *args, **kwargs)
        bound.apply_defaults()
        fields = dict(bound.arguments)
        fields.pop("cls", None)
        data, requires_grad = fields.pop("data", None), fields.pop("requires_grad", False)
        if data is None or not _is_fake(data):
            return original(cls, *args, **kwargs)
        param = nn.Parameter(data, requires_grad=bool(requires_grad))
        for name, value in fields.items():
            setattr(param, name, value)
        return param

    try:
        for cls in classes:
            cls.__new__ = staticmethod(patched)
        yield
    finally:
        for cls, original in originals.items():
            cls.__new__ = original


def _real_dynamic_map() -> None:
    """bitsandbytes makes the code of its 8-bit blockwise quantisation once and keeps it in a module-level
    dict (``functional.name2qmap["dynamic"]``, made on the first call): made under a fake mode it would be a
    fake tensor, and every real quantisation after it would copy a fake code. It is made for real here
    (and a fake one left by anything else replaced)."""
    import bitsandbytes.functional as F
    from torch.utils._python_dispatch import _disable_current_modes

    cached = F.name2qmap.get("dynamic")
    if cached is None or _shapes_only(cached):
        with _disable_current_modes(), torch.device("cpu"):  # real values, under a meta build's device too
            F.name2qmap["dynamic"] = F.create_dynamic_map()


def _quantize_4bit(module: nn.Module, weight: torch.Tensor, spec: QuantSpec) -> nn.Parameter:
    """``weight`` quantised into ``module`` (a ``Linear4bit``) by bitsandbytes' ``quantize_4bit``."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    _real_dynamic_map()
    data = weight.detach()
    if not _shapes_only(data):
        param = bnb.nn.Params4bit(
            data, requires_grad=False, blocksize=spec.blocksize, compress_statistics=spec.double_quant,
            quant_type=spec.kind, quant_storage=torch.uint8, module=module,
        )  # fmt: skip
        return param.to(data.device)  # quantises (``Params4bit._quantize``)
    packed, state = F.quantize_4bit(
        data, blocksize=spec.blocksize, compress_statistics=spec.double_quant, quant_type=spec.kind,
        quant_storage=torch.uint8,
    )  # fmt: skip
    param = nn.Parameter(packed, requires_grad=False)
    # The attributes ``Params4bit`` carries, which peft reads when it wraps the layer (``dispatch_bnb_4bit``).
    fields = dict(quant_state=state, blocksize=spec.blocksize, compress_statistics=spec.double_quant,
                  quant_type=spec.kind, quant_storage=torch.uint8, bnb_quantized=True, module=module)  # fmt: skip
    for name, value in fields.items():
        setattr(param, name, value)
    module.quant_state = state
    return param


def _quantize_int8(module: nn.Module, weight: torch.Tensor) -> nn.Parameter:
    """``weight`` quantised into ``module`` (a ``Linear8bitLt``) row by row, as ``Int8Params`` does."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    data = weight.detach()
    if not _shapes_only(data):
        param = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
        return param.to(data.device)  # quantises (``Int8Params._quantize``)
    int8, scales, _ = F.int8_vectorwise_quant(data.to(torch.float16))
    param = nn.Parameter(int8, requires_grad=False)
    param.CB, param.SCB = int8, scales
    module.state.CB, module.state.SCB = int8, scales
    return param


def quantize(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """``model`` with its linears converted and quantised as transformers' bitsandbytes quantizer does.

    Raises:
        ConfigError: bitsandbytes or transformers missing, or no linear layer to quantise.
    """
    require_bitsandbytes()
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    config = spec.bnb_config()
    keep = list(get_keys_to_not_convert(model)) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if spec.quantize_head:
        keep = [k for k in keep if k not in _untied_head_names(model)]
    before = {name: m for name, m in model.named_modules()}
    with quiet_bitsandbytes(), _parameters_of_fakes():
        replace_with_bnb_linear(model, modules_to_not_convert=keep, quantization_config=config)
    converted = 0
    for name, module in model.named_modules():
        old = before.get(name)
        if old is None or old is module or not hasattr(module, "source_cls"):
            continue
        weight = old.weight if not hasattr(old, "nf") else old.weight.t()  # transformers' Conv1D stores [in, out]
        with quiet_bitsandbytes(), _parameters_of_fakes():
            if spec.kind == "int8":
                module.weight = _quantize_int8(module, weight)
            else:
                module.weight = _quantize_4bit(module, weight, spec)
        if old.bias is not None:
            module.bias = nn.Parameter(old.bias.detach(), requires_grad=False)
        converted += 1
    if not converted:
        raise ConfigError(f"{type(model).__name__} has no linear layer to quantise ({spec.describe()})")
    if spec.kind == "int8":
        model.is_loaded_in_8bit = True
    else:
        model.is_loaded_in_4bit = True
    model.quantization_method = "bitsandbytes"
    return model


def _untied_head_names(model: nn.Module) -> set[str]:
    """The module names (full and last part) of the output head, when it is not tied to the input embeddings."""
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None or (callable(get_in) and getattr(get_in(), "weight", None) is getattr(head, "weight", None)):
        return set()
    names = {name for name, module in model.named_modules() if module is head}
    return names | {name.rsplit(".", 1)[-1] for name in names}


def prepare_for_training(model: nn.Module) -> nn.Module:
    """peft's ``prepare_model_for_kbit_training`` without its checkpointing switch: it freezes the base,
    casts every parameter that is not 4-bit to fp32 (norms, embeddings, the head) and, on real tensors,
    empties the CUDA cache. Checkpointing stays batchfit's choice (``checkpointing=``), applied as
    transformers applies it (NOTE [ Checkpointing a transformers model as it checkpoints itself ]).
    """
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
