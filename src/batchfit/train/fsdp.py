"""FSDP for the Trainer: shard a model across the ranks, keep its optimizer, save and load it whole.

``torch.distributed.fsdp.fully_shard`` (FSDP2) replaces every parameter by a new ``nn.Parameter``
holding a ``DTensor``: this rank's 1/W slice along dim 0. Three things follow that a loop must handle:

- The optimizer was built on the old parameters. Its parameter groups are re-pointed at the new ones
  (same order, same hyper-parameters; schedulers keep working because the optimizer object stays);
  state it already holds (a checkpoint loaded before sharding) is taken whole and sliced again.
- Each rank slices *its own* copy of the full parameters, so the copies must be equal first: rank 0's
  parameters and buffers are broadcast before sharding (DDP does the same at construction).
- A checkpoint must not depend on the world size it was written on. States are gathered whole
  (``torch.distributed.checkpoint.state_dict`` with ``full_state_dict``) and the optimizer's is stored
  under parameter *indices*, exactly as ``optimizer.state_dict()`` of an unsharded model stores it: a
  checkpoint written under FSDP on 2 ranks resumes on 1 process without FSDP, and the other way round.

Units: one ``fully_shard`` per block of a numbered container (``layers.3``, ``h.11``; the outermost
numbered level only), then the root for what remains (embeddings, heads). That is the grouping the
estimator's FSDP model assumes (``batchfit.memory.synthesis.sharding.unit_of``), so the plan's memory and the
run's agree. Gradients are reduce-scattered after every micro-batch (FSDP2 keeps them sharded, which
is where its memory saving comes from; skipping that sync would keep a full unsharded gradient per
rank through the window).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError


def is_sharded(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` (its root is an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(model, FSDPModule)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The outermost numbered blocks holding parameters, in module order (each one FSDP unit)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for name, child in module.named_children():
            if name.isdigit() and next(child.parameters(), None) is not None:
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def shard_model(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, device: torch.device | None = None
) -> nn.Module:
    """``fully_shard`` each unit and the root, after equalising the ranks' copies; re-point ``optimizer``.

    ``device`` (by default the parameters') decides the mesh: without one, ``fully_shard`` would
    move CPU parameters to a GPU whenever the machine has one, away from the batches.

    Returns the same module object (``fully_shard`` works in place). An optimizer that already holds
    state (a checkpoint was loaded) keeps it: its whole state is taken before and sliced after.

    Raises:
        ConfigError: no process group, or an optimizer whose parameters are not the model's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("FSDP sharding needs a process group: launch with torchrun --nproc_per_node=N")
    if is_sharded(model):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    name_of = parameter_names(model, optimizer, "so that FSDP can shard them")
    whole_state = None
    if optimizer is not None and any(optimizer.state.values()):
        whole_state = optimizer.state_dict()
        optimizer.state.clear()
    equalise(model)  # FSDP slices each rank's own copy: make them rank 0's
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if optimizer is not None:
        repoint(optimizer, model, name_of)
        if whole_state is not None:
            load_full_states(model, optimizer, None, whole_state)
    return model


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer | None, why: str) -> dict[int, str]:
    """``id(parameter) -> name`` of ``model``'s parameters, the optimizer's all among them.

    Raises:
        ConfigError: an optimizer parameter that is not the model's (``why`` ends the line).
    """
    name_of = {id(p): name for name, p in model.named_parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in name_of] if optimizer else []
    if stray:
        raise ConfigError(
            f"{len(stray)} of the optimizer's parameters are not the model's; build the optimizer from "
            f"model.parameters() {why}"
        )
    return name_of


def equalise(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (each rank splits its own copy: make them equal)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


def repoint(optimizer: torch.optim.Optimizer, model: nn.Module, name_of: dict[int, str]) -> None:
    """The optimizer's groups on ``model``'s new parameters, found by the names the old ones had."""
    new = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [new[name_of[id(p)]] for p in group["params"]]


def _names_in_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters as model names, in ``optimizer.state_dict()``'s index order."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    """``(model state, optimizer state)`` of a sharded model, gathered whole on rank 0 (a collective).

    Every rank must call it; ranks other than 0 get empty dicts. The optimizer state is in the
    index-keyed form of ``optimizer.state_dict()`` (see the module docstring).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    if optimizer is None:
        return model_state, None
    by_name = get_optimizer_state_dict(model, optimizer, options=options)
    if not by_name:
        return model_state, {}
    index = {name: i for i, name in enumerate(_names_in_order(model, optimizer))}
    groups = [{**g, "params": [index[name] for name in g["params"]]} for g in by_name["param_groups"]]
    return model_state, {"state": {index[k]: v for k, v in by_name["state"].items()}, "param_groups": groups}


def load_full_states(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict[str, Any] | None, optimizer_state: Any
) -> None:
    """Load whole (unsharded) states, as ``full_states`` returns them, into a sharded model (a collective).

    Every rank passes the whole states (each reads the checkpoint) and keeps its own slices. None (or
    an empty optimizer state) leaves that part as it is.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    if model_state is not None:
        set_model_state_dict(model, model_state, options=options)
    if optimizer is None or not optimizer_state:
        return
    names = _names_in_order(model, optimizer)
    by_name = {
        "state": {names[i]: v for i, v in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
