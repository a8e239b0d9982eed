"""Real training steps on the CUDA GPU at hand: whether a batch size runs (what ``fit`` verifies against).

Kept apart from ``gpu/real_gpu.py`` (what the GPU is, asked of CUDA and NVML) because it runs a workload's
step, which the memory package's step runner does; ``cuda`` is a seam tests replace with a fake.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import torch

from ..memory.steps import build_for_steps, run_workload_steps

if TYPE_CHECKING:
    from ..workload import Workload


def cuda_step_fits(
    workload: Workload, batch_size: int, policy: Any, classes: tuple[type, ...], cuda: Any = torch.cuda
) -> bool:
    """Run two real steps at ``batch_size`` on the GPU; False on OOM, leaving the process usable.

    Everything the attempt allocated is dropped and the cache emptied before returning, whatever
    happened, so the next attempt starts from the same state.
    """
    model = optimizer = None
    try:
        model, optimizer = build_for_steps(workload, policy.param_dtype, classes, device="cuda")

        run_workload_steps(
            workload,
            model,
            optimizer,
            batch_size,
            param_dtype=policy.param_dtype,
            autocast=policy.autocast("cuda"),
            move=lambda t: t.to("cuda", non_blocking=True),
        )
        cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, optimizer
        gc.collect()
        cuda.empty_cache()
