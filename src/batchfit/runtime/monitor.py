"""Live memory on a real GPU: each step's peaks next to the estimate, and a diagnosis when a step runs out.

``MemoryMonitor`` reads, per training step, the peak allocated and reserved bytes of PyTorch's caching
allocator (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``) and what the whole device has
in use according to NVML (``nvidia-ml-py``: the number nvidia-smi shows, CUDA context and other
processes included), with the estimate's numbers alongside, so a wrong estimate shows up at step 1
rather than as an out-of-memory error at step 10,000. On an out-of-memory error, ``diagnose`` says
what was live by category and which micro-batch would fit.

Every GPU call goes through two seams, ``cuda`` (an object with ``torch.cuda``'s memory functions)
and ``nvml`` (the ``pynvml`` module), so the monitor is tested with fakes on machines without a GPU.
NVML is optional: without its library (``NVMLError_LibraryNotFound``) ``device_used_bytes`` is None
and ``nvml_error`` says why.

Example:
    >>> monitor = MemoryMonitor(estimate)  # doctest: +SKIP
    >>> for batch in loader:  # doctest: +SKIP
    ...     with monitor.step():
    ...         trainer.step(batch)
    ...     print(monitor.history[-1].describe())

Limitations:
    * The peaks are per process and per device; other processes appear only in NVML's figure.
    * After an out-of-memory error, tensors of the failed step may still be referenced (by the
      exception's traceback), so ``diagnose`` sees them as live: call it inside the ``except`` block,
      before freeing anything, to see the memory as it was when the allocation failed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..memory.allocator.caching import round_size
from ..memory.categories import Category
from ..units import GiB, KiB, MiB, format_bytes

#: Measured peaks more than this fraction above the estimate are called out in ``describe``.
TOLERANCE = 0.10
_UNIT = {"GiB": GiB, "MiB": MiB, "KiB": KiB, "bytes": 1}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|bytes)")
#: What a smaller micro-batch shrinks: everything but parameters, gradients and optimizer states.
OTHER = "activations_batch_temporaries"


def requested_bytes(exc: BaseException) -> int | None:
    """The size an out-of-memory error says it tried to allocate (PyTorch's message), if it says."""
    m = _TRIED.search(str(exc))
    return None if m is None else int(float(m.group(1)) * _UNIT[m.group(2)])


def _ratio_text(measured: int, estimated: int | None) -> str:
    if not estimated:
        return format_bytes(measured)
    delta = (measured - estimated) / estimated
    flag = " !" if abs(delta) > TOLERANCE else ""
    return f"{format_bytes(measured)} (estimate {format_bytes(estimated)}, {delta:+.0%}{flag})"


@dataclass(frozen=True)
class StepMemory:
    """One step's measured memory and the estimate of it."""

    step: int
    peak_allocated_bytes: int
    """``torch.cuda.max_memory_allocated`` over the step."""
    peak_reserved_bytes: int
    """``torch.cuda.max_memory_reserved`` over the step."""
    device_used_bytes: int | None
    """NVML's used memory of the whole device at the end of the step (None without NVML)."""
    estimated_peak_allocated_bytes: int | None = None
    estimated_peak_reserved_bytes: int | None = None
    estimated_device_total_bytes: int | None = None

    @property
    def reserved_error(self) -> float | None:
        """``(measured - estimated) / estimated`` of the reserved peak (None without an estimate)."""
        est = self.estimated_peak_reserved_bytes
        return None if not est else (self.peak_reserved_bytes - est) / est

    def describe(self) -> str:
        """One line for a log: measured peaks, each with the estimate and the difference ("!" past 10%)."""
        allocated = _ratio_text(self.peak_allocated_bytes, self.estimated_peak_allocated_bytes)
        parts = [
            f"step {self.step}: peak allocated {allocated}",
            f"reserved {_ratio_text(self.peak_reserved_bytes, self.estimated_peak_reserved_bytes)}",
        ]
        if self.device_used_bytes is not None:
            parts.append(f"device used {_ratio_text(self.device_used_bytes, self.estimated_device_total_bytes)}")
        return ", ".join(parts)


@dataclass(frozen=True)
class OomDiagnosis:
    """What was on the GPU when an allocation failed, and the micro-batch that would fit."""

    requested_bytes: int | None
    allocated_bytes: int
    reserved_bytes: int
    available_bytes: int
    """What the allocator could have had: reserved + the driver's free memory."""
    live_by_category: dict[str, int]
    """parameters, gradients, optimizer_states (counted from the tensors) and the rest (``OTHER``)."""
    micro_batch_size: int | None
    suggested_micro_batch_size: int | None
    """The largest micro-batch expected to fit; 0 when even the fixed part does not fit."""
    basis: str
    """How the suggestion was computed (from the estimate, or bounded from the failed step)."""
    where: str = "cuda"
    notes: tuple[str, ...] = field(default=())

    def advice(self) -> str:
        """What was observed, why it failed, and the change to make."""
        live = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.live_by_category.items())
        asked = "" if self.requested_bytes is None else f"asked for {format_bytes(self.requested_bytes)} with "
        micro = "" if self.micro_batch_size is None else f" at micro-batch {self.micro_batch_size}"
        head = (
            f"out of memory{micro} on {self.where}: {asked}{format_bytes(self.allocated_bytes)} allocated and "
            f"{format_bytes(self.reserved_bytes)} reserved of {format_bytes(self.available_bytes)} available ({live})"
        )
        fixed = sum(v for k, v in self.live_by_category.items() if k != OTHER)
        s = self.suggested_micro_batch_size
        if s == 0 or fixed >= self.available_bytes:
            fix = (
                f"parameters, gradients and optimizer states alone take {format_bytes(fixed)}, so no micro-batch "
                "fits; use --precision bf16-true, a lighter optimizer (SGD), FSDP sharding over more GPUs "
                "(batchfit plan --gpus N) or a larger GPU"
            )
        elif s is not None:
            fix = (
                f"activations, batch data and temporaries grow with the micro-batch; use a micro-batch of {s} "
                f"({self.basis}; --micro-batch-size {s}: accumulation keeps the global batch exact), or bf16 "
                "autocast / activation checkpointing (batchfit plan shows which fits)"
            )
        else:
            fix = (
                "activations, batch data and temporaries grow with the micro-batch; pass the micro-batch size to "
                "diagnose() for a suggestion, or run batchfit fit for the largest that fits"
            )
        return "; ".join([head, *self.notes, fix])


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def live_by_category(allocated_bytes: int, model: Any = None, optimizer: Any = None) -> dict[str, int]:
    """Bytes of parameters (and buffers), gradients and optimizer states, each storage counted once.

    Counted as the caching allocator counts (512-byte blocks); the rest of ``allocated_bytes`` is
    activations, batch data and temporaries (``OTHER``).
    """
    seen: set[tuple[str, int]] = set()

    def total(tensors: Iterable[Any]) -> int:
        n = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel():
                key = _storage_key(t)
                if key not in seen:
                    seen.add(key)
                    n += round_size(t.untyped_storage().nbytes())
        return n

    params = [*model.parameters(), *model.buffers()] if model is not None else []
    out = {
        Category.PARAMETERS.value: total(params),
        Category.GRADIENTS.value: total(p.grad for p in params if isinstance(p, torch.Tensor) and p.grad is not None),
        Category.OPTIMIZER_STATES.value: total(
            v for state in (optimizer.state.values() if optimizer is not None else []) for v in state.values()
        ),
    }
    out[OTHER] = max(0, allocated_bytes - sum(out.values()))
    return out


class MemoryMonitor:
    """Per-step GPU memory next to an estimate; out-of-memory diagnosis.

    Args:
        estimate: the ``Estimate`` of one step at the micro-batch being run (optional).
        device: the CUDA device index.
        cuda: the seam for ``torch.cuda`` (``reset_peak_memory_stats``, ``max_memory_allocated``,
            ``max_memory_reserved``, ``memory_allocated``, ``memory_reserved``, ``mem_get_info``,
            ``get_device_properties``); tests pass a fake.
        nvml: the seam for the ``pynvml`` module; default: imported on first use, if installed.
    """

    def __init__(self, estimate: Any = None, *, device: int = 0, cuda: Any = None, nvml: Any = None) -> None:
        self.estimate = estimate
        self.device = device
        self.cuda = cuda if cuda is not None else torch.cuda
        self._nvml = nvml
        self._handle: Any = None
        self._nvml_ready = False
        self.nvml_error: str | None = None
        """Why NVML figures are missing (library not found, no such device), once it was tried."""
        self.history: list[StepMemory] = []

    # -- NVML ----------------------------------------------------------------------------------------------
    def _nvml_handle(self) -> Any:
        if self._nvml_ready:
            return self._handle
        self._nvml_ready = True
        nvml = self._nvml
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py

                self._nvml = nvml
            nvml.nvmlInit()
            self._handle = self._find_handle(nvml)
        except Exception as exc:  # NVMLError_LibraryNotFound, ImportError, driver errors: NVML is optional
            self.nvml_error = f"{type(exc).__name__}: {exc}"
            self._handle = None
        return self._handle

    def _find_handle(self, nvml: Any) -> Any:
        # NVML numbers devices physically; CUDA_VISIBLE_DEVICES renumbers them for CUDA. The PCI bus id
        # names the same device in both, so use it when torch reports it, else trust the index.
        try:
            props = self.cuda.get_device_properties(self.device)
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            return nvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
        except Exception:
            return nvml.nvmlDeviceGetHandleByIndex(self.device)

    def device_used_bytes(self) -> int | None:
        """NVML's used bytes of the whole device (what nvidia-smi shows), or None without NVML."""
        handle = self._nvml_handle()
        if handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception as exc:
            self.nvml_error = f"{type(exc).__name__}: {exc}"
            return None

    def close(self) -> None:
        """Shut NVML down if this monitor started it."""
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._handle, self._nvml_ready = None, False

    # -- per step ------------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Restart the peak counters, so the next reading is this step's peak."""
        self.cuda.reset_peak_memory_stats(self.device)

    def end_step(self) -> StepMemory:
        """Read this step's peaks (and NVML's used memory), append them to ``history`` and return them."""
        est = self.estimate
        reading = StepMemory(
            step=len(self.history),
            peak_allocated_bytes=int(self.cuda.max_memory_allocated(self.device)),
            peak_reserved_bytes=int(self.cuda.max_memory_reserved(self.device)),
            device_used_bytes=self.device_used_bytes(),
            estimated_peak_allocated_bytes=None if est is None else est.peak_allocated_bytes,
            estimated_peak_reserved_bytes=None if est is None else est.peak_reserved_bytes,
            estimated_device_total_bytes=None if est is None else est.device_total_bytes,
        )
        self.history.append(reading)
        return reading

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """``start_step`` before the body, ``end_step`` after it (not after an exception: ``diagnose`` it)."""
        self.start_step()
        yield
        self.end_step()

    # -- out of memory -------------------------------------------------------------------------------------
    def diagnose(
        self, exc: BaseException, *, model: Any = None, optimizer: Any = None, micro_batch_size: int | None = None
    ) -> OomDiagnosis:
        """What was live when ``exc`` (an out-of-memory error) happened, and the micro-batch that would fit.

        With an estimate (of a step at any micro-batch) the suggestion scales the estimate's
        batch-dependent memory linearly; without one it is bounded from the failed step: at least the
        allocated bytes plus the failed request were needed at ``micro_batch_size``.

        Args:
            model, optimizer: counted into parameters, gradients and optimizer states.
            micro_batch_size: the micro-batch that failed.
        """
        cuda, dev = self.cuda, self.device
        allocated = int(cuda.memory_allocated(dev))
        reserved = int(cuda.memory_reserved(dev))
        free, _total = cuda.mem_get_info(dev)
        available = reserved + int(free)
        live = live_by_category(allocated, model, optimizer)
        requested = requested_bytes(exc)
        suggestion, basis, notes = None, "", []
        est = self.estimate
        if est is not None:
            fixed = sum(est.breakdown.get(c.value, 0) for c in _FIXED)
            per_item = (est.peak_reserved_bytes - fixed) / est.batch_size
            budget = available - fixed
            suggestion = max(0, int(budget // per_item)) if per_item > 0 else None
            basis = f"the estimate's {format_bytes(int(per_item))} per item, scaled linearly; check with batchfit fit"
            if suggestion is not None and micro_batch_size is not None and suggestion >= micro_batch_size:
                notes.append(
                    f"the estimate expected micro-batch {micro_batch_size} to fit in {format_bytes(available)}: the "
                    "difference is memory it does not see (other processes, cuDNN workspaces, fragmentation)"
                )
                suggestion = micro_batch_size - 1
        elif micro_batch_size is not None:
            fixed = sum(v for k, v in live.items() if k != OTHER)
            needed = allocated + (requested or 0) - fixed  # a lower bound of the batch-dependent peak
            per_item = needed / micro_batch_size
            bound = int((available - fixed) // per_item) if per_item > 0 else micro_batch_size
            if bound < micro_batch_size:
                suggestion = max(0, bound)
                basis = "at most this many: the failed step needed at least what it held plus its request"
            else:  # the failed step says only "fewer than micro_batch_size": halve, as the trainer does
                suggestion = micro_batch_size // 2
                basis = "half the failed micro-batch: the failed step bounds it no tighter"
        return OomDiagnosis(
            requested_bytes=requested,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            available_bytes=available,
            live_by_category=live,
            micro_batch_size=micro_batch_size,
            suggested_micro_batch_size=suggestion,
            basis=basis,
            where=f"cuda:{dev}",
            notes=tuple(notes),
        )


_FIXED = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATES)
