"""What a fit is measured against: the device's budget, and a real step where the device can run one.

A fit's device is a modelled GPU (a catalog name or a capacity: its traces are the whole truth), a
``SimulatedDevice`` (real steps inside its allocator verify the answer) or ``"cuda"`` (real steps on the
GPU at hand verify it). Both searches (the batch, ``planning/search.py``; the sequence,
``planning/seqlen.py``) take their budget and their real step from here.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError
from ..gpu.catalog import Device, get_device
from ..gpu.real_gpu import cuda_device
from ..memory.steps import build_for_steps, run_workload_steps
from ..precision import PrecisionPolicy
from ..runtime.cuda_steps import cuda_step_fits
from ..runtime.simulated import SimulatedDevice
from ..workload import Setup, Workload


def is_modelled(device: Any) -> bool:
    """Whether ``device`` is answered by traces alone (not a simulated device, not the GPU at hand)."""
    return not isinstance(device, SimulatedDevice) and not _is_cuda(device)


def device_budget(device: str | Device | SimulatedDevice, margin: float) -> tuple[Device, int]:
    """The device's catalog entry and the bytes a step may use on it (its memory less the margin).

    Raises:
        ConfigError: a device without a capacity (the cpu).
    """
    if isinstance(device, SimulatedDevice):
        return device.device, int(device.capacity_bytes * (1 - margin))
    if _is_cuda(device):
        dev = cuda_device()
    else:
        dev = get_device(device)
    if dev.total_bytes is None:
        raise ConfigError(
            f"{dev.name} has no memory capacity to fit against; give a GPU (--device A100-40GB) or a capacity "
            "(--device 24GiB)"
        )
    return dev, int(dev.total_bytes * (1 - margin))


def fit_setting(
    workload: Workload, device: str | Device | SimulatedDevice, margin: float, setup: Setup
) -> tuple[Device, int, PrecisionPolicy, tuple[type, ...]]:
    """What a search of ``workload`` on ``device`` runs against: the device, its budget, and ``setup``'s
    precision policy and checkpointed classes there."""
    dev, budget = device_budget(device, margin)
    return dev, budget, setup.policy(dev), setup.classes(workload)


def real_step(
    device: str | Device | SimulatedDevice, budget: int, policy: PrecisionPolicy, classes: tuple[type, ...]
) -> Callable[[Workload, int], bool] | None:
    """``(workload, batch_size) -> fits`` by running real steps on ``device``; None on a modelled device."""
    if isinstance(device, SimulatedDevice):
        return lambda workload, batch_size: _simulated_step_fits(workload, batch_size, budget, policy, classes)
    if _is_cuda(device):
        return lambda workload, batch_size: cuda_step_fits(workload, batch_size, policy, classes)
    return None


def _is_cuda(device: Any) -> bool:
    return isinstance(device, str) and device.strip().lower() == "cuda"


def _simulated_step_fits(
    workload: Workload, batch_size: int, capacity: int, policy: PrecisionPolicy, classes: tuple[type, ...]
) -> bool:
    """Run two real steps at ``batch_size`` inside a fresh simulated device; False on its OOM."""
    # foreach: what torch picks for CUDA parameters, as the tracer does
    model, optimizer = build_for_steps(workload, policy.param_dtype, classes, foreach=True)
    sim = SimulatedDevice(capacity, policy=policy)

    try:
        with sim:
            sim.track(model)
            run_workload_steps(
                workload,
                model,
                optimizer,
                batch_size,
                param_dtype=policy.param_dtype,
                autocast=policy.autocast("cpu"),
            )
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, optimizer
        gc.collect()
