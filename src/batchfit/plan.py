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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .batching import make_splits, rank_shares
from .devices import Device, catalog, get_device
from .errors import ConfigError, DoesNotFitError
from .fit import FitResult, fit
from .memory.estimate import Estimate, _as_workload, with_accumulation


@dataclass(frozen=True)
class PlanOption:
    """One configuration a plan considered, and what it allows."""

    precision: str
    checkpointing: bool
    sharded: bool
    max_micro_batch_size: int
    """The largest micro-batch the search looked at that fits (at most a rank's share); 0 when not even
    one item fits."""
    micro_batch_size: int
    accumulation_steps: int
    device_total_bytes: int | None
    """At ``micro_batch_size`` (None when it does not fit)."""
    headroom_bytes: int | None
    remedies: tuple[str, ...]
    """What this configuration changes from plain fp32 data parallelism, cheapest first."""
    predicted_step_s: float | None = None
    """Predicted seconds per optimizer step (one global batch), see ``batchfit.cost``."""
    changes_numerics: bool = False
    """Weights and optimizer states in bf16: a change to the training maths, not only to its memory."""


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
    """The largest micro-batch that fits, searched no further than a rank's share of the global batch."""
    estimate: Estimate
    """Per GPU, at ``micro_batch_size``."""
    headroom_bytes: int
    items_per_step: int
    tokens_per_step: int | None
    remedies: tuple[str, ...]
    alternatives: tuple[PlanOption, ...] = field(default=())
    """The other configurations that fit, fastest first (predicted time per global batch)."""
    warnings: tuple[str, ...] = field(default=())
    scaled_lr: float | None = None
    """The learning rate for ``global_batch_size``, scaled from ``base_lr`` (None: no reference was given)."""
    lr_rule: str | None = None
    """The rule that scaled it: ``"linear"`` (SGD-type) or ``"sqrt"`` (Adam-type); see ``batchfit.advice.lr``."""
    predicted_step_s: float | None = None
    """Predicted seconds per optimizer step (one global batch) of this plan."""
    interconnect: str = "nvlink"
    """The interconnect the time predictions assume between GPUs."""
    changes_numerics: bool = False
    """The plan keeps weights and optimizer states in bf16 (chosen only because nothing else fits)."""

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
            "predicted_step_s": self.predicted_step_s,
            "interconnect": self.interconnect,
            "changes_numerics": self.changes_numerics,
        }


# -- the ladder -------------------------------------------------------------------------------
# NOTE [ Remedies ranked by what they cost ]
# Accumulation is free for the maths, so every configuration first splits the global batch into
# micro-batches. Beyond it, each remedy costs the user something, and they are tried cheapest first:
# mixed precision (autocast, fp32 master weights: faster, numerically standard), sharding across the
# GPUs given (communication), activation checkpointing (a recomputed forward, ~30% more time), and last
# bf16 weights and optimizer states (a change to the training maths, chosen only when nothing else fits).
# A configuration's cost is its remedies' ranks, most expensive first, compared as tuples: mixed
# precision alone (1) < sharding (2) < sharding with mixed precision (2, 1) < checkpointing (3) < ...
_RANK = {"autocast": 1, "sharding": 2, "checkpointing": 3, "bf16-true": 4}


@dataclass(frozen=True)
class _Config:
    precision: str
    checkpointing: Any
    sharded: bool
    remedies: tuple[str, ...]
    cost: tuple[int, ...]


def _ladder(device: Device, gpus: int, precision: str | None, checkpointing: Any, has_blocks: bool) -> list[_Config]:
    """Every configuration the plan may choose, cheapest remedies first (NOTE above)."""
    low = "bf16" if device.bf16 else "fp16"
    precisions = ["fp32", low] + (["bf16-true"] if device.bf16 else [])
    if precision is not None:
        precisions = [precision]
    if checkpointing is None:
        ck_options: list[Any] = [None] + (["blocks"] if has_blocks else [])
    else:
        ck_options = [checkpointing or None]
    configs = []
    for prec in precisions:
        for ck in ck_options:
            for sharded in [False, True] if gpus > 1 else [False]:
                used: list[tuple[int, str]] = []
                if prec == "bf16-true":
                    used.append((_RANK["bf16-true"], "bf16 weights and optimizer states"))
                elif prec != "fp32":
                    used.append((_RANK["autocast"], f"{prec} autocast"))
                if sharded:
                    used.append((_RANK["sharding"], "FSDP sharding"))
                if ck is not None:
                    used.append((_RANK["checkpointing"], "activation checkpointing"))
                used.sort()
                remedies = tuple(name for _, name in used)
                configs.append(_Config(prec, ck, sharded, remedies, tuple(sorted((r for r, _ in used), reverse=True))))
    return sorted(configs, key=lambda c: c.cost)


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


ALTERNATIVES = 3
"""How many configurations besides the chosen one a plan evaluates and shows (when that many fit)."""


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
    interconnect: str = "nvlink",
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Plan ``global_batch_size`` items per optimizer step on ``gpus`` GPUs of ``device``.

    With ``precision`` and ``checkpointing`` left None, configurations are tried cheapest remedies
    first (NOTE [ Remedies ranked by what they cost ]): accumulation alone, mixed precision, FSDP
    sharding across the GPUs, activation checkpointing, bf16 weights and optimizer states; the first
    that fits is the plan, and up to ``ALTERNATIVES`` more that fit are shown beside it, fastest
    first, each with its memory and predicted time per global batch (``batchfit.cost``; GPUs talk
    over ``interconnect``: nvlink, pcie or ib). A configuration whose parameters, gradients and
    optimizer states alone exceed the GPU is skipped without tracing. ``progress`` is called with a
    short description before each traced step.

    Raises:
        ConfigError: a global batch or GPU count below 1, fewer items than GPUs, a device with no
            capacity, an unknown interconnect.
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
    from .cost import link_gbps

    _validate(global_batch_size, gpus)
    wl = _as_workload(workload)
    lr = _scaled_lr(wl, global_batch_size, base_lr, base_batch_size, lr_rule)  # before fitting: fail fast
    dev = get_device(device)
    if dev.total_bytes is None:
        raise ConfigError(f"{dev.name} has no memory capacity to plan against; give a GPU or a capacity like 24GiB")
    link_gbps(dev, interconnect)  # an unknown interconnect fails here, not after the fits
    configs = _ladder(dev, gpus, precision, checkpointing, bool(wl.checkpoint_blocks))
    share = rank_shares(global_batch_size, gpus)[0]
    budget = int(dev.total_bytes * (1 - margin))
    chosen: _Fitted | None = None
    options: list[tuple[_Fitted, PlanOption]] = []
    for config in configs:
        if chosen is not None and len(options) > ALTERNATIVES:
            break
        label = ", ".join(config.remedies) or "fp32"
        if not _could_fit(wl, dev, config, gpus, budget):
            continue
        step = None if progress is None else (lambda text, label=label: progress(f"{label}: {text}"))
        fitted = _fit_config(wl, dev, config, gpus, share, margin, verify=chosen is None, progress=step)
        if fitted is None:
            continue
        option = _option(fitted, dev, gpus, global_batch_size, interconnect)
        options.append((fitted, option))
        if chosen is None:
            chosen = fitted
    if chosen is None:
        raise _nothing_fits(wl, dev, gpus, configs)
    result, config, fitted_wl = chosen.result, chosen.config, chosen.workload
    splits = make_splits(global_batch_size, gpus, result.max_batch_size, same_count=config.sharded)
    micro = max(max(s) for s in splits)
    est = result.estimate
    if micro != result.max_batch_size:
        est = fit_estimate_at(fitted_wl, dev, config.precision, config.checkpointing, config.sharded, gpus, micro)
    accumulation = max(len(s) for s in splits)
    if fitted_wl.accumulation_steps > 1 < accumulation:  # any count >= 2 traces alike: name the real one
        est = dataclasses.replace(est, accumulation_steps=accumulation)
    warnings = _warnings(wl, micro, global_batch_size, gpus)
    picked = next(o for f, o in options if f is chosen)
    alternatives = tuple(sorted((o for f, o in options if f is not chosen), key=_by_time))
    tokens = wl.tokens_per_item * global_batch_size if wl.tokens_per_item else None
    return Plan(
        global_batch_size=global_batch_size,
        gpus=gpus,
        device=dev.name,
        micro_batch_size=micro,
        accumulation_steps=accumulation,
        precision=config.precision,
        checkpointing=config.checkpointing is not None,
        sharded=config.sharded,
        splits=splits,
        max_micro_batch_size=result.max_batch_size,
        estimate=est,
        headroom_bytes=result.capacity_bytes - est.device_total_bytes,
        items_per_step=global_batch_size,
        tokens_per_step=tokens,
        remedies=config.remedies,
        alternatives=alternatives,
        warnings=warnings,
        scaled_lr=None if lr is None else lr.lr,
        lr_rule=None if lr is None else lr.rule,
        predicted_step_s=picked.predicted_step_s,
        interconnect=str(interconnect),
        changes_numerics=picked.changes_numerics,
    )


def _by_time(option: PlanOption) -> float:
    return option.predicted_step_s if option.predicted_step_s is not None else float("inf")


@dataclass
class _Fitted:
    config: _Config
    result: FitResult
    workload: Any


def _could_fit(wl: Any, dev: Device, config: _Config, gpus: int, budget: int) -> bool:
    """False when the model's state alone (no activations, no batch) exceeds the GPU: no trace needed."""
    from .memory.states import state_bytes
    from .precision import policy_for

    policy = policy_for(config.precision, bf16_supported=dev.bf16, device_name=dev.name)
    states = state_bytes(wl, policy.param_dtype)
    held = states.sharded(gpus) if config.sharded else states.total
    return held + dev.context_bytes <= budget


def _fit_config(
    wl: Any, dev: Device, config: _Config, gpus: int, share: int, margin: float, *, verify: bool,
    progress: Any = None,
) -> _Fitted | None:  # fmt: skip
    """The largest micro-batch (at most the share) of one configuration, or None when none fits."""
    shards = gpus if config.sharded else 1
    kwargs = dict(precision=config.precision, checkpointing=config.checkpointing, margin=margin,
                  shard_over=shards, verify=verify, max_batch_size=share, progress=progress)  # fmt: skip
    if share == 1 or wl.accumulation_steps > 1:
        try:
            return _Fitted(config, fit(wl, dev, **kwargs), wl)
        except DoesNotFitError:
            return None
    # A share of several items usually needs several micro-batches, whose later forwards and backwards
    # run with the earlier ones' gradients alive (Workload.accumulation_steps): fit that step directly.
    accumulating = with_accumulation(wl, 2)
    try:
        result = fit(accumulating, dev, **kwargs)
    except DoesNotFitError:
        result = None
    if result is not None and result.max_batch_size == share:
        return _Fitted(config, result, accumulating)
    # The whole share as one micro-batch (no accumulation: no gradients alive in its forward) may fit
    # where the accumulating step does not: one more trace settles it for the plan; an alternative is
    # checked only where the accumulating step overshoots by about its gradients.
    if result is not None and _may_fit_whole(result, accumulating, dev, config, share, shards, generous=verify):
        ck = config.checkpointing
        whole = fit_estimate_at(wl, dev, config.precision, ck, config.sharded, gpus=shards, batch_size=share)
        if whole.device_total_bytes <= result.capacity_bytes:
            return _Fitted(config, dataclasses.replace(result, max_batch_size=share, estimate=whole), wl)
    return None if result is None else _Fitted(config, result, accumulating)


def _may_fit_whole(
    result: FitResult, wl: Any, dev: Device, config: _Config, share: int, shards: int, *, generous: bool
) -> bool:
    """Whether the plain step of the whole share could fit although the accumulating step at the share
    does not: only if it overshoots by about the gradients (alive in the accumulating step only), with
    an allocator segment of slack; ``generous`` (the plan's own configuration) allows 10% more."""
    from .memory.states import state_bytes
    from .precision import policy_for

    trace = result.trace_at(share)
    if trace is None:
        return True
    if shards > 1:
        from .memory.sharding import shard_trace

        trace = shard_trace(trace, shards)
    policy = policy_for(config.precision, bf16_supported=dev.bf16, device_name=dev.name)
    from .memory.estimate import finish_estimate

    est = finish_estimate(trace, wl, share, dev, policy, ())
    overshoot = est.device_total_bytes - result.capacity_bytes
    slack = 2 * -(-state_bytes(wl, policy.param_dtype).gradients // shards) + (20 << 20)  # + one segment
    if generous:
        slack += result.capacity_bytes // 10
    return overshoot <= slack


def _option(fitted: _Fitted, dev: Device, gpus: int, global_batch_size: int, interconnect: str) -> PlanOption:
    """A fitted configuration as a plan option, with its predicted time per global batch."""
    from .cost import predict_step_time
    from .memory.states import state_bytes
    from .precision import policy_for

    result, config = fitted.result, fitted.config
    splits = make_splits(global_batch_size, gpus, result.max_batch_size, same_count=config.sharded)
    micro = max(max(s) for s in splits)
    steps = max(len(s) for s in splits)
    trace = result.trace_at(micro)
    seconds = None
    if trace is not None:
        policy = policy_for(config.precision, bf16_supported=dev.bf16, device_name=dev.name)
        states = state_bytes(fitted.workload, policy.param_dtype)
        seconds = predict_step_time(
            trace, dev, precision=config.precision, micro_batches=steps, gpus=gpus, sharded=config.sharded,
            interconnect=interconnect, state_bytes=states.as_tuple(),
        ).total_s  # fmt: skip
    total = result.estimate.device_total_bytes
    return PlanOption(
        precision=config.precision,
        checkpointing=config.checkpointing is not None,
        sharded=config.sharded,
        max_micro_batch_size=result.max_batch_size,
        micro_batch_size=micro,
        accumulation_steps=steps,
        device_total_bytes=total,
        headroom_bytes=result.capacity_bytes - total,
        remedies=config.remedies,
        predicted_step_s=seconds,
        changes_numerics=config.precision == "bf16-true",
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
    from .advice.batchnorm import advice_for_layers, layer_facts
    from .cache import CACHE
    from .memory.trace import fake_model

    layers = CACHE.fact("batchnorm layers", wl, None, lambda: layer_facts(fake_model(wl)))
    text = advice_for_layers(layers, micro, global_batch_size, gpus)
    return (text,) if text else ()


def _nothing_fits(wl: Any, dev: Device, gpus: int, rungs: list[_Config]) -> DoesNotFitError:
    """One line naming where it would fit: the smallest catalog GPU, or enough GPUs to shard over."""
    unsharded = [r for r in rungs if not r.sharded] or rungs
    prec, ck = unsharded[-1].precision, unsharded[-1].checkpointing
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
    remedies: list[str] = []
    for rung in rungs:
        remedies += [name for name in rung.remedies if name not in remedies]
    tried = ", ".join(["accumulation alone", *remedies])
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
