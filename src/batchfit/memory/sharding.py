"""Fully sharded data parallelism (FSDP) seen from one GPU's memory.

FSDP (``torch.distributed.fsdp.fully_shard``) keeps ``1/world_size`` of every parameter, gradient and
optimizer state on each rank, and all-gathers one unit's (one block's) full parameters just before it
runs, in forward and again in backward, freeing them after; with the default prefetching, the next
unit's gather overlaps the current one's compute. Activations and the batch are per rank, as in DDP.

We derive a rank's trace from the single-GPU trace: parameter, gradient and optimizer-state storages
shrink to their shard (rounded up), and a buffer of two units' full parameters (current + prefetched)
is held for the whole step. Units are the blocks of a numbered container (``h.3``, ``layers.17``),
which is how FSDP is usually applied (one ``fully_shard`` per transformer block, then the root).

Limitations:
    An approximation: the gather buffers really come and go per unit, reduce-scatter buffers of
    gradients are not modelled, and the root unit's own parameters (embeddings) are assumed sharded.
"""

from __future__ import annotations

from collections import defaultdict

from .categories import Category
from .trace import MemoryTrace

_SHARDED = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATES)


def unit_of(module_path: str) -> str:
    """The FSDP unit a module belongs to: its path up to the first numbered block, or the root ``""``.

    The root unit holds every parameter outside the numbered blocks (embeddings, final norm, an untied
    head), as ``fully_shard`` on the root gathers them together (``batchfit.train.fsdp``).
    """
    parts = module_path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def largest_unit_bytes(trace: MemoryTrace) -> int:
    """Full parameter bytes of the largest FSDP unit (what one all-gather materialises)."""
    units: dict[str, int] = defaultdict(int)
    for sid, role in trace.role.items():
        if role is Category.PARAMETERS:
            units[unit_of(trace.module.get(sid, ""))] += trace.nbytes[sid]
    return max(units.values(), default=0)


def shard_trace(trace: MemoryTrace, world_size: int) -> MemoryTrace:
    """One rank's trace under FSDP over ``world_size`` GPUs (see the module docstring)."""
    if world_size <= 1:
        return trace
    nbytes = dict(trace.nbytes)
    for sid, role in trace.role.items():
        if role in _SHARDED:
            nbytes[sid] = -(-nbytes[sid] // world_size)
    gather = (1 << 41) + 1  # an id no traced storage uses
    nbytes[gather] = 2 * largest_unit_bytes(trace)
    role = dict(trace.role)
    role[gather] = Category.TEMPORARIES
    module = dict(trace.module)
    module[gather] = "(FSDP all-gather buffers)"
    op = dict(trace.op)
    op[gather] = "FSDP all-gather"
    phases = [(index + 1, phase, step) for index, phase, step in trace.phases]
    return MemoryTrace(
        events=[gather, *trace.events], nbytes=nbytes, role=role, module=module, phases=phases, op=op,
        notes=trace.notes, flops=trace.flops,
    )  # fmt: skip
