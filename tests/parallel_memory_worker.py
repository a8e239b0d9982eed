"""One rank of ``tests/test_parallel_memory.py``: what a gloo rank of a tensor-parallel layout really holds.

Run under ``torchrun --nproc_per_node=N``. For each layout named on the command line (``tp2``,
``tp2-sp``, ``tp2-fsdp2``, ``tp2-sp-fsdp2``; their GPU counts must be N), every rank loads the tiny Llama
of the config directory given, splits it with ``batchfit.memory.trace.model_parallel.apply_layout`` (the function the
trainer uses) on a real ``("dp", "tp")`` mesh, and runs the two steps the tracer runs
(``run_workload_steps``) under the CPU profiler, its collectives settled (NOTE below). Each rank records
the allocator's peak and its local parameter, gradient and optimizer-state bytes; rank 0 writes every
rank's to the JSON file named by the first argument.

NOTE [ Measuring a gloo rank ]
gloo runs a collective on a worker thread, and its work object holds the collective's tensors until
that thread lets go of it, shortly after the caller's ``wait`` returns. When the caller drops its own
reference first, the tensor is freed on gloo's thread, where the profiler records nothing: the
measured bytes then keep a buffer that was freed (runs of the same step differed by one or two such
buffers). Here every collective is waited for at once and given a moment for gloo's thread to let go
before the step goes on (``settle_collectives``), so each buffer is freed by the step itself, where it
drops it, as the estimate assumes; the step's own order of allocations and frees is unchanged. The ranks
meet by an all-reduce of a tensor made before the steps, not by ``dist.barrier``: torch 2.11's gloo barrier
allocates a one-byte tensor of its own (2.13's does not), freed where the profiler does not see it, which the
measured peak then kept: one byte over the estimate on every tensor-parallel layout.

The tests start its ranks with ``tests/launch.py``: forked from a warm server, as torchrun would start them.

Arguments: OUT CONFIG_DIR SEQ_LEN BATCH_SIZE LAYOUT...
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from batchfit.memory.measure import cpu_memory_profile, optimizer_tensors, profile_peak
from batchfit.memory.steps import run_workload_steps
from batchfit.memory.trace.model_parallel import apply_layout, make_mesh
from batchfit.memory.trace.tracker import local_tensor
from batchfit.sources import load
from batchfit.train.distributed import init_distributed, shutdown
from batchfit.workload import ParallelLayout, model_tensors, trainable_parameters

LAYOUTS = {
    "tp2": ParallelLayout(tensor_parallel=2),
    "tp2-sp": ParallelLayout(tensor_parallel=2, sequence_parallel=True),
    "tp2-fsdp2": ParallelLayout(tensor_parallel=2, fsdp=2),
    "tp2-sp-fsdp2": ParallelLayout(tensor_parallel=2, sequence_parallel=True, fsdp=2),
}
PAUSE_S = 0.02
"""How long gloo's worker thread is given to drop a finished collective (NOTE above)."""


def settle_collectives() -> None:
    """Wait for every collective as soon as it is issued, then pause (NOTE [ Measuring a gloo rank ])."""
    import torch.distributed._functional_collectives as funcol

    wait, all_reduce = funcol.wait_tensor, dist.all_reduce
    side = dist.new_group(backend="gloo")
    met = torch.zeros(1)  # made here, before any step is measured

    def wait_tensor(t: torch.Tensor) -> torch.Tensor:
        all_reduce(met, group=side)  # every rank has issued the collective: it can finish
        time.sleep(PAUSE_S)  # ... and gloo's thread lets go of it before the wait drops the last reference
        out = wait(t)
        time.sleep(PAUSE_S)
        return out

    funcol.wait_tensor = wait_tensor

    def settled(collective: Any) -> Any:
        def run(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            work = collective(*args, async_op=True, **kwargs)
            if work is not None:
                work.wait()
            time.sleep(PAUSE_S)
            return work if async_op else None

        return run

    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "broadcast"):  # fmt: skip
        if hasattr(dist, name):
            setattr(dist, name, settled(getattr(dist, name)))


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(config_dir: str, seq_len: int, batch_size: int, layout: ParallelLayout) -> dict[str, int]:
    wl = dataclasses.replace(load(config_dir, seq_len=seq_len), parallel=layout)
    torch.manual_seed(0)
    model = wl.build_model()
    model.train()
    apply_layout(model, layout, make_mesh(layout, "cpu"), wl.tp_plan)
    optimizer = wl.optimizer(trainable_parameters(model))
    gc.collect()
    out = {"parameters": local_bytes(model_tensors(model))}
    grads: list[int] = []
    params = list(model.parameters())

    def grad_bytes(phase: str, step: int) -> None:
        if phase == "optimizer":  # the step's gradients, all there
            grads.append(local_bytes(p.grad for p in params if p.grad is not None))

    start = out["parameters"] + local_bytes(optimizer_tensors(optimizer))
    with cpu_memory_profile() as prof:
        run_workload_steps(wl, model, optimizer, batch_size, param_dtype=None, autocast=None, mark=grad_bytes)
    out["peak"] = profile_peak(prof, start)
    out["gradients"] = max(grads)
    out["optimizer_states"] = local_bytes(
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    )
    params.clear()
    del model, optimizer
    gc.collect()
    return out


def main() -> None:
    out, config_dir, names = sys.argv[1], sys.argv[2], sys.argv[5:]
    seq_len, batch_size = int(sys.argv[3]), int(sys.argv[4])
    place = init_distributed("cpu")
    settle_collectives()
    report: dict[str, Any] = {}
    for name in names:
        mine = measure(config_dir, seq_len, batch_size, LAYOUTS[name])
        every: list[Any] = [None] * place.world_size
        dist.all_gather_object(every, mine)
        report[name] = every
    if place.is_main:
        with open(out, "w") as f:
            json.dump(report, f)
    shutdown(place)


if __name__ == "__main__":
    main()
