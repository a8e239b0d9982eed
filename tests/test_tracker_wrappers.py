"""The tracer's view of what parallel layouts do to storages: resizes, wrapper tensors, collectives.

FSDP2 frees a unit's unsharded parameters with ``UntypedStorage.resize_(0)`` and brings them back with
``resize_(n)``; DTensor holds its bytes in a local tensor; ``wait_tensor`` returns its argument; gloo
stages copies inside collectives. Each is checked on its own here, on a step small enough to reason
about by hand.
"""

from __future__ import annotations

import torch
from torch import nn

from batchfit.memory.kernels.gloo import staging_bytes
from batchfit.memory.trace.construct import fake_session
from batchfit.memory.trace.tracer import Tracer
from batchfit.memory.trace.tracker import inner_tensors, local_tensor


class Resizing(nn.Module):
    """Frees a buffer's storage in forward and gets it back, as FSDP2 does with unsharded parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.scratch = torch.empty(64)  # 256 B, a plain attribute like FSDP's unsharded parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        storage = self.scratch.untyped_storage()
        storage.resize_(0)
        storage.resize_(256)
        storage.resize_(0)
        return x * self.w


def test_a_storage_resized_to_nothing_is_freed_and_resized_back_is_allocated() -> None:
    with fake_session():
        model = Resizing()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tracer = Tracer(model, optimizer)
        with tracer:
            tracer.mark("forward", 0)
            model(torch.ones(4)).sum().backward()
    trace = tracer.trace
    signed = [trace.nbytes[e] if e >= 0 else -trace.nbytes[~e] for e in trace.events]
    sizes = [n for n in signed if abs(n) == 256]
    assert sizes == [256, -256, 256, -256]  # the scratch at setup, freed, back, freed


def test_a_dtensor_is_counted_by_its_local_shard() -> None:
    from torch.distributed.tensor import DTensor, Shard

    from batchfit.memory.trace.model_parallel import fake_world
    from batchfit.memory.trace.tracker import StorageTracker
    from batchfit.workload import ParallelLayout

    born: dict[int, int] = {}
    with fake_world(ParallelLayout(tensor_parallel=2)) as mesh, fake_session():
        local = torch.ones(4, 3)  # this rank's half of an (8, 3) tensor: 48 B
        split = DTensor.from_local(local, mesh["tp"], [Shard(0)], run_check=False)
        tracker = StorageTracker(born.__setitem__, lambda sid: None)
        sid = tracker.register(split)
        assert tuple(split.shape) == (8, 3) and local_tensor(split) is split._local_tensor
        assert inner_tensors(split) == [split._local_tensor] and inner_tensors(local) is None
        assert tracker.storage_id(split) == tracker.storage_id(split._local_tensor) == sid
    assert list(born.values()) == [48]


def test_gloo_stages_an_output_sized_buffer_in_an_all_gather_and_an_input_clone_in_a_reduce_scatter() -> None:
    import torch.distributed  # registers the collective ops

    x = torch.empty(10, 3)  # 120 B
    functional = torch.ops._c10d_functional
    assert staging_bytes(functional.all_gather_into_tensor.default, (x, 4, "g")) == 480
    assert staging_bytes(functional.reduce_scatter_tensor.default, (x, "sum", 4, "g")) == 120
    assert staging_bytes(functional.all_reduce.default, (x, "sum", "g")) == 0
    assert staging_bytes(torch.ops.c10d._allgather_base_.default, (torch.empty(40, 3), x)) == 480
    assert staging_bytes(torch.ops.c10d._reduce_scatter_base_.default, (torch.empty(5, 3), x)) == 120
    assert staging_bytes(torch.ops.aten.mm.default, (x, x)) == 0
