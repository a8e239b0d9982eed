"""The gradient noise scale: past which global batch a larger one stops buying fewer steps.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training") model the steps ``S`` and
examples ``E`` needed to reach a loss with a batch ``B`` as ``S = S_min (1 + B_noise / B)`` and
``E = E_min (1 + B / B_noise)``. Below the noise scale ``B_noise`` a larger batch cuts steps almost
proportionally; above it, it mostly costs compute. Its simple form ``B_simple = tr(Σ) / |G|²`` (the
per-example gradient covariance's trace over the squared true gradient) is measurable from two
gradient norms at two batch sizes, because ``E[|G_B|²] = |G|² + tr(Σ) / B``.

Gradient accumulation has both for free: the gradient after a window's first micro-batch is a
small-batch gradient, the gradient after the window the large-batch one. ``GradientNoiseScale``
turns the two squared norms into the paper's unbiased estimates (its appendix A),

    |G|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1 / B_small - 1 / B_big)

smooths each with an exponential moving average (a single step's estimate is very noisy; the ratio of
averages is far steadier than the average of ratios), and reports ``B_simple`` and advice.

Example:
    >>> from batchfit.advice.noise_scale import GradientNoiseScale
    >>> gns = GradientNoiseScale(ema_decay=0.0)  # no smoothing, to show the arithmetic
    >>> gns.update(small_sq_norm=3.0, small_batch=8, big_sq_norm=1.25, big_batch=64)
    True
    >>> round(gns.g_sq, 6), round(gns.trace_sigma, 6), round(gns.b_simple, 6)
    (1.0, 16.0, 16.0)

Limitations:
    * ``B_simple`` equals the noise scale ``B_noise`` only when the Hessian is close to a multiple of
      the identity (the paper's simplifying assumption); the paper finds it a good guide to the
      critical batch within a small factor. It grows as the loss falls, so measure it during
      training, not once.
    * ``B_simple`` assumes plain SGD (the paper's ``B_noise`` weights the noise by the Hessian,
      ``B_simple`` by the identity); momentum and Adam's preconditioning are not modelled, so for
      them it marks where returns diminish rather than an exact critical batch.
    * Squared norms of bf16/fp16 gradients are computed in the gradients' dtype (no copy is made), so
      they carry that dtype's rounding (~0.4% for bf16), which matters only when the two norms are
      within a percent of each other (a noise scale far below the small batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..batching import check_batch_size
from ..errors import ConfigError

#: Below this ratio of global batch to noise scale, steps are noise-dominated (advice: larger batch).
SMALL_RATIO = 0.5
#: Above this ratio, most of each step's examples buy no progress (advice: smaller batch).
LARGE_RATIO = 2.0


def grad_sq_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum |p.grad|²`` over ``parameters``, as a float64 0-d tensor on the first gradient's device.

    One reduction per parameter (``torch.linalg.vector_norm`` in the gradient's own dtype, so no
    gradient is copied or cast: a cast would copy it), squared and summed in float64. Nothing is read
    back to the host: the caller reads the result when it reads the step's other numbers. Parameters
    without a gradient are skipped; with none at all the result is a CPU zero.
    """
    total: torch.Tensor | None = None
    with torch.no_grad():  # gradients made with create_graph=True must not grow the graph here
        for p in parameters:
            g = p.grad
            if g is None:
                continue
            local = getattr(g, "to_local", None)
            if callable(local):  # a sharded (DTensor) gradient: this rank's slice; the caller sums over ranks
                g = local()
            if g.is_sparse:
                g = g.coalesce().values()
            sq = torch.linalg.vector_norm(g).to(torch.float64).square()  # 0-d
            total = sq if total is None else total + sq.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def _as_float(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"{what} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number, got {type(value).__name__}")
    return float(value)


class GradientNoiseScale:
    """Running estimate of the gradient noise scale ``B_simple`` from small- and large-batch gradient norms.

    Feed it once per optimizer step with ``update``. Each of ``|G|²`` and ``tr(Σ)`` is an exponential
    moving average with bias correction (as Adam's moments), so early values are not pulled to 0.

    Args:
        ema_decay: weight of the past in each moving average, in ``[0, 1)``; 0.99 averages over about
            the last 100 steps. 0 keeps only the last step.

    Raises:
        ConfigError: ``ema_decay`` outside ``[0, 1)``.
    """

    def __init__(self, ema_decay: float = 0.99) -> None:
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in [0, 1), got {ema_decay!r}; e.g. 0.99 (about 100 steps)")
        self.ema_decay = float(ema_decay)
        self.steps = 0
        """Updates accepted so far (non-finite ones are not counted)."""
        self._g_sq = 0.0  # raw moving averages, before bias correction
        self._trace = 0.0

    def update(self, small_sq_norm: Any, small_batch: int, big_sq_norm: Any, big_batch: int) -> bool:
        """Add one step's measurement.

        Args:
            small_sq_norm: ``|G_small|²`` of the *mean* gradient over ``small_batch`` items.
            small_batch: items (or loss-carrying tokens) behind ``small_sq_norm``.
            big_sq_norm: ``|G_big|²`` of the mean gradient over ``big_batch`` items.
            big_batch: items behind ``big_sq_norm``; more than ``small_batch``.

        Returns:
            False when the measurement was ignored because a norm is inf or NaN (an fp16 step the
            ``GradScaler`` skipped), True otherwise.

        Raises:
            ConfigError: batch sizes that are not ``1 <= small_batch < big_batch``, or a negative norm.
        """
        for what, b in (("small_batch", small_batch), ("big_batch", big_batch)):
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not b >= 1:
                raise ConfigError(f"{what} must be >= 1, got {b!r}")
        if not small_batch < big_batch:
            raise ConfigError(
                f"small_batch ({small_batch}) must be smaller than big_batch ({big_batch}): the noise scale needs "
                "gradients at two batch sizes, e.g. a window's first micro-batch and the whole window"
            )
        small = _as_float(small_sq_norm, "small_sq_norm")
        big = _as_float(big_sq_norm, "big_sq_norm")
        if not (math.isfinite(small) and math.isfinite(big)):
            return False
        if small < 0 or big < 0:
            raise ConfigError(f"squared norms cannot be negative, got {small} and {big}")
        # McCandlish et al. 2018, appendix A: unbiased estimates, since E|G_B|² = |G|² + tr(Σ)/B.
        g_sq = (big_batch * big - small_batch * small) / (big_batch - small_batch)
        trace = (small - big) / (1.0 / small_batch - 1.0 / big_batch)
        d = self.ema_decay
        self._g_sq = d * self._g_sq + (1 - d) * g_sq
        self._trace = d * self._trace + (1 - d) * trace
        self.steps += 1
        return True

    def _corrected(self, raw: float) -> float | None:
        if self.steps == 0:
            return None
        return raw / (1.0 - self.ema_decay**self.steps)

    @property
    def g_sq(self) -> float | None:
        """Smoothed estimate of ``|G|²``, the true gradient's squared norm (None before any update)."""
        return self._corrected(self._g_sq)

    @property
    def trace_sigma(self) -> float | None:
        """Smoothed estimate of ``tr(Σ)``, the per-example gradient variance summed over parameters."""
        return self._corrected(self._trace)

    @property
    def b_simple(self) -> float | None:
        """``tr(Σ) / |G|²``: the batch at which gradient noise equals signal (None until resolvable).

        None before any update, and while the smoothed ``|G|²`` is not positive: the signal is still
        below the measurement noise, which means the noise scale is far above the batches measured.
        """
        g_sq, trace = self.g_sq, self.trace_sigma
        if g_sq is None or trace is None or g_sq <= 0 or trace < 0:
            return None
        return trace / g_sq

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON and logs."""
        return {"b_simple": self.b_simple, "g_sq": self.g_sq, "trace_sigma": self.trace_sigma, "steps": self.steps}

    def recommendation(self, global_batch_size: int) -> str:
        """What the measured noise scale says about ``global_batch_size``, why, and what to change.

        Raises:
            ConfigError: a global batch size below 1.
        """
        check_batch_size(global_batch_size, "global_batch_size")
        g = global_batch_size
        if self.steps == 0:
            return (
                "gradient noise scale: not measured yet; it needs optimizer steps with at least two micro-batches "
                "(a small and a large gradient) and finite gradients; nothing to change yet"
            )
        b = self.b_simple
        if b is None:
            return (
                f"gradient noise scale: not resolved after {self.steps} steps: the small- and large-batch gradient "
                "norms differ by less than their own noise, which happens when the noise scale is far above the "
                f"batches measured, so the critical batch is probably well above your global batch of {g}; a larger "
                "global batch would still cut the steps nearly in proportion; keep measuring before changing it"
            )
        ratio = g / b
        steps_vs_min = 1 + 1 / ratio  # S / S_min at this batch (the model in the module docstring)
        examples_vs_min = 1 + ratio  # E / E_min
        observed = (
            f"your global batch of {g} is {ratio:.2g}x the critical batch (gradient noise scale B_simple ~ {b:.4g}, "
            f"averaged over {self.steps} steps)"
        )
        suggested = max(1, round(b))
        if ratio > LARGE_RATIO:
            return (
                f"{observed}: past the critical batch a larger batch buys few fewer steps (steps = S_min x "
                f"{steps_vs_min:.2f}, examples = E_min x {examples_vs_min:.2g}; at the critical batch both are x2), "
                f"so about {100 * (1 - 2 / examples_vs_min):.0f}% of each step's compute buys no progress; use a "
                f"global batch near {suggested} (--global-batch-size {suggested}) with the learning rate scaled to it "
                "(batchfit.scale_lr), unless wall-clock time matters more than compute; the noise scale grows as "
                "the loss falls, so re-check later in training"
            )
        if ratio < SMALL_RATIO:
            return (
                f"{observed}: steps are dominated by gradient noise (steps = S_min x {steps_vs_min:.2g}), so a larger "
                f"global batch, up to about {suggested}, would cut the number of steps almost in proportion at "
                f"little extra compute; raise --global-batch-size towards {suggested} (more accumulation steps or "
                "GPUs make it fit) and scale the learning rate with batchfit.scale_lr"
            )
        return (
            f"{observed}: near the critical batch, the balance of steps (S_min x {steps_vs_min:.2f}) against "
            f"compute (E_min x {examples_vs_min:.2f}) that McCandlish et al. recommend; keep it, and re-check as "
            "the loss falls (the noise scale grows during training)"
        )
