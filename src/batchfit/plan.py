"""Any global batch, exactly: micro-batch x accumulation steps x GPUs, and the remedies when even
one item does not fit.

The invariant, stated once: for every optimizer step,
``sum(splits[rank]) over ranks == global_batch_size``, and every micro-batch is at most the fitted
maximum. Ranks' shares differ by at most one item when the global batch does not divide by the GPU
count, and a share that does not divide by the micro-batch is split into near-equal pieces: the
trainer weights every micro-batch by its item count, so any split is the same gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .batching import make_splits, rank_shares
from .devices import Device, catalog, get_device
from .errors import ConfigError, DoesNotFitError
from .fit import FitResult, fit
from .memory.estimate import Estimate, _as_workload, with_accumulation


@dataclass(frozen=True)
class PlanOption:
    """One configuration of the remedies ladder and what it allows."""

    precision: str
    checkpointing: bool
    sharded: bool
    max_micro_batch_size: int
    """0 when not even one item fits."""
    micro_batch_size: int
    accumulation_steps: int
    device_total_bytes: int | None
    """At ``micro_batch_size`` (None when it does not fit)."""
    headroom_bytes: int | None
    remedies: tuple[str, ...]
    """What this configuration changes from plain fp32 DDP, in ladder order."""


@dataclass(frozen=True)
class Plan:
    """How to train ``global_batch_size`` items per optimizer step on ``gpus`` GPUs of ``device``."""

    global_batch_size: int
    gpus: int
    device: str
    micro_batch_size: int
    """The largest micro-batch any rank runs."""
    accumulation_steps: int
    """Micro-batches per optimizer step on the busiest rank."""
    precision: str
    checkpointing: bool
    sharded: bool
    """Parameters, gradients and optimizer states sharded across GPUs (FSDP)."""
    splits: list[list[int]]
    """For each rank, the micro-batch sizes of one optimizer step (they sum to the global batch)."""
    max_micro_batch_size: int
    estimate: Estimate
    """Per GPU, at ``micro_batch_size``."""
    headroom_bytes: int
    items_per_step: int
    tokens_per_step: int | None
    remedies: tuple[str, ...]
    alternatives: tuple[PlanOption, ...] = field(default=())
    """The other viable configurations, best first."""
    warnings: tuple[str, ...] = field(default=())
    scaled_lr: float | None = None
    """The learning rate for ``global_batch_size``, scaled from ``base_lr`` (None: no reference was given)."""
    lr_rule: str | None = None
    """The rule that scaled it: ``"linear"`` (SGD-type) or ``"sqrt"`` (Adam-type); see ``batchfit.advice.lr``."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with every field (the estimate and alternatives as dicts)."""
        return {
            "global_batch_size": self.global_batch_size,
            "gpus": self.gpus,
            "device": self.device,
            "micro_batch_size": self.micro_batch_size,
            "accumulation_steps": self.accumulation_steps,
            "precision": self.precision,
            "checkpointing": self.checkpointing,
            "sharded": self.sharded,
            "splits": self.splits,
            "max_micro_batch_size": self.max_micro_batch_size,
            "estimate": self.estimate.to_dict(),
            "headroom_bytes": self.headroom_bytes,
            "items_per_step": self.items_per_step,
            "tokens_per_step": self.tokens_per_step,
            "remedies": list(self.remedies),
            "alternatives": [o.__dict__ for o in self.alternatives],
            "warnings": list(self.warnings),
            "scaled_lr": self.scaled_lr,
            "lr_rule": self.lr_rule,
        }


# -- the ladder -------------------------------------------------------------------------------
def _ladder(
    device: Device, gpus: int, precision: str | None, checkpointing: Any, has_blocks: bool
) -> list[tuple[str, Any, bool, tuple[str, ...]]]:
    low = "bf16" if device.bf16 else "fp16"
    rungs: list[tuple[str, Any, bool, tuple[str, ...]]] = [("fp32", None, False, ())]
    rungs.append((low, None, False, (f"{low} autocast",)))
    if has_blocks:
        rungs.append((low, "blocks", False, (f"{low} autocast", "activation checkpointing")))
    if device.bf16:
        ck = "blocks" if has_blocks else None
        remedies = ("bf16 weights and optimizer states",) + (("activation checkpointing",) if ck else ())
        rungs.append(("bf16-true", ck, False, remedies))
    if gpus > 1:
        best_precision, best_ck = rungs[-1][0], rungs[-1][1]
        rungs.append((best_precision, best_ck, True, rungs[-1][3] + ("FSDP sharding",)))
    if precision is not None:
        rungs = [r for r in rungs if r[0] == precision] or [(precision, checkpointing, False, ())]
    if checkpointing is not None:
        rungs = [(p, checkpointing, sh, rem) for p, _, sh, rem in rungs]
        seen = []
        for r in rungs:
            if r[:3] not in [x[:3] for x in seen]:
                seen.append(r)
        rungs = seen
    return rungs


def _validate(global_batch_size: Any, gpus: Any) -> None:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"the global batch size must be a whole number >= 1, got {global_batch_size!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"the number of GPUs must be a whole number >= 1, got {gpus!r}")
    if global_batch_size < gpus:
        raise ConfigError(
            f"a global batch of {global_batch_size} cannot give each of {gpus} GPUs an item; "
            f"use --global-batch-size >= {gpus} or fewer GPUs"
        )


def plan(
    workload: Any,
    global_batch_size: int,
    *,
    device: str | Device,
    gpus: int = 1,
    precision: str | None = None,
    checkpointing: Any = None,
    margin: float = 0.0,
    base_lr: float | None = None,
    base_batch_size: int | None = None,
    lr_rule: str = "auto",
) -> Plan:
    """Plan ``global_batch_size`` items per optimizer step on ``gpus`` GPUs of ``device``.

    With ``precision`` and ``checkpointing`` left None, the remedies ladder is walked until something
    fits: fp32, then bf16 autocast (fp16 on GPUs without bf16), then activation checkpointing, then
    bf16 weights and optimizer states, then FSDP sharding across the GPUs when ``gpus > 1``.

    Raises:
        ConfigError: a global batch or GPU count below 1, fewer items than GPUs, a device with no
            capacity.
        DoesNotFitError: nothing fits; the message names the smallest catalog GPU (or GPU count)
            on which it would.

    With ``base_lr`` tuned at ``base_batch_size``, the plan also carries the learning rate scaled to
    the global batch (``lr_rule``: linear, sqrt, or auto: sqrt for Adam-type optimizers).

    Example:
        >>> import batchfit
        >>> p = batchfit.plan("mlp", 300, device="1GiB", gpus=3)
        >>> [sum(s) for s in p.splits]
        [100, 100, 100]
    """
    _validate(global_batch_size, gpus)
    wl = _as_workload(workload)
    lr = _scaled_lr(wl, global_batch_size, base_lr, base_batch_size, lr_rule)  # before fitting: fail fast
    dev = get_device(device)
    if dev.total_bytes is None:
        raise ConfigError(f"{dev.name} has no memory capacity to plan against; give a GPU or a capacity like 24GiB")
    rungs = _ladder(dev, gpus, precision, checkpointing, bool(wl.checkpoint_blocks))
    share = rank_shares(global_batch_size, gpus)[0]
    chosen: tuple[FitResult, tuple, Any] | None = None
    options: list[PlanOption] = []
    for rung in rungs:
        prec, ck, sharded, remedies = rung
        shards, verify, rung_wl = gpus if sharded else 1, chosen is None, wl
        try:
            result = fit(wl, dev, precision=prec, checkpointing=ck, margin=margin, shard_over=shards, verify=verify)
            if result.max_batch_size < share and wl.accumulation_steps < 2:
                # The share needs several micro-batches: fit again with the earlier ones' gradients alive
                # through the later ones (see Workload.accumulation_steps); the answer can only shrink.
                rung_wl = with_accumulation(wl, 2)
                result = fit(
                    rung_wl, dev, precision=prec, checkpointing=ck, margin=margin, shard_over=shards, verify=verify
                )
        except DoesNotFitError:
            options.append(PlanOption(prec, ck is not None, sharded, 0, 0, 0, None, None, remedies))
            continue
        micro = min(result.max_batch_size, share)
        steps = -(-share // micro)
        options.append(
            PlanOption(
                prec,
                ck is not None,
                sharded,
                result.max_batch_size,
                micro,
                steps,
                result.estimate.device_total_bytes,
                result.capacity_bytes - result.estimate.device_total_bytes,
                remedies,
            )
        )
        if chosen is None:
            chosen = (result, rung, rung_wl)
            # Fitting more rungs only refines alternatives; one more rung past the first fit is enough
            # to show what the next remedy would buy.
            continue
        break
    if chosen is None:
        raise _nothing_fits(wl, dev, gpus, rungs)
    result, (prec, ck, sharded, remedies), fitted_wl = chosen
    splits = make_splits(global_batch_size, gpus, result.max_batch_size, same_count=sharded)
    micro = max(max(s) for s in splits)
    est = result.estimate
    if micro != result.max_batch_size:
        est = fit_estimate_at(fitted_wl, dev, prec, ck, sharded, gpus, micro)
    accumulation = max(len(s) for s in splits)
    if fitted_wl.accumulation_steps > 1 < accumulation:  # any count >= 2 traces alike: name the real one
        est = dataclasses.replace(est, accumulation_steps=accumulation)
    warnings = _warnings(wl, micro, global_batch_size, gpus)
    picked = (prec, ck is not None, sharded)
    alternatives = tuple(
        o for o in options if o.max_micro_batch_size > 0 and (o.precision, o.checkpointing, o.sharded) != picked
    )
    tokens = wl.tokens_per_item * global_batch_size if wl.tokens_per_item else None
    return Plan(
        global_batch_size=global_batch_size,
        gpus=gpus,
        device=dev.name,
        micro_batch_size=micro,
        accumulation_steps=accumulation,
        precision=prec,
        checkpointing=ck is not None,
        sharded=sharded,
        splits=splits,
        max_micro_batch_size=result.max_batch_size,
        estimate=est,
        headroom_bytes=result.capacity_bytes - est.device_total_bytes,
        items_per_step=global_batch_size,
        tokens_per_step=tokens,
        remedies=remedies,
        alternatives=alternatives,
        warnings=warnings,
        scaled_lr=None if lr is None else lr.lr,
        lr_rule=None if lr is None else lr.rule,
    )


def _scaled_lr(wl: Any, global_batch_size: int, base_lr: float | None, base_batch_size: int | None, rule: str) -> Any:
    """``LrScaling`` of ``base_lr`` to the global batch, or None without a reference learning rate."""
    if base_lr is None and base_batch_size is None:
        return None
    if base_lr is None or base_batch_size is None:
        raise ConfigError(
            "give both base_lr and base_batch_size (--base-lr, --base-batch-size): a learning rate and the "
            "global batch it was tuned at"
        )
    from .advice.lr import lr_scaling

    return lr_scaling(base_lr, base_batch_size, global_batch_size, rule, optimizer=wl.optimizer)


def fit_estimate_at(
    wl: Any, dev: Device, precision: str, checkpointing: Any, sharded: bool, gpus: int, batch_size: int
) -> Estimate:
    """The estimate of one rank at ``batch_size`` in a plan's configuration."""
    from .checkpointing import checkpoint_classes
    from .memory.estimate import finish_estimate, trace_for_device
    from .memory.sharding import shard_trace
    from .precision import policy_for

    policy = policy_for(precision, bf16_supported=dev.bf16, device_name=dev.name)
    classes = checkpoint_classes(checkpointing, wl.checkpoint_blocks)
    trace = trace_for_device(wl, batch_size, dev, policy, classes)
    if sharded:
        trace = shard_trace(trace, gpus)
    return finish_estimate(trace, wl, batch_size, dev, policy, classes)


def _warnings(wl: Any, micro: int, global_batch_size: int, gpus: int) -> tuple[str, ...]:
    try:
        from .advice.batchnorm import batchnorm_advice
    except ImportError:
        return ()
    if isinstance(wl.model, type(None)):
        return ()
    from .memory.trace import fake_model

    model = fake_model(wl)
    text = batchnorm_advice(model, micro, global_batch_size, gpus)
    return (text,) if text else ()


def _nothing_fits(wl: Any, dev: Device, gpus: int, rungs: list) -> DoesNotFitError:
    """One line naming where it would fit: the smallest catalog GPU, or enough GPUs to shard over."""
    prec, ck, _, _ = rungs[-1]
    where = []
    for other in catalog():
        if (other.total_bytes or 0) <= (dev.total_bytes or 0):
            continue
        p = prec if (other.bf16 or prec in ("fp32", "fp16")) else "fp16"
        try:
            fit(wl, other, precision=p, checkpointing=ck, verify=False)
        except DoesNotFitError:
            continue
        where.append(f"a {other.name} ({p}{' + checkpointing' if ck else ''})")
        break
    for n in (2, 4, 8, 16, 32, 64):
        if n <= gpus:
            continue
        try:
            fit(wl, dev, precision=prec, checkpointing=ck, shard_over=n, verify=False)
        except DoesNotFitError:
            continue
        where.append(f"{n} x {dev.name} with FSDP sharding (--gpus {n})")
        break
    tried = ", ".join("+".join(r[3]) or "fp32" for r in rungs)
    hint = " or ".join(where) if where else "no catalog GPU or GPU count up to 64"
    return DoesNotFitError(
        f"{wl.name} does not fit on {gpus} x {dev.name} even with one item per GPU (tried: {tried}); "
        f"it would fit on {hint}"
    )


def describe_split(splits: list[list[int]]) -> str:
    """``"42 x 11 + 5 x 10"`` per rank, ranks with the same split written once (``"2 ranks: ..."``)."""

    def runs(split: list[int]) -> str:
        parts, i = [], 0
        while i < len(split):
            j = i
            while j < len(split) and split[j] == split[i]:
                j += 1
            parts.append(f"{j - i} x {split[i]}" if split[i] else f"{j - i} padding")  # 0 items: see make_splits
            i = j
        return " + ".join(parts) if parts else "nothing"

    groups: dict[str, list[int]] = {}
    for rank, split in enumerate(splits):
        groups.setdefault(runs(split), []).append(rank)
    if len(groups) == 1:
        (text,) = groups
        return text if len(splits) == 1 else f"each of {len(splits)} ranks: {text}"
    return "; ".join(
        f"ranks {ranks[0]}-{ranks[-1]}: {text}" if len(ranks) > 1 else f"rank {ranks[0]}: {text}"
        for text, ranks in groups.items()
    )
