"""Fully sharded data parallelism (FSDP) seen from one GPU's memory.

FSDP2 (``torch.distributed.fsdp.fully_shard``) splits every parameter along dim 0 into ``world_size``
chunks (``torch.chunk``) and keeps one on each rank, padded to the largest chunk: rank 0 holds
``ceil(rows / world_size)`` rows of each parameter, the most of any rank. Gradients are
reduce-scattered into one flat storage per unit with the same padded shards, and an optimizer state
made ``zeros_like`` a parameter has its shard's shape. Buffers stay whole on every rank, and so do
scalar optimizer states (Adam's ``step``). Before a unit runs, in forward and again in backward, FSDP
all-gathers its full parameters and frees them after; with the default prefetching, the next unit's
gather overlaps the current one's compute. Activations and the batch are per rank, as in DDP.

We derive rank 0's trace from the single-GPU trace: each storage the trace knows FSDP shards by rows
(``MemoryTrace.rows``) shrinks to ``ceil(rows / world_size)`` rows, which is exact for parameters,
gradients and optimizer states (``tests/test_sharding.py`` compares it with a run of ``fully_shard``
on two processes); everything else stays whole. A buffer of two units' full parameters (current +
prefetched) is held for the whole step. Units are the blocks of a numbered container (``h.3``,
``layers.17``), which is how FSDP is usually applied (one ``fully_shard`` per transformer block,
then the root).

Limitations:
    The gather buffers really come and go per unit, and reduce-scatter buffers of gradients are not
    modelled: those two are approximations.
"""

from __future__ import annotations

from collections import defaultdict

from ..categories import Category
from ..trace.fake_step import MemoryTrace

_SHARDED = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATES, Category.TEMPORARIES)
"""Roles of the storages with rows (``MemoryTrace.rows``) that shrink to a shard: temporaries have rows only
when the optimizer step made them in a parameter's shape (NOTE below)."""

# NOTE [ The optimizer's temporaries under FSDP ]
# FSDP2's parameters are DTensors of the rank's rows, and the optimizer steps those: every tensor its step
# makes from a parameter, gradient or state is a shard too. A foreach optimizer (torch's default on CUDA, and on
# DTensors) makes its temporaries for the whole parameter list at once: AdamW's ``_foreach_sqrt`` of the second
# moments and the update it divides are each a full copy of the trainable parameters in fp32, 26 GB for a 7B
# model, of which one rank of eight holds 3.3 GB. The tracer records the rows of what the optimizer step makes
# in a parameter's shape, and the shard keeps ceil(rows / world_size) of them, as it does for the states.


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
        if role is Category.PARAMETERS and sid in trace.rows:  # buffers are not gathered
            units[unit_of(trace.module.get(sid, ""))] += trace.nbytes[sid]
    return max(units.values(), default=0)


def shard_bytes(nbytes: int, rows: int, world_size: int) -> int:
    """Bytes of rank 0's shard of a storage of ``rows`` rows: ``ceil(rows / world_size)`` of them."""
    return -(-rows // world_size) * (nbytes // rows) if rows else nbytes


def shard_trace(trace: MemoryTrace, world_size: int) -> MemoryTrace:
    """One rank's trace under FSDP over ``world_size`` GPUs (see the module docstring)."""
    if world_size <= 1:
        return trace
    nbytes = dict(trace.nbytes)
    for sid, rows in trace.rows.items():
        if trace.role.get(sid) in _SHARDED:
            nbytes[sid] = shard_bytes(nbytes[sid], rows, world_size)
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
        notes=trace.notes, flops=trace.flops, rows=trace.rows, paged=trace.paged, reductions=trace.reductions,
    )  # fmt: skip
