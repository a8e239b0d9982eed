"""What the framework adapters share: a plan with equal micro-batches, batches of any size from one real
batch, the device to plan against, and the one-line error for a missing optional package.

Frameworks split a global batch one way only: every rank runs ``accumulation`` micro-batches of the
same ``micro`` items, so ``micro x accumulation x world_size`` must *be* the global batch. batchfit's own
plans allow ranks' shares and micro-batches to differ by one item (its trainer weights each by its
count); here the micro-batch is instead the largest *divisor* of the per-rank share that fits.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from ..batching import Batch, batch_size_of, check_batch_size, map_tensors
from ..errors import ConfigError, DoesNotFitError, MissingExtraError
from ..gpu.catalog import Device, get_device
from ..gpu.real_gpu import cuda_device
from ..memory.estimate import trace_for_device, with_accumulation
from ..memory.trace.fake_step import real_execution
from ..planning.estimate import estimate
from ..planning.plan import plan
from ..runtime.simulated import SimulatedDevice
from ..units import format_bytes
from ..workload import Setup

if TYPE_CHECKING:
    from ..workload import Workload


def require(module: str, extra: str, integration: str) -> ModuleType:
    """``import module``, or one line naming the extra that installs it.

    Raises:
        MissingExtraError: the package is not installed (or cannot be imported).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"batchfit.integrations.{integration} needs {module}, which is not installed ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0] if str(e) else module}); install it with: pip install 'batchfit[{extra}]'"
        ) from None


def per_rank_share(global_batch_size: Any, world_size: Any, framework: str) -> int:
    """Items each rank takes per optimizer step: the global batch divided by the world size, exactly.

    Raises:
        ConfigError: a global batch or world size below 1, fewer items than ranks, or a global batch that
            the world size does not divide (the framework gives every rank the same batch size).
    """
    check_batch_size(global_batch_size, "the global batch size")
    check_batch_size(world_size, "the world size")
    if global_batch_size < world_size:
        raise ConfigError(
            f"a global batch of {global_batch_size} cannot give each of {world_size} processes an item; "
            f"use a global batch >= {world_size} or fewer processes"
        )
    if global_batch_size % world_size:
        lower = global_batch_size - global_batch_size % world_size
        raise ConfigError(
            f"{framework} gives every one of its {world_size} processes the same batch size, so the global batch "
            f"must be a multiple of {world_size}; use {lower} or {lower + world_size} instead of {global_batch_size}"
        )
    return global_batch_size // world_size


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest ``d <= limit`` dividing ``n`` (1 at worst): the biggest equal micro-batch of a share."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


def plan_device(device: Any) -> Device:
    """The ``Device`` a plan is made for: a catalog name or capacity, a ``Device``, a ``SimulatedDevice``
    (its allocator capacity), or ``"cuda"`` (the visible GPU, read from torch; nothing runs on it)."""
    if isinstance(device, SimulatedDevice):
        return device.device
    if isinstance(device, str) and device.strip().lower() == "cuda":
        return cuda_device()
    return get_device(device)


def equal_plan(
    workload: Workload,
    global_batch_size: int,
    *,
    device: Any,
    world_size: int,
    rungs: Sequence[tuple[str, bool]],
    framework: str,
    margin: float = 0.0,
    choose_blocks: bool = False,
    **plan_kwargs: Any,
) -> Any:
    """The first of ``rungs`` (``(precision, checkpointing)``) on which the global batch fits, as a ``Plan``
    whose every rank runs equal micro-batches; with ``choose_blocks``, a rung that checkpoints keeps the fewest
    first blocks its micro-batch needs (``Plan.checkpointed_blocks``: the framework's adapter applies them).

    Each rung is first checked with one traced step of one item (``one_item_estimate``), then planned by
    ``batchfit.plan`` with its precision and checkpointing fixed; a plan that would need FSDP sharding
    counts as not fitting (the framework's knobs set here do not shard). ``plan_kwargs`` (learning-rate
    scaling) go to ``plan``. The micro-batch is the largest divisor of the per-rank share not above the
    plan's largest fitting micro-batch, and the estimate is redone at it when it differs from the plan's.

    Raises:
        ConfigError: see ``per_rank_share``; a bad device or precision.
        DoesNotFitError: no rung fits one item per process; the message says what one item needs.
    """
    share = per_rank_share(global_batch_size, world_size, framework)
    # Planning takes no device memory: outside any dispatch mode the caller has active (a SimulatedDevice
    # entered around the framework's training would otherwise count the trace's fake tensors as its own).
    with real_execution():
        found = _first_fitting(workload, global_batch_size, share, world_size, rungs, framework, device, margin,
                               plan_kwargs)  # fmt: skip
        return _with_fewest_blocks(workload, found, plan_device(device)) if choose_blocks else found


def _first_fitting(
    workload: Workload,
    global_batch_size: int,
    share: int,
    world_size: int,
    rungs: Sequence[tuple[str, bool]],
    framework: str,
    device: Any,
    margin: float,
    plan_kwargs: dict[str, Any],
) -> Any:
    dev = plan_device(device)
    why = ""
    for precision, checkpointing in rungs:
        wl = workload if checkpointing else dataclasses.replace(workload, checkpoint_blocks=())
        est = one_item_estimate(wl, dev, precision, checkpointing)
        budget = int((dev.total_bytes or 0) * (1 - margin))
        if est.device_total_bytes > budget:
            why = f"one item needs {format_bytes(est.device_total_bytes)} of {format_bytes(budget)}"
            continue
        try:
            found = plan(
                wl,
                global_batch_size,
                device=dev,
                gpus=world_size,
                precision=precision,
                checkpointing="blocks" if checkpointing else None,
                margin=margin,
                tensor_parallel=1,  # a framework's own data parallelism: no split of the model
                **plan_kwargs,
            )
        except DoesNotFitError as e:  # one item fits, but not beside the gradients accumulation keeps
            why = str(e)
            continue
        if found.sharded:
            why = "it would need FSDP sharding across the GPUs"
            continue
        return _equalised(wl, found, share, dev)
    tried = ", ".join(f"{p}{' + activation checkpointing' if c else ''}" for p, c in rungs)
    raise DoesNotFitError(
        f"{workload.name} does not fit on {world_size} x {dev.name} with one item per GPU in any configuration "
        f"{framework} is given here (tried: {tried}; at the last, {why}); try LoRA adapters, sharding over more GPUs "
        "(FSDP/DeepSpeed) or a larger GPU (`batchfit plan` names one)"
    )


def _with_fewest_blocks(workload: Workload, found: Any, dev: Device) -> Any:
    """``found``, when it checkpoints every block, with the fewest first blocks its micro-batch needs, the others
    kept or checkpointed selectively, whichever is predicted faster (NOTE [ Checkpointing only what the
    micro-batch needs ] in ``planning/partial.py``), its estimate and time."""
    from ..memory.states import state_bytes
    from ..planning.cost import predict_step_time
    from ..planning.partial import BlockSearch, FewestBlocks, blocks_setting, fastest_first

    if not found.checkpointing or found.checkpointed_blocks is not None:
        return found
    steps = found.accumulation_steps
    wl = with_accumulation(workload, 2 if steps > 1 else 1)
    capacity = found.headroom_bytes + found.estimate.device_total_bytes  # Plan: headroom = capacity - total
    setup = Setup(precision=found.precision, checkpointing="blocks")
    searches = [BlockSearch(wl, dev, setup, False, 1, found.micro_batch_size, capacity, selective=selective)
                for selective in (False, True)]  # the other blocks kept, or checkpointed selectively: the faster
    times: dict[tuple[BlockSearch, int], float] = {}

    def seconds(search: BlockSearch, k: int) -> float:
        if (search, k) not in times:
            chosen = Setup(precision=found.precision, checkpointing=blocks_setting(k, search.of, search.selective))
            trace = trace_for_device(wl, found.micro_batch_size, dev, chosen.policy(dev), chosen.classes(wl))
            times[(search, k)] = predict_step_time(
                trace, dev, precision=found.precision, micro_batches=steps, gpus=found.gpus, sharded=False,
                interconnect=found.interconnect,
                state_bytes=state_bytes(wl, chosen.policy(dev).param_dtype).as_tuple(),
            ).total_s  # fmt: skip
        return times[(search, k)]

    timed = [(seconds(s, k), FewestBlocks(k, s.of, s.at(k), s.selective)) for s, k in fastest_first(searches, seconds)]
    if not timed:
        return found
    best_s, fewest = min(timed, key=lambda t: t[0])
    est = fewest.estimate if steps == 1 else dataclasses.replace(fewest.estimate, accumulation_steps=steps)
    return dataclasses.replace(found, checkpointed_blocks=fewest.blocks, selective_rest=fewest.selective,
                               estimate=est, remedies=fewest.remedies(found.remedies),
                               headroom_bytes=capacity - est.device_total_bytes, predicted_step_s=best_s)  # fmt: skip


def one_item_estimate(workload: Workload, dev: Device, precision: str, checkpointing: bool) -> Any:
    """The estimate of a step of one item: the cheapest test of whether a configuration can fit at all
    (one trace, where a plan that cannot fit searches the catalog for where it would)."""
    return estimate(workload, 1, device=dev, precision=precision, checkpointing="blocks" if checkpointing else None)


def _equalised(workload: Workload, found: Any, share: int, dev: Device) -> Any:
    """``found`` with ``micro`` x ``accumulation`` equal on every rank (see the module docstring)."""
    micro = largest_divisor_at_most(share, found.max_micro_batch_size)
    steps = share // micro
    splits = [[micro] * steps for _ in range(found.gpus)]
    if found.splits == splits:
        return found

    est = estimate(
        workload,
        micro,
        device=dev,
        precision=found.precision,
        checkpointing="blocks" if found.checkpointing else None,
        accumulation_steps=steps,
    )
    capacity = found.headroom_bytes + found.estimate.device_total_bytes  # Plan: headroom = capacity - total
    return dataclasses.replace(
        found,
        micro_batch_size=micro,
        accumulation_steps=steps,
        splits=splits,
        estimate=est,
        headroom_bytes=capacity - est.device_total_bytes,
    )


class RepeatedItems:
    """``batch_size -> batch``: a real batch's items repeated (``i % n``) to any size.

    The estimator needs the step at many batch sizes, while a framework hands over one real batch (or
    one example). Items are taken cyclically, so shapes, dtypes and value-dependent branches (padding
    masks, ``-100`` labels) are those of the real data. Non-tensor leaves (lists of strings) are kept as
    they are. A class rather than a closure, so a workload made from it pickles when its batch does.
    """

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.n_items = batch_size_of(batch)
        """Items in the real batch."""

    def __call__(self, batch_size: int) -> Batch:
        index = torch.arange(batch_size) % self.n_items  # (batch_size,)
        return map_tensors(self.batch, lambda t: t.index_select(0, index.to(t.device)))


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (for errors wrapped into one-line ConfigErrors)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
