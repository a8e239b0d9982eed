"""Workload: what one training step runs (model, batch maker, loss, optimizer), as plain values; and
Setup: how the step is run (precision, checkpointing, layout, accumulation, allocator options).

Every stage of batchfit (trace, estimate, fit, plan, sweep, train) takes a Workload, so a user's own
model and a built-in preset go through exactly the same code; ``estimate``, ``fit`` and ``plan`` take
one Setup for everything else a step's memory depends on besides the batch size and the GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .activation_checkpointing import Checkpointing, checked_checkpointing, checkpoint_classes
from .batching import Batch, check_batch_size
from .errors import ConfigError
from .precision import PrecisionPolicy, parse_precision, policy_for

ModelFactory = Callable[[], nn.Module]
BatchFn = Callable[[int], Batch]
LossFn = Callable[[nn.Module, Batch], Any]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class ParallelLayout:
    """How one rank's step is cut out of the model beyond data parallelism: tensor, sequence and FSDP.

    The GPUs form a 2-D mesh, ``fsdp`` x ``tensor_parallel`` (PyTorch's large-model recipes): the
    tensor-parallel ranks of one group (inside a node) split every layer the model's plan names and run
    the same micro-batch; FSDP2 shards parameters, gradients and optimizer states across the groups,
    which run different micro-batches. ``memory/trace/model_parallel.py`` traces one rank of it,
    ``train/tensor_parallel.py`` trains it.

    Example:
        >>> ParallelLayout(tensor_parallel=4, sequence_parallel=True, fsdp=16).describe()
        'TP 4 + SP x FSDP 16'
    """

    tensor_parallel: int = 1
    """GPUs that split each planned layer (colwise / rowwise, ``parallelize_module``): a node's worth at most."""
    sequence_parallel: bool = False
    """Between the planned layers, the blocks' activations (residual stream, norms) are split along the
    sequence across the tensor-parallel GPUs instead of repeated on each."""
    fsdp: int = 1
    """Tensor-parallel groups that FSDP2 shards parameters, gradients and optimizer states across."""
    loss_parallel: bool = True
    """A head planned ``loss_parallel`` (a causal LM's ``lm_head``) keeps its logits split over the
    vocabulary and the loss is computed under ``torch.distributed.tensor.parallel.loss_parallel``
    (PyTorch's recipe); False gathers the whole logits on every rank first."""

    @property
    def world_size(self) -> int:
        """GPUs the layout spans."""
        return self.tensor_parallel * self.fsdp

    def describe(self) -> str:
        """``TP 4 + SP x FSDP 16``, ``TP 2``, ``FSDP 8``."""
        parts = []
        if self.tensor_parallel > 1:
            parts.append(f"TP {self.tensor_parallel}" + (" + SP" if self.sequence_parallel else ""))
        if self.fsdp > 1:
            parts.append(f"FSDP {self.fsdp}")
        return " x ".join(parts) or "one GPU"


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The default optimizer: AdamW with torch's defaults (two fp32 states per trainable parameter)."""
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass(frozen=True)
class Workload:
    """A training step to estimate, fit, plan or run.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from batchfit import Workload
        >>> wl = Workload(
        ...     model=lambda: nn.Linear(8, 2),
        ...     batch=lambda b: (torch.randn(b, 8), torch.randint(0, 2, (b,))),
        ...     loss=lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
        ... )
        >>> wl.name
        'custom'
    """

    model: nn.Module | ModelFactory
    """The model, or a zero-argument function that builds it (preferred: it can be built on fake tensors)."""
    batch: BatchFn
    """``batch_size -> batch``; a batch is a tensor, tuple/list or dict sharing the leading dimension."""
    loss: LossFn
    """``(model, batch) -> loss``: a scalar mean over items, or ``(loss_sum, n_items)`` for token losses."""
    optimizer: OptimizerFactory = adamw
    """``params -> Optimizer``, called with the trainable parameters only."""
    name: str = "custom"
    """Shown in tables and reports."""
    tokens_per_item: int | None = None
    """Tokens in one item, for tokens/s in sweeps of language models (None: not a token model)."""
    checkpoint_blocks: tuple[type[nn.Module], ...] = field(default=())
    """Module classes that ``checkpointing="blocks"`` wraps in activation checkpointing."""
    items: Callable[[torch.Tensor, int], Batch] | None = None
    """``(item_ids, seed) -> batch`` of deterministic synthetic items: item ``i`` depends only on
    ``(item_ids[i], seed)``, so the same items reach the model whatever the split or world size.
    Presets have it; a user workload only needs it for ``batchfit train`` on synthetic data."""
    set_grads_to_none: bool = True
    """Whether ``zero_grad`` frees gradients (torch >= 2.0 default) or zeroes them in place (older
    loops, e.g. transformers' Trainer before 2023), which keeps them allocated through the forward."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step of the loop whose memory is estimated. Above 1, gradients are
    alive (and accumulated into) through the forward and backward of micro-batches 2..k, which a
    plain step never has: the trace runs two micro-batches per step (the later ones repeat the
    second's tensors exactly; the caching allocator's history of many micro-batches can differ by a
    few segments). ``estimate``/``fit`` take it as ``accumulation_steps=``; ``plan`` sets it when the
    split needs accumulation."""
    config: dict[str, Any] = field(default_factory=dict)
    """The knobs a preset was built with (sizes, seq_len, optimizer), for reports and JSON."""
    at_seq_len: Callable[[int], Workload] | None = None
    """``n -> Workload``: this workload with sequences of ``n`` tokens per item, which is how
    ``fit(..., maximize="seq_len")`` traces it at other lengths. Presets with a ``seq_len``, hub models
    with a sequence and workload functions taking a ``seq_len`` argument have it; None: the workload has
    no sequence to vary. A module-level function or ``functools.partial`` keeps the workload picklable.
    Not part of the trace cache's key (a trace depends on the workload, not on how to rebuild it)."""
    max_seq_len: int | None = None
    """The longest sequence ``at_seq_len`` accepts (the model's positions); None: no known limit."""
    tp_plan: Mapping[str, Any] | None = None
    """Tensor parallelism's plan: module paths (``*`` matches one name, as in transformers'
    ``base_model_tp_plan``) to ``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"`` or a
    ``torch.distributed.tensor.parallel.ParallelStyle``. None: the model's own published plan (a
    transformers model's ``config.base_model_tp_plan`` and its class's ``_tp_plan``), if any."""
    parallel: ParallelLayout | None = None
    """The layout of the step whose memory is estimated (None: one GPU's whole step, or data parallelism).
    ``plan`` sets it for its tensor-parallel configurations; one rank's step is then traced."""

    def build_model(self) -> nn.Module:
        """The model: the instance given, or a new one from the factory."""
        model = self.model if isinstance(self.model, nn.Module) else self.model()
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"the workload's model factory returned {type(model).__name__}, not an nn.Module"
            )
        return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that get gradients and optimizer state (frozen ones, as in LoRA, get neither)."""
    return [p for p in model.parameters() if p.requires_grad]


def _held_by(obj: Any, depth: int) -> Iterator[torch.Tensor]:
    """Tensors in ``obj``'s attributes, following plain objects (not modules) ``depth`` levels down."""
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif depth > 0 and not isinstance(value, (nn.Module, type)) and hasattr(value, "__dict__"):
            yield from _held_by(value, depth - 1)


def parameter_attachments(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a parameter carries in its attributes (a quantised weight's scales and codes: bitsandbytes'
    ``weight.quant_state`` and its nested state, ``weight.SCB``), two plain objects deep."""
    return list(_held_by(p, depth=2)) if vars(p) else []  # a plain parameter has no attributes: nothing to walk


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model holds before a step: parameters, buffers, and plain tensor attributes.

    A module may keep tensors that are neither parameters nor buffers (``self.ids = torch.arange(n)``,
    or a dict of them, as peft's prompt tuning does); they occupy memory from construction on, like
    the weights. Attributes are looked at one container deep (a tensor, or a dict/list/tuple of them).
    A parameter may carry tensors of its own too: a quantised weight's scales and codes hang off it
    (bitsandbytes' ``weight.quant_state``, and its nested state; ``weight.SCB``).
    """
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(t), t)
    for p in model.parameters():
        for t in parameter_attachments(p):
            seen.setdefault(id(t), t)
    for module in model.modules():
        for name, value in vars(module).items():
            if not name.startswith("_"):
                for v in _held(value):
                    if not isinstance(v, nn.Parameter):
                        seen.setdefault(id(v), v)
    return list(seen.values())


def _held(value: Any) -> list[Any]:
    """``value``'s tensors, one container deep (a tensor, or a dict/list/tuple of them)."""
    if isinstance(value, dict):
        value = list(value.values())
    return [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor an optimizer holds before its first step: memory from its construction on.

    Adagrad makes its sums in its constructor (``optimizer.state``), a tensor learning rate lives in
    the parameter groups, and bitsandbytes' 8-bit optimizers keep their quantisation maps as an
    attribute (``name2qmap``, two 256-entry fp32 tables made by ``fill_qmap`` in ``__init__``).
    Attributes are looked at one container deep, as in ``model_tensors``; the parameters are not
    the optimizer's.
    """
    from torch.utils._pytree import tree_flatten

    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    held = [*optimizer.state.values(), *({k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups)]
    found = [t for t in tree_flatten(held)[0] if isinstance(t, torch.Tensor)]
    for name, value in vars(optimizer).items():
        if not name.startswith("_") and name not in ("state", "param_groups"):
            found.extend(_held(value))
    seen: dict[int, torch.Tensor] = {}
    for t in found:
        if id(t) not in params:
            seen.setdefault(id(t), t)
    return list(seen.values())


AUTO = "auto"
"""A ``Setup`` field that a search chooses: ``plan`` picks the precision and the checkpointing left so."""


@dataclass(frozen=True)
class Setup:
    """How one training step is run: everything its memory depends on besides the workload, the batch
    size and the GPU.

    One value, checked once, travels from the public functions to the cache keys, instead of five loose
    keyword arguments through every layer. ``estimate``, ``fit`` and ``plan`` take it as ``setup=`` and
    keep their keyword arguments as sugar: each one given replaces that field (``Setup.of``).

    Example:
        >>> s = Setup(precision="bf16", checkpointing="blocks", accumulation_steps=4)
        >>> s.precision, s.with_fields(precision="fp16").precision
        ('bf16', 'fp16')
    """

    precision: str = "fp32"
    """``fp32``, ``bf16``, ``fp16`` (autocast), ``bf16-true`` or ``bf16-true-autocast``; ``"auto"`` in ``plan``:
    the cheapest that fits."""
    checkpointing: Checkpointing = None
    """None (none), ``"blocks"`` (the workload's blocks; True means the same), ``"reentrant"`` (the same
    blocks with ``use_reentrant=True``), ``"selective"`` (every block keeps its matmul outputs), a number k
    (the first k blocks) or block indices, ``"K+selective"`` (the first K whole, the rest selectively) or
    module classes; ``"auto"`` in ``fit`` and ``plan``: the least recompute that fits (``batchfit.
    activation_checkpointing``)."""
    accumulation_steps: int | None = None
    """Micro-batches per optimizer step (None: the workload's own, 1 by default). Above 1 the gradients of
    the earlier micro-batches are alive through the later ones' forward and backward."""
    parallel: ParallelLayout | None = None
    """Tensor / sequence parallelism and FSDP2: the step is one rank's (None: the workload's own layout)."""
    expandable_segments: bool = False
    """Model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (no fragmentation between segments)."""

    def __post_init__(self) -> None:
        if self.precision != AUTO:
            object.__setattr__(self, "precision", parse_precision(self.precision).value)
        object.__setattr__(self, "checkpointing", checked_checkpointing(self.checkpointing, auto=True))
        if self.accumulation_steps is not None:
            check_batch_size(self.accumulation_steps, "accumulation_steps")
        if self.parallel is not None:
            if not isinstance(self.parallel, ParallelLayout):
                raise ConfigError(f"parallel must be a batchfit.ParallelLayout, got {type(self.parallel).__name__}")
            check_batch_size(self.parallel.tensor_parallel, "tensor_parallel")
            check_batch_size(self.parallel.fsdp, "fsdp")
        if not isinstance(self.expandable_segments, bool):
            raise ConfigError(f"expandable_segments must be True or False, got {self.expandable_segments!r}")

    @classmethod
    def of(cls, setup: Setup | None = None, /, **fields: Any) -> Setup:
        """``setup`` (None: ``Setup()``) with every field given here and not None replaced: the keyword
        arguments of ``estimate``, ``fit`` and ``plan`` as sugar for their ``setup``."""
        if setup is None:
            setup = cls()
        elif not isinstance(setup, Setup):
            raise ConfigError(f"setup must be a batchfit.Setup, got {type(setup).__name__}")
        return setup.with_fields(**fields)

    def with_fields(self, **fields: Any) -> Setup:
        """This setup with the fields given (not None) replaced."""
        changes = {name: value for name, value in fields.items() if value is not None}
        return dataclasses.replace(self, **changes) if changes else self

    def concrete(self, what: str) -> Setup:
        """This setup, checked to choose nothing: ``what`` (``"an estimate"``) runs one step as written.

        Raises:
            ConfigError: a field is ``"auto"``.
        """
        for name in ("precision", "checkpointing"):
            if getattr(self, name) == AUTO:
                example = "bf16" if name == "precision" else "blocks"
                choosers = "batchfit.plan" if name == "precision" else "batchfit.fit or batchfit.plan"
                raise ConfigError(f"{what} runs one step as written and does not choose {name}: give it "
                                  f"(e.g. {name}={example}), or use {choosers}")  # fmt: skip
        return self

    def policy(self, device: Any) -> PrecisionPolicy:
        """The precision policy on ``device`` (a ``batchfit.Device``).

        Raises:
            ConfigError: bf16 on a GPU without it (V100, T4).
        """
        return policy_for(self.precision, bf16_supported=device.bf16 or device.exact, device_name=device.name)

    def classes(self, workload: Workload) -> tuple[type, ...]:
        """The module classes checkpointed in ``workload`` (``batchfit.activation_checkpointing``).

        Raises:
            ConfigError: blocks asked of a workload that names none.
        """
        return checkpoint_classes(self.checkpointing, workload.checkpoint_blocks)

    def key(self, workload: Workload) -> tuple[Any, ...]:
        """What an answer about ``workload`` run so depends on, resolved against it (the classes the
        checkpointing names, its accumulation and layout): for cache keys, where two spellings of one
        setup must meet."""
        workload = self.workload(workload)
        return (self.precision, self.classes(workload), workload.accumulation_steps, workload.parallel,
                self.expandable_segments)  # fmt: skip

    def workload(self, workload: Workload) -> Workload:
        """``workload`` as this setup runs it: its accumulation steps and layout set where given."""
        changes: dict[str, Any] = {}
        if self.accumulation_steps is not None and self.accumulation_steps != workload.accumulation_steps:
            changes["accumulation_steps"] = self.accumulation_steps
        if self.parallel is not None:
            changes["parallel"] = self.parallel if self.parallel.world_size > 1 else None
        return dataclasses.replace(workload, **changes) if changes else workload

