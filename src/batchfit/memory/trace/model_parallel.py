"""Tensor, sequence and FSDP2 layouts, applied with PyTorch's own APIs, and one rank of them traced.

A ``ParallelLayout`` (``workload.py``) puts the GPUs on a 2-D ``DeviceMesh``, ``("dp", "tp")``: the
model's tensor-parallel plan (``memory/trace/tp_plan.py``) is applied on the ``tp`` dimension with
``torch.distributed.tensor.parallel.parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``), and FSDP2's ``fully_shard`` shards every numbered block, then the root, on the
``dp`` dimension. ``apply_layout`` does it; the trainer calls the same function on a real mesh
(``train/tensor_parallel.py``), so what is estimated is what runs.

To estimate one rank, the step runs in this process as that rank of a *fake* process group
(``torch.testing._internal.distributed.fake_pg``: any world size, no communication) on fake tensors.
Parameters, gradients and optimizer states are then DTensors whose local shards are what the rank
holds, and every op DTensor runs on them, the collectives' output buffers included, passes through the
tracer (NOTE [ Wrapper tensors ] in ``tracker.py``). Nothing is derived: a rank's memory is traced.

NOTE [ DTensor's shape propagation is not the step's memory ]
To know an op's output layout, DTensor runs the op once more on fake tensors of the *global* shapes
(``ShardingPropagator._propagate_tensor_meta_non_cached``), in the fake mode it finds active. In a
real run that mode is its own and allocates nothing; in a trace it would be the tracer's, which would
count global-shaped tensors no rank ever holds. ``fake_world`` runs that propagation outside the
tracer's modes (in a fresh fake mode, as on a real rank).

NOTE [ Sequence parallelism, from the blocks ]
With sequence parallelism the activations between the planned layers of every block are split along
the sequence (dim 1, batch-first) across the tensor-parallel ranks, as in PyTorch's Llama recipe. It is
derived from the plan and the model's numbered blocks (``layers.3``, ``h.11``), for any model: the
first block's input is split, the last block's output gathered again (embeddings, the final norm and
the head see the whole sequence, so a model that derives positions from its input length still
does); inside a block, each child that holds planned layers gathers the sequence on entry (its
row-wise layers reduce-scatter back to it: ``output_layouts=Shard(1)``), each child whose parameters
are all vectors (a norm) runs on its part of the sequence as ``SequenceParallel``, and a child with no
parameters (dropout) is left alone. A child holding planned layers but no row-wise one, or other
parameters (an attention the plan leaves whole), gathers the sequence and has its output split again.

Limitations:
    Sequence parallelism assumes batch-first activations (sequence on dim 1). Under FSDP2 the trace
    follows the CPU's program order (no CUDA streams): on a GPU, FSDP2's all-gather and
    reduce-scatter buffers live on their own streams and can outlive that order by one unit's
    parameters. A tied weight (an embedding shared with the head) is left out of the plan.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils._python_dispatch import _disable_current_modes

from ...errors import ConfigError
from ...gpu.catalog import GPUS_PER_NODE
from ...workload import ParallelLayout
from .tp_plan import blocks_of_names, check_degree, resolve_plan


# -- applying it -------------------------------------------------------------------------------------
def blocks_of(model: nn.Module, names: Any = None) -> list[str]:
    """Paths of the outermost numbered blocks (``layers.3``) holding parameters (or one of ``names``)."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            holds = any(n == path or n.startswith(path + ".") for n in names) if names is not None else (
                next(child.parameters(), None) is not None
            )  # fmt: skip
            if name.isdigit() and holds:
                found.append(path)
            else:
                visit(path, child)

    visit("", model)
    return found


# NOTE [ The head under loss parallelism ]
# A causal LM's head makes batch x sequence x vocabulary logits, which its loss upcasts to fp32: at 32k
# tokens and a 128k vocabulary that is 17 GB per copy, several copies at once. transformers publishes
# the head as ``colwise_gather_output`` (every rank gathers the whole logits); PyTorch's recipe keeps
# them split over the vocabulary (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``)
# and computes the cross-entropy on the split logits under ``loss_parallel()``, forward and backward
# (``torch/distributed/tensor/parallel/loss.py``). The loss is the same number; each rank holds 1/TP of
# the logits. ``ParallelLayout.loss_parallel=False`` gathers them instead.
def parallel_styles(
    model: nn.Module, plan: Mapping[str, Any], sequence_parallel: bool, loss_parallel: bool = True
) -> dict[str, Any]:
    """PyTorch's styles for ``plan`` (resolved), with sequence parallelism's when asked (NOTE above)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    seq = Shard(1)
    styles: dict[str, Any] = {}
    for name, style in plan.items():
        if style == "colwise":
            styles[name] = ColwiseParallel()
        elif style == "colwise_gather_output" or (style == "loss_parallel" and not loss_parallel):
            styles[name] = ColwiseParallel(output_layouts=Replicate())
        elif style == "loss_parallel":
            styles[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        elif style == "rowwise":
            styles[name] = RowwiseParallel(output_layouts=seq) if sequence_parallel and _in_block(name, plan) else (
                RowwiseParallel()
            )  # fmt: skip
        else:
            styles[name] = style
    if sequence_parallel:
        _add_sequence_styles(model, plan, styles)
    _replicate_the_rest(model, styles)
    return styles


def _replicate_the_rest(model: nn.Module, styles: dict[str, Any]) -> None:
    """Every module owning parameters no style splits gets ``_Replicated`` (NOTE [ Every parameter a
    DTensor ]); one that also holds split modules cannot, and says so."""
    owners = [name for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    split = [n for n, style in styles.items() if not isinstance(style, _SequenceBoundary)]  # styles own params
    ties: dict[int, Any] = {}
    for name in owners:
        if name in split:
            continue
        inside = [n for n in split if name == "" or n.startswith(name + ".")]
        if inside or name in styles:
            owner, planned = name or type(model).__name__, inside[0] if inside else name
            raise ConfigError(
                f"{owner} holds parameters of its own and the planned layer {planned}; tensor parallelism "
                "needs a module's own parameters in a child module the plan can replicate"
            )
        styles[name] = _Replicated(ties)


def _add_sequence_styles(model: nn.Module, plan: Mapping[str, Any], styles: dict[str, Any]) -> None:
    """The sequence-parallel styles of NOTE [ Sequence parallelism, from the blocks ]."""
    from torch.distributed.tensor.parallel import SequenceParallel

    blocks = blocks_of(model, plan)
    if not blocks:
        raise ConfigError(
            "sequence parallelism splits the activations of a model's repeated blocks (a numbered container "
            "like layers.0, layers.1), and this model's plan names none; use tensor parallelism without it"
        )
    if blocks[0] == blocks[-1]:
        styles[blocks[0]] = _SequenceBoundary(enter="split", leave="gather")
    else:
        styles[blocks[0]] = _SequenceBoundary(enter="split")
        styles[blocks[-1]] = _SequenceBoundary(leave="gather")
    for block in blocks:
        for child_name, child in model.get_submodule(block).named_children():
            path = f"{block}.{child_name}"
            planned = [n for n in plan if n == path or n.startswith(path + ".")]
            params = list(child.parameters())
            if planned:
                if path not in plan:
                    rowwise = any(plan[n] == "rowwise" for n in planned)
                    styles[path] = _SequenceBoundary("gather", None if rowwise else "split", local=not rowwise)
            elif params and all(p.dim() == 1 for p in params):  # a norm: token by token
                styles[path] = SequenceParallel(use_local_output=True)
            elif params:  # whole, on the whole sequence (an attention the plan leaves whole)
                styles[path] = _SequenceBoundary("gather", "split")


def _in_block(name: str, plan: Mapping[str, Any]) -> bool:
    return any(name.startswith(block + ".") for block in blocks_of_names(plan))


def apply_layout(
    model: nn.Module, layout: ParallelLayout, mesh: Any, plan: Mapping[str, Any] | None,
    gpus_per_node: int = GPUS_PER_NODE,
) -> nn.Module:  # fmt: skip
    """``model`` split as ``layout`` says on ``mesh`` (``("dp", "tp")``), in place; the same for traces and training.

    Tensor parallelism first (``parallelize_module`` on ``mesh["tp"]``), then FSDP2 on ``mesh["dp"]``:
    one ``fully_shard`` per numbered block, then the root (the order of PyTorch's 2-D recipe).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if layout.tensor_parallel > 1:
        resolved = resolve_plan(model, plan)
        check_degree(model, resolved, layout, gpus_per_node)
        styles = parallel_styles(model, resolved, layout.sequence_parallel, layout.loss_parallel)
        parallelize_module(model, mesh["tp"], styles)
    if layout.fsdp > 1:
        from torch.distributed.fsdp import fully_shard

        for block in blocks_of(model):
            fully_shard(model.get_submodule(block), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def splits_the_loss(model: nn.Module, layout: ParallelLayout, plan: Mapping[str, Any] | None) -> bool:
    """Whether ``layout`` computes ``model``'s loss on vocabulary-split logits (a ``loss_parallel`` head)."""
    if layout.tensor_parallel <= 1 or not layout.loss_parallel:
        return False
    return "loss_parallel" in resolve_plan(model, plan).values()


def loss_context(split: bool) -> contextlib.AbstractContextManager:
    """What a step's forward and backward run in: ``loss_parallel()`` when the loss is split, else nothing."""
    if not split:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def make_mesh(layout: ParallelLayout, device_type: str) -> Any:
    """The 2-D mesh ``("dp", "tp")`` of ``layout`` over the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.fsdp, layout.tensor_parallel), mesh_dim_names=("dp", "tp"))


# -- the sequence-parallel boundaries --------------------------------------------------------------
def _first_tensor(args: tuple, kwargs: dict) -> tuple[str | int, torch.Tensor] | None:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return i, a
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return k, v
    return None


def _replace(args: tuple, kwargs: dict, where: str | int, value: Any) -> tuple[tuple, dict]:
    if isinstance(where, int):
        return (*args[:where], value, *args[where + 1 :]), kwargs
    return args, {**kwargs, where: value}


def _redistribute(x: torch.Tensor, mesh: Any, source: Any, target: Any, local: bool) -> Any:
    from torch.distributed.tensor import DTensor

    d = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [source], run_check=False)
    d = d.redistribute(mesh, [target])
    return d.to_local() if local else d


class _SequenceBoundary(ParallelStyle):
    """A sequence-parallel boundary (NOTE [ Sequence parallelism, from the blocks ]): a module's first
    floating-point input split (``enter="split"``) or gathered (``"gather"``) along the sequence, and its
    output split or gathered again (``leave``). ``local``: the gathered input as a plain tensor, else a
    replicated DTensor (handed to column-wise layers, whose input gradients are then reduce-scattered
    back to the sequence parts)."""

    def __init__(self, enter: str | None = None, leave: str | None = None, local: bool = True) -> None:
        self.enter, self.leave, self.local = enter, leave, local

    def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:  # ParallelStyle's hook
        from torch.distributed.tensor import Replicate, Shard

        seq, whole = Shard(1), Replicate()
        ends = {"split": (whole, seq), "gather": (seq, whole)}
        if self.enter is not None:
            source, target = ends[self.enter]
            local = self.local or self.enter == "split"

            def before(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
                found = _first_tensor(args, kwargs)
                if found is None:
                    return None
                return _replace(args, kwargs, found[0], _redistribute(found[1], mesh, source, target, local))

            module.register_forward_pre_hook(before, with_kwargs=True)
        if self.leave is not None:
            out_source, out_target = ends[self.leave]

            def after(mod: nn.Module, args: Any, out: Any) -> Any:
                if isinstance(out, torch.Tensor):
                    return _redistribute(out, mesh, out_source, out_target, local=True)
                if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                    return (_redistribute(out[0], mesh, out_source, out_target, local=True), *out[1:])
                return out

            module.register_forward_hook(after)
        return module


# NOTE [ Every parameter a DTensor ]
# The plan splits some layers; the others (embeddings, norms, a head it leaves whole) are the same on
# every tensor-parallel rank. They are made replicated DTensors, inputs and outputs converted at their
# boundary, as PyTorch's recipes do for every module they do not split: an optimizer's multi-tensor
# step (``foreach``, torch's default on GPUs) and gradient clipping refuse a mix of DTensors and plain
# tensors. Their bytes are unchanged (a DTensor's local tensor is the whole parameter).
class _Replicated(ParallelStyle):
    """A module the plan leaves whole: its parameters replicated DTensors, its inputs and outputs plain."""

    def __init__(self, ties: dict[int, Any]) -> None:
        self.ties = ties  # id(parameter) -> its replicated parameter, shared by every owner (tied weights)

    def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        old = dict(module.named_parameters(recurse=False))
        for key, p in old.items():
            if id(p) in self.ties:
                module.register_parameter(key, self.ties[id(p)])

        def to_dtensors(mod: nn.Module, inputs: Any, mesh: Any) -> Any:
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                for x in inputs
            )  # fmt: skip

        def to_local(mod: nn.Module, out: Any, mesh: Any) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        distribute_module(module, mesh, input_fn=to_dtensors, output_fn=to_local)
        for key, p in old.items():
            self.ties.setdefault(id(p), module.get_parameter(key))
        return module


# -- one rank, traced --------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(layout: ParallelLayout, rank: int = 0) -> Iterator[Any]:
    """This process as ``rank`` of a fake process group of ``layout.world_size`` ranks; yields its mesh.

    Raises:
        ConfigError: a process group already exists (inside torchrun): a rank cannot be traced there.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("this torch has no torch.distributed; tensor parallelism cannot be traced with it")
    if dist.is_initialized():
        raise ConfigError(
            "a parallel layout is traced as one rank of a fake process group, which cannot be made inside a "
            "running process group (torchrun); plan before launching, or pass the micro-batch size"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        with _untracked_shape_propagation(), warnings.catch_warnings():
            # FSDP2's caution about in-place ops on a unit's returned view addresses training code
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
            yield make_mesh(layout, "cpu")
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _untracked_shape_propagation() -> Iterator[None]:
    """DTensor's global-shape propagation outside the tracer (NOTE [ DTensor's shape propagation ... ])."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def apply_layout_traced(model: nn.Module, layout: ParallelLayout, mesh: Any, plan: Mapping[str, Any] | None) -> None:
    """``apply_layout`` on a fake model: outside the tracing modes, as a real rank builds its layout once
    before training (the mesh's bookkeeping is small real tensors; the parameters stay fake)."""
    with _disable_current_modes():
        apply_layout(model, layout, mesh, plan)
