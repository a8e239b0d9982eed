"""Accelerate: ``find_executable_batch_size`` that keeps the global batch.

Accelerate's decorator (``accelerate.utils.find_executable_batch_size``, which the HF ``Trainer``'s
``auto_find_batch_size`` uses) calls ``train(batch_size)`` from a starting size and, after each
out-of-memory error, again at 90% of it: the global batch shrinks with the batch size, every failed
size is a crash paid in real steps, and one that never fits ends in "No executable batch size found,
reached zero". Here the decorated function takes the split instead::

    @find_executable_batch_size(256, device="A100-80GB", workload=workload)
    def train(micro_batch_size, accumulation_steps):
        loader = DataLoader(data, batch_size=micro_batch_size)
        ...  # accumulation_steps micro-batches per optimizer step
    train()

- the first try comes from the estimate (``workload=``, planned on ``device``), so it usually fits
  the first time; without a workload it starts with the whole per-process share in one micro-batch;
- after an out-of-memory error the memory is freed (``gc``, then the device cache through Accelerate's
  ``clear_device_cache``) and ``train`` runs again with a smaller micro-batch and *more* accumulation:
  ``micro_batch_size x accumulation_steps x world_size`` stays the global batch, exactly;
- when one item per micro-batch does not fit, one ``DoesNotFitError`` names the remedies.

Limitations:
    ``train`` starts over after an error, as with Accelerate's decorator: build the model and optimizer
    inside it. With several processes, an out-of-memory error on one process leaves the others in their
    collectives; plan with ``workload=`` so that the first try fits.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import DoesNotFitError
from ..sources import load
from ..train.distributed import decided_on_main, world_size
from ..train.oom_resplit import is_out_of_memory
from ._common import equal_plan, largest_divisor_at_most, per_rank_share, require

require("accelerate", "accelerate", "accelerate")
from accelerate.utils.memory import clear_device_cache  # noqa: E402

__all__ = ["Attempt", "ExecutableBatchSize", "find_executable_batch_size"]

FRAMEWORK = "find_executable_batch_size"


@dataclass(frozen=True)
class Attempt:
    """One call of the decorated function."""

    micro_batch_size: int
    accumulation_steps: int
    out_of_memory: bool
    """True when it ran out of memory (and was retried smaller); False for the call that returned."""


def _world_size() -> int:
    """Processes training: torch.distributed's group once initialised, else the launcher's ``WORLD_SIZE``."""
    return world_size() if world_size() > 1 else max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def _accelerate_precision() -> str:
    """batchfit's precision for the ``Accelerator`` already created in this process (fp32 when none is)."""
    from accelerate.state import AcceleratorState

    if not getattr(AcceleratorState, "_shared_state", None):  # no Accelerator yet: nothing says otherwise
        return "fp32"
    mixed = str(getattr(AcceleratorState(), "mixed_precision", "no"))
    return {"bf16": "bf16", "fp16": "fp16"}.get(mixed, "fp32")


class ExecutableBatchSize:
    """The decorated function (see ``find_executable_batch_size``); ``attempts`` and ``plan`` tell what the
    last call did."""

    def __init__(
        self,
        function: Callable[..., Any],
        global_batch_size: int,
        *,
        device: Any,
        workload: Any,
        micro_batch_size: int | None,
        world_size: int | None,
        precision: str | None,
        checkpointing: bool,
        margin: float,
        free: Callable[[], None] | None,
    ) -> None:
        functools.update_wrapper(self, function)
        self.function = function
        self.global_batch_size = global_batch_size
        if isinstance(workload, str):  # a preset name, hub id or spec: resolved once, here (an unknown one fails now)

            workload = load(workload)
        self.device, self.workload = device, workload
        self.micro_batch_size, self.world_size = micro_batch_size, world_size
        self.precision, self.checkpointing, self.margin = precision, checkpointing, margin
        self.free = free
        self.attempts: list[Attempt] = []
        """The calls of the last run, in order."""
        self.plan: Any = None
        """The plan of the first try (None without a workload)."""

    def _first_micro(self, share: int, world: int) -> int:
        if self.micro_batch_size is not None:
            return largest_divisor_at_most(share, max(1, int(self.micro_batch_size)))
        if self.workload is None:
            return share

        device = self.device if self.device is not None else "cuda"
        rung = (self.precision or _accelerate_precision(), self.checkpointing)
        self.plan = decided_on_main(
            lambda: equal_plan(
                self.workload,
                self.global_batch_size,
                device=device,
                world_size=world,
                rungs=[rung],
                framework=FRAMEWORK,
                margin=self.margin,
            )
        )
        return int(self.plan.micro_batch_size)

    def _release(self) -> None:
        if self.free is not None:
            self.free()
        clear_device_cache(garbage_collection=True)  # gc.collect(), then the accelerator's cache
        empty = getattr(self.device, "empty_cache", None)  # a SimulatedDevice's cache too
        if callable(empty):
            empty()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        world = self.world_size if self.world_size is not None else _world_size()
        share = per_rank_share(self.global_batch_size, world, FRAMEWORK)
        self.attempts = []
        micro = self._first_micro(share, world)
        while True:
            steps = share // micro
            failure = None
            try:
                result = self.function(micro, steps, *args, **kwargs)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                failure = " ".join(str(exc).split())[:160]
            if failure is None:
                self.attempts.append(Attempt(micro, steps, False))
                return result
            # Outside the except block: its traceback (and the failed call's tensors) is gone now.
            self.attempts.append(Attempt(micro, steps, True))
            self._release()
            if micro == 1:
                raise DoesNotFitError(
                    f"one item per micro-batch runs out of memory ({failure}), so no split of the global batch of "
                    f"{self.global_batch_size} over {world} process(es) fits; try mixed precision "
                    "(Accelerator(mixed_precision='bf16')), activation checkpointing, sharding over more GPUs "
                    "(FSDP/DeepSpeed) or a larger GPU (`batchfit plan` says which would fit)"
                )
            micro = largest_divisor_at_most(share, micro // 2)


def find_executable_batch_size(
    global_batch_size: int,
    *,
    device: Any = None,
    workload: Any = None,
    micro_batch_size: int | None = None,
    world_size: int | None = None,
    precision: str | None = None,
    checkpointing: bool = False,
    margin: float = 0.0,
    free: Callable[[], None] | None = None,
) -> Callable[[Callable[..., Any]], ExecutableBatchSize]:
    """Decorate ``train(micro_batch_size, accumulation_steps, *args, **kwargs)`` to run ``global_batch_size``
    items per optimizer step, retrying with a smaller micro-batch and more accumulation after an
    out-of-memory error.

    Args:
        global_batch_size: items per optimizer step over all processes.
        device: the GPU to plan the first try for (a catalog name, a capacity, ``"cuda"`` or a
            ``SimulatedDevice``, whose cache is also emptied between tries); used with ``workload``.
        workload: a ``Workload`` (or preset name) of one step of ``train``'s loop: the first try is the
            largest equal micro-batch it fits. None: start with the whole per-process share.
        micro_batch_size: the first micro-batch to try instead (rounded down to a divisor of the share).
        world_size: processes training (None: torch.distributed's, else the launcher's ``WORLD_SIZE``).
        precision: of the workload (None: the ``Accelerator``'s ``mixed_precision``, fp32 without one).
        checkpointing: plan the workload with activation checkpointing of its blocks.
        margin: fraction of the GPU's memory to keep free in the plan.
        free: called after an out-of-memory error, before the caches are emptied (drop your references).

    Returns:
        A decorator; the decorated function is called without the two sizes and returns ``train``'s result.

    Raises:
        ConfigError: (when called) a global batch smaller than the world size or not divisible by it.
        DoesNotFitError: (when called) one item per micro-batch runs out of memory.

    Example:
        >>> @find_executable_batch_size(12, micro_batch_size=12)
        ... def train(micro_batch_size, accumulation_steps):
        ...     if micro_batch_size > 4:
        ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        ...     return micro_batch_size, accumulation_steps
        >>> import torch
        >>> train()
        (3, 4)
        >>> [(a.micro_batch_size, a.out_of_memory) for a in train.attempts]
        [(12, True), (6, True), (3, False)]
    """
    per_rank_share(global_batch_size, 1, FRAMEWORK)  # the global batch itself is checked now

    def decorate(function: Callable[..., Any]) -> ExecutableBatchSize:
        return ExecutableBatchSize(
            function,
            global_batch_size,
            device=device,
            workload=workload,
            micro_batch_size=micro_batch_size,
            world_size=world_size,
            precision=precision,
            checkpointing=checkpointing,
            margin=margin,
            free=free,
        )

    return decorate
