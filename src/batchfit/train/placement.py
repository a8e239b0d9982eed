"""Where the Trainer's tensors go: the CPU, a CUDA GPU or a simulated GPU, behind one small seam.

A ``Placement`` says how a micro-batch reaches the device (copied just before it runs), what releases
the device's cached memory after an out-of-memory error, what to call the device in messages, and (for
a simulated GPU) the device to enter around a step when the caller did not.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from ..batching import Batch, map_tensors
from ..errors import ConfigError, UnknownNameError
from ..gpu.catalog import generic_device, get_device
from ..runtime.simulated import SimulatedDevice
from .oom_errors import CacheReleaser, CudaCache, NoCache


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a micro-batch goes and how the device's memory is released: the trainer's device seam."""

    device: torch.device
    """Where tensors live (the CPU for a simulated GPU)."""
    name: str
    """For messages: ``cpu``, ``cuda:0``, ``a simulated A100-40GB GPU``."""
    cache: CacheReleaser
    simulated: SimulatedDevice | None = None

    def move(self, batch: Batch) -> Batch:
        """The micro-batch on the device, copied only now, when it is about to run."""
        if self.simulated is not None:  # a host-to-device copy the simulated allocator must see
            return self.simulated.to_device(batch)
        device = self.device
        return map_tensors(batch, lambda t: t.to(device, non_blocking=True))

    def using(self) -> contextlib.AbstractContextManager:
        """The simulated GPU entered for a step (unless the caller entered it); nothing on real devices."""
        return self.simulated.using() if self.simulated is not None else contextlib.nullcontext()


def placement(device: str | torch.device | SimulatedDevice) -> Placement:
    """The ``Placement`` of ``"cpu"``, ``"cuda"``/``"cuda:N"`` or a ``SimulatedDevice``.

    Raises:
        ConfigError: any other device, or CUDA asked for where no GPU is visible.
    """
    if isinstance(device, SimulatedDevice):
        return Placement(torch.device("cpu"), device.label, device, device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N' or a SimulatedDevice, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for but no GPU is visible; use 'cpu' or a SimulatedDevice")
        return Placement(dev, str(dev), CudaCache())
    return Placement(dev, "cpu", NoCache())


def cuda_profile(index: int) -> Any:
    """The catalog entry of the visible GPU, or a generic GPU of its total memory if not in the catalog."""
    try:
        return get_device(torch.cuda.get_device_name(index))
    except UnknownNameError:
        return generic_device(f"{torch.cuda.get_device_properties(index).total_memory}B")
