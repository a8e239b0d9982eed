"""What one optimizer step did: ``StepResult``, and the ``Replan`` records of its out-of-memory re-splits.

Plain frozen values for logs, progress bars and JSON, in their own module so that the accumulator (which
makes results) and the recovery (which makes re-plans) need not import each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Replan:
    """One re-plan after an out-of-memory error, as reported in ``StepResult.replanned`` and the log."""

    from_micro_batch_size: int
    """Size of the micro-batch that ran out of memory."""
    to_micro_batch_size: int
    """The micro-batch size used from then on: half the one in effect (half the failing micro-batch if
    that was a remainder no larger than the half)."""
    phase: str
    """``"forward"`` (the window continued) or ``"backward"`` (the window was discarded and redone)."""
    at_item: int
    """Position in this rank's share of the first item of the failing micro-batch."""
    redone_items: int
    """Items whose finished gradients were discarded and computed again (backward phase only)."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, for logs, progress bars and JSON."""

    loss: float
    """The global batch's loss: the sum of every item's (token's) loss over all ranks, divided by ``n_items``."""
    n_items: int
    """The divisor of ``loss``: items (mean losses) or loss-carrying tokens (token losses), over all ranks."""
    micro_batch_size: int
    """The micro-batch size in effect at the end of the step (smaller than at its start after an OOM)."""
    accumulation_steps: int
    """Micro-batches whose gradients make up this step on this rank."""
    micro_batch_sizes: tuple[int, ...]
    """Their sizes, in order (this rank)."""
    grad_norm: float | None = None
    """Total gradient norm before clipping (None without ``max_grad_norm``)."""
    skipped: bool = False
    """True when the fp16 ``GradScaler`` found inf/NaN gradients and skipped the optimizer step."""
    replanned: tuple[Replan, ...] = field(default=())
    """Re-plans after out-of-memory errors during this step (see ``batchfit.train.oom_resplit``)."""
    step: int = 0
    """Index of this optimizer step, from 0."""
    noise_scale: float | None = None
    """The gradient noise scale ``B_simple`` measured so far (None while off or not yet resolved)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        out = asdict(self)
        out["micro_batch_sizes"] = list(self.micro_batch_sizes)
        out["replanned"] = [asdict(r) for r in self.replanned]
        return out
