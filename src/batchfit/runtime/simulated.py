"""A simulated GPU: real CPU tensors run, and a CUDA caching-allocator model says when they would OOM.

Fitting, planning and OOM recovery must be testable without a GPU. ``SimulatedDevice`` tracks every
storage real CPU ops allocate (the same ``StorageTracker`` the estimator uses), feeds each through
the caching-allocator model with the GPU's capacity, and raises ``torch.OutOfMemoryError`` at the
allocation where a GPU of that capacity would, after the allocator's free-cache-and-retry. Inside it,
the CPU kernels are also made to allocate like CUDA's (dropout masks, attention, autocast's fp32
ops, cuBLAS workspaces), so a real run inside the simulated device and the estimator's trace see the
same storages.

NOTE [ What the simulated GPU holds ]
A GPU holds what was put on it: tensors made by ops while the device is entered (its thread's
factories and every op's fresh output), the model once it is placed there (``track``) and host
tensors copied there (``to_device``). It does not hold the host's tensors: those made before the
device was entered, in another thread (a data loader), or the caller's global batch. An op whose
output shares an input's storage (a view such as the micro-batch slice ``batch[i:j]``, or an in-place
op) allocates nothing; on a host tensor it stays on the host. Registering such a view as new would
put the whole host storage on the device (every item of the global batch at the first slice).

Example:
    >>> import torch
    >>> from batchfit import SimulatedDevice
    >>> with SimulatedDevice("64MiB") as gpu:
    ...     a = torch.empty(10 * 2**20)  # 40 MiB of fp32: fits
    ...     try:
    ...         b = torch.empty(10 * 2**20)  # 40 more do not
    ...     except torch.OutOfMemoryError:
    ...         print("OOM")
    OOM
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..batching import map_tensors
from ..errors import ConfigError
from ..gpu.catalog import Device, generic_device, get_device
from ..memory.allocator.caching import AllocatorStats, CachingAllocator
from ..memory.kernels.cuda import CudaKernels, cuda_emulation
from ..memory.trace.tracker import StorageTracker
from ..precision import PrecisionPolicy, policy_for
from ..units import format_bytes, parse_bytes


class _DeviceStorages(StorageTracker):
    """The storage tracker of a simulated GPU: an op's output that aliases a host tensor stays on the host.

    See NOTE [ What the simulated GPU holds ]. The estimator's tracker (on fake tensors, where every
    input was made inside the trace) is the plain ``StorageTracker``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._op_inputs: tuple[tuple, dict] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self._op_inputs = (args, kwargs or {})
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._op_inputs = None

    def register(self, t: torch.Tensor) -> int | None:
        if self._op_inputs is not None and self.storage_id(t) is None and self._aliases_an_input(t):
            return None  # a view of (or an in-place op on) a host tensor: no allocation on the device
        return super().register(t)

    def _aliases_an_input(self, t: torch.Tensor) -> bool:
        assert self._op_inputs is not None
        key = t.untyped_storage()._cdata  # the StorageImpl itself: views of one tensor share it
        for leaf in tree_flatten(self._op_inputs)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage()._cdata == key:
                return True
        return False


class SimulatedDevice:
    """A GPU of a given capacity, enforced on real CPU tensors (a context manager).

    Args:
        capacity: bytes the caching allocator may reserve (``"8GiB"``, an int), or a catalog
            ``Device``/name, whose capacity is its total memory minus its CUDA context.
        expandable_segments: model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        policy: the precision in use, so that CUDA's autocast casting is emulated (None: fp32).

    Limitations:
        CPU kernels' own scratch is not counted (it is CPU memory); CUDA's kernel workspaces are
        modelled as in the estimator. Tensors that exist before entering, or are made in another
        thread, are host tensors: not on the device unless passed to ``track`` or copied there with
        ``to_device`` (see NOTE [ What the simulated GPU holds ]). Inside, every factory allocates on
        the device, as under ``torch.set_default_device("cuda")``: a tensor meant for the host
        (``torch.zeros(..., device="cpu")``) is counted too.
    """

    def __init__(
        self,
        capacity: int | str | Device,
        *,
        expandable_segments: bool = False,
        policy: PrecisionPolicy | None = None,
    ) -> None:
        if isinstance(capacity, Device) or (isinstance(capacity, str) and not capacity[:1].isdigit()):
            dev = get_device(capacity)  # type: ignore[arg-type]
            if dev.usable_bytes is None:
                raise ConfigError("a simulated device needs a capacity; give a GPU name or one like '8GiB', not cpu")
            self.device = dev
            self.capacity_bytes = dev.usable_bytes
        else:
            self.capacity_bytes = parse_bytes(capacity)  # type: ignore[arg-type]
            self.device = _generic(self.capacity_bytes)
        self.allocator = CachingAllocator(self.capacity_bytes, expandable_segments=expandable_segments)
        self._policy = policy
        self._handles: dict[int, int] = {}
        self._tracker = _DeviceStorages(self._on_alloc, self._on_free, self._after_op)
        self._stack: contextlib.ExitStack | None = None

        # One kernel model for the device's life: its cuBLAS workspaces, once allocated, stay (as on a
        # GPU, where each handle keeps its workspace), however often the device is entered.
        self._kernels: Any = CudaKernels(self.device)
        self._next_scratch = 1 << 40

    # -- allocation ---------------------------------------------------------------------------
    def _on_alloc(self, sid: int, nbytes: int) -> None:
        self._handles[sid] = self.allocator.malloc(nbytes)

    def _on_free(self, sid: int) -> None:
        handle = self._handles.pop(sid, None)
        if handle is not None:
            self.allocator.free(handle)

    def _after_op(self, func: Any, args: tuple, kwargs: dict, outputs: list, first_new: int) -> None:
        if self._kernels is not None:
            self._kernels.after_op(self, func, args, kwargs, [])

    def add_scratch(self, nbytes: int, label: str, *, transient: bool) -> int:
        """Allocate what a CUDA kernel allocates internally (the kernel model calls this)."""
        handle = self.allocator.malloc(nbytes)
        if transient:
            self.allocator.free(handle)
        else:
            self._next_scratch += 1
            self._handles[self._next_scratch] = handle
        return self._next_scratch

    def sized_by(self, sid: int, reduction: Any, part: int) -> None:
        """A traced step keeps what sizes a reduction's scratch; a step that runs has its size already."""

    def free_scratch(self, ids: Iterable[int]) -> None:
        """Free scratch ``add_scratch`` kept (buffers a kernel holds together and frees on return)."""
        for i in ids:
            self.allocator.free(self._handles.pop(i))

    def track(self, *objects: nn.Module | torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Put existing tensors (a model's parameters and buffers, say) on the simulated device."""
        for obj in objects:
            if isinstance(obj, nn.Module):
                tensors: Iterable[torch.Tensor] = [*obj.parameters(), *obj.buffers()]
            elif isinstance(obj, torch.Tensor):
                tensors = [obj]
            else:
                tensors = obj
            for t in tensors:
                self._tracker.register(t)

    def holds(self, t: torch.Tensor) -> bool:
        """True when ``t``'s storage is on the simulated device (made there, tracked or copied there)."""
        return self._tracker.storage_id(t) is not None

    def to_device(self, batch: Any) -> Any:
        """``batch`` on the simulated GPU, as ``.to("cuda")`` would give it: host tensors are copied
        there (and counted from now), tensors already on it are returned as they are.

        Works whether or not the device is entered. ``batch`` is a tensor or a (nested) tuple, list or
        dict of them.

        Raises:
            torch.OutOfMemoryError: a copy does not fit (nothing of it stays on the device).
        """
        def move(t: torch.Tensor) -> torch.Tensor:
            if self.holds(t):
                return t
            copy = t.clone()  # registered by the tracker when entered in this thread
            self._tracker.register(copy)  # and here when not (idempotent when it already was)
            return copy

        return map_tensors(batch, move)

    @property
    def label(self) -> str:
        """The device in messages: ``a simulated 64.00 MiB GPU``, ``a simulated T4 GPU``."""
        generic = self.device.name.startswith("simulated")  # a bare capacity, not a catalog GPU
        return f"a simulated {format_bytes(self.capacity_bytes) if generic else self.device.name} GPU"

    def using(self) -> contextlib.AbstractContextManager:
        """This device entered for a ``with`` block, unless it is entered already (then nothing to do).

        What a ``Trainer`` or ``Accumulator`` given the device does around its work, so that a caller
        need not enter it (a GPU is used by whoever is given it).
        """
        return contextlib.nullcontext(self) if self.active else self

    # -- statistics ---------------------------------------------------------------------------
    def stats(self) -> AllocatorStats:
        """Allocated/reserved bytes and peaks, retries and OOMs so far."""
        return self.allocator.stats()

    def empty_cache(self) -> None:
        """Release cached segments (what ``torch.cuda.empty_cache`` does)."""
        self.allocator.empty_cache()

    def reset_peak(self) -> None:
        self.allocator.reset_peak()

    # -- context ------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True while the device is entered (its tracker sees this thread's allocations)."""
        return self._stack is not None

    def __enter__(self) -> SimulatedDevice:
        if self._stack is not None:
            raise RuntimeError("this SimulatedDevice is already entered")
        stack = contextlib.ExitStack()
        if self._policy is not None:
            stack.enter_context(cuda_emulation(self._policy, self.device.compute_capability)())
        else:
            stack.enter_context(cuda_emulation(policy_for("fp32"))())
        stack.enter_context(self._tracker)
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None


def _generic(capacity_bytes: int) -> Device:
    """A generic modern GPU whose allocator may reserve ``capacity_bytes`` (no context on top)."""
    import dataclasses

    template = generic_device("80GiB")
    return dataclasses.replace(
        template, name=f"simulated {capacity_bytes} B", total_bytes=capacity_bytes, context_bytes=0,
        context_source="override", context_detail="a simulated GPU has none",
    )  # fmt: skip
