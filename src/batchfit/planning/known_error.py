"""What fit keeps free for a family of models whose estimates real GPUs measured too low.

NOTE [ Keeping a measured error free ]
The estimator is exact on the CPU; on a GPU, kernels it does not model yet can allocate more than it
says. Where real training steps showed that for a family of models (``benchmarks/results``: the allocated
peak above the estimate, which no cache release can give back near the capacity), a fit for a GPU keeps
that family's largest measured shortfall free, so that its answer runs, and says so. The shortfall is
the allocated peak's where the missing memory can share what the allocator holds: near the capacity the
allocator releases its cache, and the real step ran where the fit said (the CNNs capped at 8 GiB on an
H200 ran at fit's answer and the next batch, with their reserved peaks estimated up to 32% low at the full
GPU). It is the reserved peak's where the missing memory is a large transient that takes segments of its
own (``KnownError.peak``; no family keeps one today: cuDNN's LSTM workspace, which made a capped bidirectional
LSTM run out of memory at fit's answer while its allocated shortfall was kept free, is modelled now). It is the
smallest capacity's where the recorded streams say so directly: replayed at decreasing capacities
(``benchmarks/capacity_need.py``), a QLoRA step's own stream needed up to 7.8% more than its trace, while its
allocated peak was exact and its reserved peak 2.3% low, because the GPU's cache was cut into smaller free
blocks than the trace's; a fit that kept nothing would answer, below some capacities, a batch that does not run
there. A step that ran out of memory at a capacity its trace completes in bounds that shortfall from below (the
GPU needed more than the capacity): transformers' ResNet-50 at 3,300 images on a whole H200, 0.60%. A
convolutional network's own stream cannot measure it the other way, since replayed below the capacity it ran in
a fixed stream cannot fall back to a cheaper cuDNN engine as the GPU does. A family without such a measurement
keeps nothing, and a fit verified by real steps (``fit(..., "cuda")``, a simulated device) needs none. The
figures are the measured rows' own, estimated again with this code: when the estimator improves,
``tests/test_gpu_truth_rows.py`` fails until the figure here is the rows' new one.

``BATCHFIT_KNOWN_ERRORS=0`` (or ``fit(..., known_error=False)``) turns it off: the answer is then the
allocator model's alone, exact against ``estimate`` (which is how the search itself is tested).

The family is read off the trace, so that a user's own model is placed as a preset is: which kernels the
step runs (a recurrent layer, ``nn.LSTM`` / ``GRU`` / ``RNN``; a convolution; attention), and whether it
trains only a small part of its weights (adapters such as LoRA, or a frozen backbone: gradients under a
tenth of the parameters' bytes), and whether its base weights are bitsandbytes' 4-bit ones (QLoRA). Adapters
are a family of their own, measured apart (their rows on an H100 and an H200 were not low), and they decide
for the step they are in, unless its weights are 4-bit, which decide then; otherwise the largest error among
the step's families is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.categories import Category
from ..memory.trace.fake_step import MemoryTrace
from ..units import format_bytes


@dataclass(frozen=True)
class KnownError:
    """The largest shortfall of the estimate measured for one family of models on a GPU."""

    family: str
    fraction: float
    """Measured (real - estimate) / real of the ``peak``, for the row where it is largest."""
    evidence: str
    """The rows behind it, in words."""
    peak: str = "allocated"
    """Which measured peak's shortfall is kept: ``allocated``, ``reserved`` where a real step capped at a fit's
    answer ran out of memory with the allocated shortfall kept, or ``capacity`` (the smallest capacity the step
    completes in) where the recorded streams show the GPU needing more than the trace at the same allocated peak
    (NOTE [ Keeping a measured error free ])."""

    def describe(self, kept_bytes: int) -> str:
        """One line: what is kept free and why."""
        return (f"kept {format_bytes(kept_bytes)} ({100 * self.fraction:.3g}% of the budget) free for {self.family} "
                f"layers: {self.evidence}")  # fmt: skip


KNOWN_ERRORS = {
    "recurrent": KnownError(
        "recurrent", 0.0203,
        "a 2-layer bidirectional LSTM (fp32, batch 64) needed 2.03% more capacity on an H200 than its trace: replayed "
        "at decreasing capacities, the GPU's allocator stream ran out of memory first (cuDNN's RNN workspace is "
        "modelled from 975 recorded problems, to the byte for most LSTMs)",
        peak="capacity",
    ),
    "attention": KnownError(
        "attention", 0.0004, "a Mixtral-shaped mixture of experts (bf16 autocast, batch 8) allocated 0.04% more on an "
        "H200 than estimated"
    ),
    "convolutional": KnownError(
        "convolutional", 0.005955,
        "transformers' ResNet-50 (bf16, 3,300 images) ran out of memory on a whole H200 whose capacity its trace "
        "completes in with 0.60% to spare (cuDNN's engines take workspaces the model does not know of)",
        peak="capacity",
    ),
    "4-bit": KnownError(
        "4-bit", 0.0780,
        "a QLoRA step (Llama-3.1-8B's layers, nf4, batch 8 x 2048 tokens) needed 7.8% more capacity on an H200 "
        "than its trace: replayed at decreasing capacities, the GPU's allocator stream ran out of memory first",
        peak="capacity",
    ),
}  # fmt: skip
"""Per family, the measurement (``benchmarks/results/gpu_truth-*.csv``, ``tests/test_gpu_truth_rows.py``)."""

_FAMILY_OPS = (
    ("4-bit", ("gemm_4bit", "dequantize_4bit")),
    ("recurrent", ("rnn", "lstm", "gru")),
    ("convolutional", ("convolution",)),
    ("attention", ("scaled_dot_product", "aten._softmax.", "aten._safe_softmax.")),
)
"""Which op names place a step in a family (any op containing one of the words; ``aten._softmax.`` is an
attention's softmax, not the ``_log_softmax`` of a cross-entropy; ``aten._safe_softmax.`` is the softmax of
attention's math path, which a trace runs for a CUDA GPU where no fused kernel takes the call)."""


def keep_known_errors(asked: bool | None) -> bool:
    """Whether a fit keeps the measured errors free: as asked, else unless ``BATCHFIT_KNOWN_ERRORS=0``."""
    import os

    return asked if asked is not None else os.environ.get("BATCHFIT_KNOWN_ERRORS", "1") != "0"


def errors_key(asked: bool | None = None) -> tuple[tuple[str, float], ...] | bool:
    """What the measured errors add to the key of a cached fit (``fit``'s, and a plan's configurations'): the figures
    in force where they are kept free (``keep_known_errors(asked)``), False where they are not."""
    if not keep_known_errors(asked):
        return False
    return tuple(sorted((family, known.fraction) for family, known in KNOWN_ERRORS.items()))


ADAPTER_GRADIENTS = 0.1
"""A step whose gradients hold less than this share of its parameters' bytes trains adapters."""


def families(trace: MemoryTrace) -> set[str]:
    """The families of the traced step: the kernels it runs, and ``adapters`` when it trains little."""
    ops = {op.lower() for op in set(trace.op.values())}
    found = {family for family, words in _FAMILY_OPS if any(word in op for op in ops for word in words)}
    held = {Category.PARAMETERS: 0, Category.GRADIENTS: 0}
    for sid, role in trace.role.items():
        if role in held:
            held[role] += trace.nbytes[sid]
    if held[Category.PARAMETERS] and held[Category.GRADIENTS] < ADAPTER_GRADIENTS * held[Category.PARAMETERS]:
        found.add("adapters")
    return found


def known_error_for(trace: MemoryTrace) -> KnownError | None:
    """The measured error of ``trace``'s step (None: no measured shortfall): its 4-bit weights' when it has
    them, the adapters' when it trains adapters, else the largest among its families."""
    found = families(trace)
    if "4-bit" in found:
        return KNOWN_ERRORS["4-bit"]
    if "adapters" in found:
        return KNOWN_ERRORS.get("adapters")
    return max((KNOWN_ERRORS[f] for f in found if f in KNOWN_ERRORS), key=lambda k: k.fraction, default=None)
