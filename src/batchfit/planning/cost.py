"""Predicted time of one optimizer step (a whole global batch) in a given configuration.

NOTE [ A time model to rank configurations ]
The model needs only to order the configurations a plan can choose from, so it keeps the terms that
differ between them and states its assumptions:

- compute: the traced step's floating-point operations (``trace.flops``, PyTorch's own formulas,
  recomputation of checkpointed blocks included) at a fraction (``MATMUL_EFFICIENCY``) of the GPU's
  peak: the tensor-core peak for bf16/fp16 autocast and bf16 weights, the non-tensor-core fp32 peak for
  fp32 (PyTorch's default ``float32_matmul_precision="highest"`` uses no TF32);
- memory traffic: every byte the step allocates in forward and backward is written once and read
  about once, at a fraction (``BANDWIDTH_EFFICIENCY``) of the GPU's memory bandwidth; the optimizer
  step reads and writes parameters, gradients and states once;
- communication, overlapped as PyTorch overlaps it: DDP all-reduces the gradients once per optimizer
  step (a ring moves ``2 (n - 1) / n`` of them), bucket by bucket while the last micro-batch's backward
  runs, so only what outlasts that backward is paid; FSDP all-gathers the parameters in forward and
  again in backward and reduce-scatters the gradients, once per micro-batch (``(n - 1) / n`` of the full
  size each), each unit's gather prefetched while the unit before it computes and each reduce-scatter
  run while the next unit's backward computes (NOTE [ Communication behind compute ]), so a
  micro-batch pays what outlasts its forward (the gather) and its backward (the gather and the
  reduce-scatter), over the assumed interconnect;
- tensor parallelism, unoverlapped, over the node's NVLink: the collectives of one rank's traced step
  as they were traced (their output bytes, forward and backward: an all-reduce moves ``2 (n - 1) / n``
  of its tensor, an all-gather ``(n - 1) / n`` of its output, a reduce-scatter ``n - 1`` of its
  output), once per micro-batch (the next op needs their output: they sit on the critical path); FSDP
  then shards each rank's ``1 / n`` of the parameters across the groups, over the assumed interconnect.

Each micro-batch pays compute + traffic (+ what its communication leaves exposed); the accumulation
count multiplies it. The result is a prediction for ranking, not a measurement; ``batchfit sweep``
measures.

NOTE [ Communication behind compute ]
Data-parallel communication runs on its own CUDA stream beside the compute stream: DDP launches each
gradient bucket's all-reduce as soon as autograd has filled it (its backward hook; ``no_sync`` defers
it to the optimizer step's last micro-batch), FSDP2 issues the next unit's all-gather while the current
one computes (implicit prefetch, forward and backward) and reduce-scatters a unit's gradients while
the next unit's backward runs (PyTorch's FSDP notes; FSDP1's ``BACKWARD_PRE`` prefetch does the same).
A phase therefore takes the longer of its compute and its communication, not their sum: a small
micro-batch on a fast link pays nothing for FSDP, and one on a slow link pays the difference. The
first unit's gather and the last unit's reduce-scatter cannot overlap (one unit of the model's many,
left out), nor can tensor-parallel collectives, whose output the next op reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import ConfigError

MATMUL_EFFICIENCY = 0.5
"""Fraction of the peak a training step's matrix products reach (typical model FLOPs utilisation)."""
BANDWIDTH_EFFICIENCY = 0.7
"""Fraction of the peak memory bandwidth elementwise kernels reach."""

# Non-tensor-core fp32 peaks (TFLOPS), NVIDIA datasheets; bf16/fp16 tensor peaks are in the catalog.
FP32_TFLOPS = {
    "V100-16GB": 15.7, "V100-32GB": 15.7, "T4": 8.1, "A10G": 31.2, "L4": 30.3, "L40S": 91.6,
    "RTX-3090": 35.6, "RTX-4090": 82.6, "A6000": 38.7, "A100-40GB": 19.5, "A100-80GB": 19.5,
    "H100-80GB": 67.0, "H200": 67.0, "B200": 80.0,
}  # fmt: skip


class Interconnect(str, Enum):
    """How the GPUs of a plan talk to each other."""

    nvlink = "nvlink"
    pcie = "pcie"
    ib = "ib"


# Per-GPU, one-direction bandwidth in GB/s. NVLink by generation (NVIDIA: V100 300, A100 600, H100 900,
# B200 1800 GB/s total, half per direction); PCIe 4.0 x16 32 GB/s (5.0: 64); InfiniBand HDR 200 Gb/s and
# NDR 400 Gb/s per GPU (one adapter per GPU), 25 and 50 GB/s.
_NVLINK_GBPS = {"Volta": 150.0, "Ampere": 300.0, "Hopper": 450.0, "Blackwell": 900.0}
_PCIE_GBPS = {"Hopper": 64.0, "Blackwell": 64.0}
_IB_GBPS = {"Hopper": 50.0, "Blackwell": 50.0}


def link_gbps(device: Any, interconnect: Interconnect | str) -> float:
    """The assumed per-GPU bandwidth of ``interconnect`` for ``device``'s generation, in GB/s.

    Raises:
        ConfigError: an unknown interconnect name.
    """
    try:
        kind = Interconnect(interconnect)
    except ValueError:
        raise ConfigError(f"unknown interconnect {interconnect!r}; use nvlink, pcie or ib") from None
    arch = getattr(device, "arch", "")
    if kind is Interconnect.nvlink:
        return _NVLINK_GBPS.get(arch, 32.0)  # a GPU without NVLink talks over PCIe
    if kind is Interconnect.pcie:
        return _PCIE_GBPS.get(arch, 32.0)
    return _IB_GBPS.get(arch, 25.0)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by where the time goes."""

    compute_s: float
    memory_s: float
    optimizer_s: float
    communication_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.memory_s + self.optimizer_s + self.communication_s


# A GPU given by its capacity only ("24GiB") is modelled as the catalog's Ampere defaults elsewhere
# (devices.generic_device); its throughput is taken as an A100's.
_GENERIC = ("A100-40GB", 312.0, 1555.0)


def _peak_flops(device: Any, precision: str) -> float:
    tensor = float(getattr(device, "bf16_tflops", 0.0) or 0.0)
    name = getattr(device, "name", "")
    if not tensor:
        name, tensor = _GENERIC[0], _GENERIC[1]
    fp32 = FP32_TFLOPS.get(name, tensor / 16)
    return (fp32 if precision == "fp32" else tensor) * 1e12


def _bandwidth(device: Any) -> float:
    return float(getattr(device, "memory_bandwidth_gbps", 0.0) or _GENERIC[2]) * 1e9


def step_traffic(trace: Any, step: int = 1) -> tuple[int, int]:
    """``(FLOPs, bytes allocated)`` of the forward and backward of one micro-batch of ``step`` in ``trace``.

    A trace of an accumulating step (``Workload.accumulation_steps``) runs several micro-batches per
    optimizer step; the time model multiplies by the plan's own count, so the trace's is divided out.
    """
    phases = phase_traffic(trace, step)
    return tuple(sum(v[i] for v in phases.values()) for i in (0, 1))  # type: ignore[return-value]


def phase_traffic(trace: Any, step: int = 1) -> dict[str, tuple[int, int]]:
    """``{phase: (FLOPs, bytes allocated)}`` of one micro-batch's ``"forward"`` and ``"backward"`` of ``step``
    (``step_traffic``, by phase: communication overlaps each phase on its own)."""
    micro = _micro_batches(trace, step)
    allocated = dict.fromkeys(_PHASES, 0)
    for phase, sid in _forward_backward_allocations(trace, step):
        allocated[phase] += trace.nbytes[sid]
    return {p: (sum(n for (ph, s), n in trace.flops.items() if s == step and ph == p) // micro,
                allocated[p] // micro) for p in _PHASES}  # fmt: skip


_PHASES = ("forward", "backward")


def _micro_batches(trace: Any, step: int) -> int:
    return max(1, sum(1 for _, name, s in trace.phases if s == step and name == "forward"))


def _forward_backward_allocations(trace: Any, step: int) -> Any:
    """``(phase, storage id)`` of each allocation in the forward and backward phases of ``step``, in order."""
    phase = ""
    bounds = [(start, name, s) for start, name, s in trace.phases]
    k = 0
    for i, e in enumerate(trace.events):
        while k < len(bounds) and bounds[k][0] <= i:
            phase = bounds[k][1] if bounds[k][2] == step else ""
            k += 1
        if e >= 0 and phase in _PHASES:
            yield phase, e


def predict_step_time(
    trace: Any,
    device: Any,
    *,
    precision: str,
    micro_batches: int,
    gpus: int = 1,
    sharded: bool = False,
    interconnect: Interconnect | str = Interconnect.nvlink,
    state_bytes: tuple[int, int, int] = (0, 0, 0),
    tensor_parallel: int = 1,
) -> StepTime:
    """The predicted time of one optimizer step (see NOTE [ A time model to rank configurations ]).

    Args:
        trace: the traced step of one micro-batch in this configuration (one rank's: unsharded under
            FSDP alone, the rank of its layout under tensor parallelism).
        micro_batches: micro-batches per optimizer step on the busiest rank.
        state_bytes: ``(parameters, gradients, optimizer states)`` of the whole model, in bytes.
        tensor_parallel: GPUs of one tensor-parallel group (the trace is then one of its ranks).
    """
    peak, bandwidth = _peak_flops(device, precision), _bandwidth(device)
    phases = {p: (f / (peak * MATMUL_EFFICIENCY), 2 * b / (bandwidth * BANDWIDTH_EFFICIENCY))
              for p, (f, b) in phase_traffic(trace).items()}  # fmt: skip
    compute = micro_batches * sum(c for c, _ in phases.values())
    memory = micro_batches * sum(m for _, m in phases.values())
    forward, backward = (sum(phases[p]) for p in _PHASES)  # seconds of one micro-batch's phase on the GPU
    params, grads, states = state_bytes
    tp = max(1, tensor_parallel)
    groups = gpus // tp  # the data-parallel ranks
    shards = (groups if sharded else 1) * tp
    optimizer = (2 * params + 2 * grads + 2 * states) / shards / (bandwidth * BANDWIDTH_EFFICIENCY)
    link = link_gbps(device, interconnect) * 1e9
    comm = 0.0
    if groups > 1:  # NOTE [ Communication behind compute ]
        share = (groups - 1) / groups
        if sharded:
            gather, scatter = share * params / tp / link, share * grads / tp / link
            comm = micro_batches * (_exposed(gather, forward) + _exposed(gather + scatter, backward))
        else:
            comm = _exposed(2 * share * grads / tp / link, backward)
    if tp > 1:
        comm += micro_batches * tensor_parallel_bytes(trace, tp) / (link_gbps(device, Interconnect.nvlink) * 1e9)
    return StepTime(compute, memory, optimizer, comm)


def _exposed(communication_s: float, behind_s: float) -> float:
    """Seconds of ``communication_s`` left after the ``behind_s`` of compute it runs beside."""
    return max(0.0, communication_s - behind_s)


_TP_TRAFFIC = (
    ("_c10d_functional.all_reduce", lambda n: 2 * (n - 1) / n),
    ("_c10d_functional.all_gather_into_tensor", lambda n: (n - 1) / n),
    ("_c10d_functional.reduce_scatter_tensor", lambda n: n - 1),
)
"""Bytes a rank sends per output byte of each traced collective of a group of ``n`` (ring algorithms)."""


def tensor_parallel_bytes(trace: Any, tensor_parallel: int, step: int = 1) -> float:
    """Bytes one rank sends in the traced collectives of one micro-batch's forward and backward (the
    functional collectives DTensor runs; FSDP's own are counted from the state bytes)."""
    sent = 0.0
    for _, sid in _forward_backward_allocations(trace, step):
        op = trace.op.get(sid, "")
        for prefix, factor in _TP_TRAFFIC:
            if op.startswith(prefix):
                sent += trace.nbytes[sid] * factor(tensor_parallel)
                break
    return sent / _micro_batches(trace, step)
