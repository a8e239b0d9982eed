"""What gloo, the CPU's collective backend, allocates inside a collective (for CPU estimates of layouts).

A collective traced on the fake process group allocates its output and nothing else; gloo, which runs
every collective of a CPU rank under torchrun, also makes flat staging copies through the CPU allocator
while the collective runs (``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``):

- an all-gather (``_allgather_base``, ``allgather_into_tensor_coalesced``) flattens its input
  (``flattenDenseTensors``) and gathers into a flat output (``at::empty`` of the output's size), then
  copies that into the output tensors: measured on torch 2.13, the input copy is freed before the flat
  output is made, so the most it holds at once is one output-sized buffer;
- a reduce-scatter (``reduce_scatter_tensor_coalesced``) all-reduces a clone of its input and copies
  this rank's chunk out when waited for: one input-sized buffer, freed with the collective's work;
- an all-reduce works in place on its tensor: nothing.

Each is added as transient scratch of the collective (gone when it returns): a rank whose collectives
are waited for when issued, as DTensor and FSDP2 do on the CPU. NCCL (GPU targets) stages nothing in
PyTorch's allocator, so none of this applies to a GPU estimate.
"""

from __future__ import annotations

from typing import Any

import torch

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


def _bytes(tensors: Any) -> int:
    from torch.utils._pytree import tree_flatten

    return sum(t.numel() * t.element_size() for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor))


def staging_bytes(func: Any, args: tuple) -> int:
    """Bytes gloo stages at once inside the collective ``func`` (see the module docstring)."""
    namespace, name = getattr(func, "namespace", ""), getattr(func, "_opname", "")
    if namespace == "_c10d_functional":
        if name.startswith("all_gather_into_tensor"):
            return _bytes(args[0]) * int(args[1])  # (inputs, group_size, group_name)
        if name.startswith("reduce_scatter_tensor"):
            return _bytes(args[0])
    elif namespace == "c10d":
        if name in ("_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_"):
            return _bytes(args[0])  # (outputs, inputs, ...): written into the outputs
        if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_"):
            return _bytes(args[1])
    return 0
