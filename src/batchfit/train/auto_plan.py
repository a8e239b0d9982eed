"""``micro_batch_size="auto"``: the Trainer's plan, made from the workload's traced memory at the first step.

The Trainer needs three things of a plan: the workload to trace (the caller's, or one made of the
model, the loss, the optimizer's class and defaults and batches shaped like the first), the plan itself
(made once, on rank 0, for every rank), and this rank's micro-batch sizes when the plan's split can be
executed exactly as made.
"""

from __future__ import annotations

import concurrent.futures
import inspect
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..batching import Batch, map_tensors
from ..errors import ConfigError
from ..workload import Workload
from .distributed import decided_on_main


def _like(spec: Batch, batch_size: int) -> Batch:
    """A batch of ``batch_size`` zero items shaped like ``spec``'s (runs under ``FakeTensorMode``)."""
    return map_tensors(spec, lambda t: torch.zeros((batch_size, *t.shape[1:]), dtype=t.dtype))


def _same_optimizer(cls: type, defaults: dict[str, Any], params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """``cls(params, **defaults)``, minus defaults its constructor does not take (AdamW's are Adam's)."""
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    return cls(params, **defaults)


def own_workload(model: nn.Module, optimizer: torch.optim.Optimizer, loss: Callable, batch: Batch) -> Workload:
    """A workload of the Trainer's own model, loss and optimizer, with batches shaped like ``batch``."""
    spec = map_tensors(batch, lambda t: torch.empty((0, *t.shape[1:]), dtype=t.dtype, device="meta"))
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return Workload(
        model=inner,
        batch=partial(_like, spec),
        loss=loss,
        optimizer=partial(_same_optimizer, type(optimizer), dict(optimizer.defaults)),
        name="trainer",
    )


def make_plan(
    workload: Workload, global_batch_size: int, *, device: Any, gpus: int, precision: str, in_a_thread: bool
) -> Any:
    """``batchfit.plan.plan`` of ``workload``, made on rank 0 for every rank (they must agree on the split).

    Args:
        in_a_thread: plan in a worker thread. Dispatch modes are per thread: planning traces fake
            tensors, which a simulated device's mode (active in this thread) would otherwise count as
            allocations of its own.

    Raises:
        ConfigError: ``batchfit.plan`` cannot be imported.
    """
    try:
        from ..planning.plan import plan  # imports the estimator: only when asked for
    except ImportError as exc:
        raise ConfigError(
            f"micro_batch_size='auto' needs batchfit.plan, which could not be imported ({exc}); "
            "pass micro_batch_size=N"
        ) from exc
    run: Callable[[], Any] = partial(plan, workload, global_batch_size, device=device, gpus=gpus, precision=precision,
                                     tensor_parallel=1)  # the Trainer splits a model only when told (tensor_parallel=)
    if in_a_thread:
        planner = run

        def threaded() -> Any:
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                return pool.submit(planner).result()

        run = threaded
    return decided_on_main(run)


def planned_micro_batch_size(plan: Any, global_batch_size: int) -> int:
    """The plan's micro-batch size, checked.

    Raises:
        ConfigError: the plan gave no whole number >= 1.
    """
    micro = getattr(plan, "micro_batch_size", None)
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ConfigError(f"the plan gave micro_batch_size={micro!r}; pass micro_batch_size=N instead")
    return min(micro, global_batch_size)


def planned_splits(plan: Any, *, rank: int, share: int, micro_batch_size: int, sharded: bool) -> list[int] | None:
    """This rank's micro-batch sizes as the plan made them, when they can be executed exactly (else None)."""
    splits = getattr(plan, "splits", None)
    mine = list(splits[rank]) if splits and len(splits) > rank else None
    smallest = 0 if sharded else 1  # FSDP plans may end a share with padding (batching.make_splits)
    valid = mine and sum(mine) == share and max(mine) <= micro_batch_size and min(mine) >= smallest
    if valid and (not sharded or len({len(s) for s in splits}) == 1):  # FSDP: ranks agree on the count
        return mine
    return None
