"""The largest micro-batch that fits: two traces draw the line, the allocator model searches it,
two more traces verify. No crash, and on a modelled device the answer is exact:
``estimate(b).device_total_bytes <= capacity < estimate(b + 1).device_total_bytes``.

Other tools find a batch size by crashing: doubling then bisecting (about ``2 log2 N`` real steps) or
shrinking by 10% after every OOM. Here memory is known as a function of the batch size
(``memory/synthesis/scaling.py``), so the search costs replays of the allocator model, not steps. The search
itself is ``planning/search.py``; this module picks the device, the budget and the means of verification,
and reports the result. ``maximize="seq_len"`` asks the other question, the longest sequence at a given
batch, which ``planning/seqlen.py`` answers the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..activation_checkpointing import Checkpointing
from ..errors import ConfigError
from ..gpu.catalog import Device
from ..memory.cache import CACHE
from ..memory.estimate import allocator_tie_order
from ..runtime.simulated import SimulatedDevice
from ..sources import as_workload
from ..workload import AUTO, ParallelLayout, Setup, Workload
from .budget import device_budget, fit_setting, is_modelled, real_step
from .known_error import errors_key, keep_known_errors
from .partial import with_fewest_blocks
from .search import _MAX_BATCH, FitAttempt, FitResult, _Search, _search_max, expandable_gain
from .seqlen import check_seq_request, fit_seq_len

__all__ = ["FitAttempt", "FitResult", "fit"]

def fit(
    workload: Workload | str,
    device: str | Device | SimulatedDevice,
    *,
    setup: Setup | None = None,
    precision: str | None = None,
    checkpointing: Checkpointing = None,
    margin: float = 0.0,
    expandable_segments: bool | None = None,
    shard_over: int = 1,
    verify: bool = True,
    accumulation_steps: int | None = None,
    parallel: ParallelLayout | None = None,
    max_batch_size: int | None = None,
    maximize: str = "batch_size",
    batch_size: int | None = None,
    seq_multiple: int = 1,
    progress: Callable[[str], None] | None = None,
    known_error: bool | None = None,
) -> FitResult:
    """The largest micro-batch of ``workload`` that fits on ``device``, or the longest sequence at a batch.

    Args:
        workload: a ``Workload`` or a preset name.
        device: a catalog GPU or capacity (traced, exact against the allocator model), a
            ``SimulatedDevice`` (traced search, verified with real steps inside it), or ``"cuda"``
            (traced search, verified with real steps on the GPU).
        setup: how the step is run (``batchfit.Setup``); None: ``Setup()``. Each of ``precision``,
            ``checkpointing``, ``expandable_segments``, ``accumulation_steps`` and ``parallel`` that is given
            (not None) replaces that field of it.
        precision: ``fp32``, ``bf16``, ``fp16``, ``bf16-true`` or ``bf16-true-autocast``.
        checkpointing: None, ``"blocks"``, a list of module classes, a number of blocks or block indices,
            ``"selective"``, or ``"auto"``: the largest micro-batch with every block checkpointed, then the
            fewest first blocks (or none) that micro-batch needs (``FitResult.checkpointed_blocks``).
        margin: fraction of the device's memory to leave free (0.1 keeps 10% in reserve).
        expandable_segments: model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        shard_over: fit one rank of FSDP over this many GPUs (``memory/synthesis/sharding.py``).
        verify: trace (or run) the answer and its successor to confirm it; False trusts the line
            drawn through two traces (two trials instead of four; used for a plan's alternatives).
        accumulation_steps: micro-batches per optimizer step (None: the workload's, 1 by default);
            above 1, the micro-batch must fit with the earlier micro-batches' gradients alive.
        parallel: a ``ParallelLayout``: fit one rank of it (None: the workload's own).
        max_batch_size: look no further than this (a plan needs no micro-batch above a rank's share);
            ``FitResult.capped`` then says the search stopped there. With ``checkpointing="auto"``, the
            micro-batch you want: the fewest blocks at which it (or the largest below it that fits) fits.
        maximize: ``"batch_size"`` (the largest micro-batch) or ``"seq_len"``: the longest sequence
            that fits at ``batch_size`` (``FitResult.max_seq_len``), for a workload that can be rebuilt
            at another length (``Workload.at_seq_len``: presets with a ``seq_len``, hub models).
        batch_size: the batch the sequence is fitted at (``maximize="seq_len"`` only).
        seq_multiple: with ``maximize="seq_len"``, only lengths that are multiples of this (64 or 128
            for kernels that want them); the answer ``L`` fits and ``L + seq_multiple`` does not.
        progress: called with a short description before each traced step (for a progress display).
        known_error: keep the measured error of the model's family free on a modelled GPU (below); False
            fits the allocator model's answer alone; None: yes, unless ``BATCHFIT_KNOWN_ERRORS=0``.

    A modelled GPU's budget also keeps free the measured error of the model's family, where real GPUs
    showed the estimate to be low (a recurrent network's cuDNN workspace): ``FitResult.known_error`` says
    what was kept and why (NOTE [ Keeping a measured error free ] in ``planning/known_error.py``).

    Raises:
        ConfigError: a device without a capacity (the cpu), a margin outside [0, 1), or a sequence
            search on a workload without a sequence (or without ``batch_size``).
        DoesNotFitError: not even one item fits (with ``maximize="seq_len"``: not even the shortest
            sequence at ``batch_size``); the message names the remedies.

    Example:
        >>> import batchfit
        >>> r = batchfit.fit("mlp", "2GiB")
        >>> r.estimate.device_total_bytes <= r.capacity_bytes
        True
    """
    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"margin must be in [0, 1), got {margin}; e.g. 0.1 to keep 10% free")
    workload = as_workload(workload)
    setup = Setup.of(setup, precision=precision, checkpointing=checkpointing, expandable_segments=expandable_segments,
                     accumulation_steps=accumulation_steps, parallel=parallel)  # fmt: skip
    choose_blocks = setup.checkpointing == AUTO
    if choose_blocks:
        if not is_modelled(device):
            raise ConfigError("checkpointing='auto' chooses the blocks from traced steps on a modelled GPU (a catalog "
                              "name or a capacity); with a simulated device or cuda give checkpointing='blocks' or a "
                              "number of blocks")  # fmt: skip
        setup = setup.with_fields(checkpointing="blocks")
    setup = setup.concrete("a fit")
    workload = setup.workload(workload)
    seq = check_seq_request(workload, maximize, batch_size, seq_multiple, max_batch_size)
    known_error = keep_known_errors(known_error)

    def run() -> FitResult:
        if seq:
            return fit_seq_len(workload, device, batch_size, seq_multiple, setup, margin, shard_over, verify,  # type: ignore[arg-type]
                               progress, known_error)  # fmt: skip
        return _fit(workload, device, setup, margin, shard_over, verify, max_batch_size, progress, known_error)

    if not is_modelled(device):
        return run()
    # A modelled device: the answer is a function of the workload and these settings alone.

    dev = device_budget(device, margin)[0]  # type: ignore[arg-type]
    policy = setup.policy(dev)
    settings: tuple[Any, ...] = (setup.key(workload), margin, shard_over, verify, max_batch_size,
                                 errors_key(known_error), allocator_tie_order())  # fmt: skip
    if seq:  # the answer depends on how the workload is rebuilt at each length
        settings += ("seq_len", batch_size, seq_multiple, workload.at_seq_len, workload.max_seq_len)
    result = CACHE.device_fact("fit", workload, dev, policy.param_dtype, run, extra=settings)
    if choose_blocks:  # NOTE [ Checkpointing only what the micro-batch needs ] in planning/partial.py
        result = with_fewest_blocks(result, workload, dev, setup, shard_over, progress)
    return result


def _fit(
    workload: Workload,
    device: str | Device | SimulatedDevice,
    setup: Setup,
    margin: float,
    shard_over: int,
    verify: bool,
    max_batch_size: int | None,
    progress: Callable[[str], None] | None,
    known_error: bool = True,
) -> FitResult:
    dev, budget, policy, classes = fit_setting(workload, device, margin, setup)
    step = real_step(device, budget, policy, classes)
    search = _Search(workload, dev, policy, classes, budget, expandable_segments=setup.expandable_segments,
                     reserved_only=isinstance(device, SimulatedDevice), shard_over=shard_over,
                     keep_known_error=known_error and step is None)  # fmt: skip
    search.progress = progress

    def verify_traced(b: int) -> bool:
        return search.fits(search.traced(b))

    def trust_line(b: int) -> bool:
        if search.line is None or b in search.estimates:
            return verify_traced(b)
        return search.predicted_fits(search.line, b)

    def verify_real(b: int) -> bool:
        return search.real(b, step)  # type: ignore[arg-type]

    cap = _MAX_BATCH if max_batch_size is None else max(1, int(max_batch_size))
    best = _search_max(search, verify_real if step is not None else (verify_traced if verify else trust_line), cap)
    est = search.estimates.get(best)
    if est is None:  # verified by real steps: report the line's prediction rather than trace again
        est = search.predicted_estimate(search.line, best) if search.line is not None else search.traced(best)
    expandable = None if step is not None else expandable_gain(search, best, cap)
    return search.result(est, max_batch_size=best, line=search.line, traces=dict(search.traces), capped=best == cap,
                         expandable_max_batch_size=expandable)  # fmt: skip
