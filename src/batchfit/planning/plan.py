"""Any global batch, exactly: micro-batch x accumulation steps x GPUs, and the remedies when even
one item does not fit.

The invariant, stated once: for every optimizer step,
``sum(splits[rank]) over ranks == global_batch_size``, and every micro-batch is at most the fitted
maximum. Ranks' shares differ by at most one item when the global batch does not divide by the GPU
count, and a share that does not divide by the micro-batch is split into near-equal pieces: the
trainer weights every micro-batch by its item count, so any split is the same gradient.

This module checks the request and assembles the ``Plan``; the configurations it tries are
``planning/ladder.py``, fitting and timing one of them ``planning/options.py``, and what a plan says in words
(advice, where a model would fit, a split) ``planning/messages.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..activation_checkpointing import Checkpointing
from ..advice.lr import lr_scaling
from ..batching import check_batch_size, rank_shares
from ..errors import ConfigError, TraceError
from ..gpu.catalog import GPUS_PER_NODE, Device, get_device
from ..memory.cache import CACHE
from ..memory.estimate import Estimate, trace_for_device, with_accumulation
from ..memory.trace.fake_step import model_structure
from ..memory.trace.tp_plan import degree_error, split_facts
from ..sources import as_workload
from ..workload import AUTO, ParallelLayout, Setup, Workload
from .cost import link_gbps
from .estimate import fit_estimate_at
from .ladder import Rung, ladder
from .messages import _nothing_fits, _warnings, describe_split, expandable_remedy
from .options import (
    PlanOption,
    _by_time,
    _could_fit,
    _fit_config,
    _Fitted,
    _option,
    plan_splits,
    timed_option,
)
from .partial import BlockSearch, FewestBlocks, blocks_setting, fastest_first, first_blocks_setting
from .workers import fit_ahead, resolve_workers

__all__ = ["ALTERNATIVES", "Plan", "PlanOption", "describe_split", "fit_estimate_at", "plan"]


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
    """For each data-parallel rank (each GPU, or each tensor-parallel group), the micro-batch sizes of one
    optimizer step (they sum to the global batch)."""
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
    tensor_parallel: int = 1
    """GPUs of one tensor-parallel group (1: none). The groups are the data-parallel ranks: ``splits``
    has one entry per group, and FSDP shards across them when there are several."""
    sequence_parallel: bool = False
    """The blocks' activations are split along the sequence inside each tensor-parallel group."""
    checkpointed_blocks: int | None = None
    """With ``checkpointing``: the first this many blocks are checkpointed, the fewest the micro-batch needs
    (NOTE [ Checkpointing only what the micro-batch needs ]); None: every block."""
    selective_rest: bool = False
    """With ``checkpointed_blocks``: the blocks after them are checkpointed selectively (NOTE [ Some blocks
    whole, the rest selectively ]; 0 blocks: every block selectively)."""

    @property
    def checkpointing_setting(self) -> Checkpointing:
        """What ``checkpointing=`` takes for this plan's step: None, ``"blocks"``, the number of blocks, or the
        first blocks' indices then ``"selective"`` (or ``"selective"`` alone)."""
        if not self.checkpointing:
            return None
        if self.checkpointed_blocks is None:
            return "blocks"
        return first_blocks_setting(self.checkpointed_blocks, self.selective_rest)

    @property
    def data_parallel(self) -> int:
        """Ranks that take different items: the GPUs, or the tensor-parallel groups."""
        return self.gpus // self.tensor_parallel

    @property
    def layout(self) -> ParallelLayout | None:
        """The ``ParallelLayout`` a rank trains in (None: no tensor parallelism)."""
        if self.tensor_parallel <= 1:
            return None

        return ParallelLayout(self.tensor_parallel, self.sequence_parallel, fsdp=self.data_parallel)

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
            "tensor_parallel": self.tensor_parallel,
            "sequence_parallel": self.sequence_parallel,
            "data_parallel": self.data_parallel,
            "checkpointed_blocks": self.checkpointed_blocks,
        }


def _validate(global_batch_size: Any, gpus: Any) -> None:
    check_batch_size(global_batch_size, "the global batch size")
    check_batch_size(gpus, "the number of GPUs")
    if global_batch_size < gpus:
        raise ConfigError(
            f"a global batch of {global_batch_size} cannot give each of {gpus} GPUs an item; "
            f"use --global-batch-size >= {gpus} or fewer GPUs"
        )


ALTERNATIVES = 3
"""How many configurations besides the chosen one a plan evaluates and shows (when that many fit)."""


def plan(
    workload: Workload | str,
    global_batch_size: int,
    *,
    device: str | Device,
    gpus: int = 1,
    setup: Setup | None = None,
    precision: str | None = None,
    checkpointing: Checkpointing = None,
    margin: float = 0.0,
    base_lr: float | None = None,
    base_batch_size: int | None = None,
    lr_rule: str = "auto",
    interconnect: str = "nvlink",
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
    tensor_parallel: int | None = None,
    sequence_parallel: bool | None = None,
    gpus_per_node: int = GPUS_PER_NODE,
) -> Plan:
    """Plan ``global_batch_size`` items per optimizer step on ``gpus`` GPUs of ``device``.

    ``setup`` (a ``batchfit.Setup``) says how each rank's step is run; its precision and checkpointing are
    chosen where they are ``"auto"``, as they are when it is None, and ``precision`` or ``checkpointing``
    given fixes that field. The plan chooses the accumulation and the layout itself: ``tensor_parallel``
    and ``sequence_parallel`` fix those.

    With precision and checkpointing left to choose, configurations are tried cheapest remedies
    first (NOTE [ Remedies ranked by what they cost ] in ``planning/ladder.py``): accumulation alone,
    mixed precision, FSDP sharding across the GPUs, activation checkpointing, tensor parallelism inside
    a node (degrees 2, 4, 8 that split the model's heads, with and without sequence parallelism, FSDP
    across the groups; for models with a tensor-parallel plan: ``Workload.tp_plan`` or the one a
    transformers model publishes), bf16 weights and
    optimizer states; the first that fits is the plan, and up to ``ALTERNATIVES`` more that fit are
    shown beside it, fastest first, each with its memory and predicted time per global batch
    (``batchfit.planning.cost``; GPUs talk over ``interconnect``: nvlink, pcie or ib). A configuration whose
    parameters, gradients and optimizer states alone exceed the GPU is skipped without tracing.
    ``progress`` is called with a short description before each traced step. With ``workers`` > 1
    (default: the cores available, or ``BATCHFIT_WORKERS``), the configurations after the first are
    fitted at the same time in forked processes (``planning/workers.py``); the plan is the same.

    ``tensor_parallel`` fixes the degree (1: none) and ``sequence_parallel`` fixes sequence parallelism;
    ``gpus_per_node`` bounds the degree (a tensor-parallel group stays inside one node's NVLink).

    Raises:
        ConfigError: a global batch or GPU count below 1, fewer items than GPUs, a device with no
            capacity, an unknown interconnect, a tensor-parallel degree that does not divide the
            model's heads, a node or the GPUs (the line names the valid degrees).
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
    wl = as_workload(workload)
    lr = _scaled_lr(wl, global_batch_size, base_lr, base_batch_size, lr_rule)  # before fitting: fail fast
    dev = get_device(device)
    if dev.total_bytes is None:
        raise ConfigError(f"{dev.name} has no memory capacity to plan against; give a GPU or a capacity like 24GiB")
    link_gbps(dev, interconnect)  # an unknown interconnect fails here, not after the fits
    setup = _plan_setup(setup, precision, checkpointing)
    rungs = _rungs(wl, dev, gpus, setup, tensor_parallel, sequence_parallel, gpus_per_node)
    walk = _Walk(wl, dev, gpus, global_batch_size, margin, interconnect, progress,
                 choose_blocks=setup.checkpointing == AUTO)  # fmt: skip
    walk.climb(rungs, resolve_workers(workers))
    if walk.chosen is not None:
        return _offering_a_fused_loss(_plan_of(walk, lr), walk, rungs, resolve_workers(workers))
    fused = _fused_loss_walk(walk, rungs, resolve_workers(workers))
    if fused is None:
        raise _nothing_fits(wl, dev, gpus, rungs)
    walk, kind = fused
    return _with_the_fused_loss(_plan_of(walk, lr), kind)


# NOTE [ A fused loss when nothing else fits ]
# A causal language model's logits are batch x sequence x vocabulary values, and its loss keeps them
# (and their fp32 upcast and gradient) alive through the loss's backward: at 4096 tokens and a 128k
# vocabulary, 2 GiB of bf16 logits and twice that in fp32, often the largest tensors of a LoRA step. A
# fused linear cross-entropy (Liger's, or cut cross-entropy) computes the loss from the hidden states
# and the head's weight in chunks and never materialises them; it changes no maths (the same loss and
# gradients up to summation order) and is as fast or faster. When no rung of the ladder fits, the plan
# walks the ladder again with it, and names the package and the call that turn it on (with what
# installing it would buy when it is not installed here).
def _fused_walk(walk: _Walk) -> tuple[_Walk, str] | None:
    """A fresh walk of ``walk``'s workload with its loss fused (an installed kind first), or None: the workload is
    not a causal language model of transformers, or its loss is fused already."""
    from ..sources.fused import KINDS, installed, with_fused_loss

    if walk.wl.config.get("fused_loss") or walk.wl.config.get("task") != "causal-lm":
        return None
    kind = next((k for k in KINDS if installed(k)), KINDS[0])
    try:
        fused = with_fused_loss(walk.wl, kind)
    except ConfigError:
        return None
    return dataclasses.replace(walk, wl=fused, chosen=None, options=[], failed=[], traced=False), kind


def _fused_loss_walk(walk: _Walk, rungs: list[Rung], workers: int) -> tuple[_Walk, str] | None:
    """The walk of ``walk``'s ladder with the loss fused, or None: no fused loss applies, or nothing fits either
    way."""
    fused = _fused_walk(walk)
    if fused is None:
        return None
    again, kind = fused
    if again.progress is not None:
        again.progress(f"nothing fits with the model's own loss: walking the ladder again with a fused loss ({kind})")
    again.climb(rungs, workers)
    return None if again.chosen is None else (again, kind)


# NOTE [ A fused loss beside a plan held back by memory ]
# When the chosen rung fits, but not its whole share in one micro-batch or only with checkpointing, memory holds
# it back, and a fused loss may release it: a larger micro-batch (less accumulation), fewer blocks recomputed, or
# a cheaper rung. The rungs up to the chosen one that keep the model whole are fitted again with the loss fused
# (a tensor-parallel rank costs minutes to trace for a large model, and logits that outgrow a GPU are often why
# the model was split) until the cheapest one fits, which is shown beside the plan when its predicted time per
# global batch is lower, with what turns it on. The plan itself
# stays the step the user's code runs today: a fused loss is a change to the training script (or a package to
# install), so it is offered, not assumed.
def _offering_a_fused_loss(p: Plan, walk: _Walk, rungs: list[Rung], workers: int) -> Plan:
    """``p``, with the fastest configuration no costlier than its own with the loss fused among its alternatives
    and a warning naming what it would save, when memory holds ``p`` back and that one is faster (NOTE above)."""
    from ..sources.fused import fused_loss_name, how_to_turn_on

    chosen = walk.chosen
    assert chosen is not None
    held_back = chosen.config.checkpointing is not None or chosen.result.max_batch_size < walk.share_of(chosen.config)
    whole = [r for r in rungs[: rungs.index(chosen.config) + 1] if r.tensor_parallel == 1]  # TP ranks cost minutes
    fused = _fused_walk(walk) if held_back and whole and p.predicted_step_s is not None else None
    if fused is None:
        return p
    again, kind = fused
    again.alternatives = 0  # the cheapest configuration that fits with it is the offer
    if again.progress is not None:
        again.progress(f"memory holds the plan back: fitting it again with a fused loss ({kind})")
    try:
        again.climb(whole, workers)
    except (ConfigError, TraceError):  # an offer that cannot be traced is not made; the plan stands
        return p
    offers = [o for _, o in again.options]
    if again.choose_blocks and again.chosen is not None and again.chosen.config.checkpointing == "blocks":
        offers += [o for o, _ in _fewer_blocks(again)]  # fewer blocks recomputed, as the plan itself would
    best = min(offers, key=_by_time, default=None)
    if best is None or _by_time(best) >= p.predicted_step_s:
        return p
    name = fused_loss_name(kind)
    best = dataclasses.replace(best, remedies=(name, *best.remedies))
    how = how_to_turn_on(kind)
    others = ", ".join(best.remedies[1:]) or "no other remedy"
    saves = (f"with the {name} the logits are never materialised: {best.micro_batch_size} x "
             f"{best.accumulation_steps} micro-batches ({others}) would take {best.predicted_step_s:.3g} s per global "
             f"batch instead of {p.predicted_step_s:.3g} s; {how}")  # fmt: skip
    return dataclasses.replace(p, alternatives=tuple(sorted((*p.alternatives, best), key=_by_time)),
                               warnings=(*p.warnings, saves))  # fmt: skip


def _with_the_fused_loss(p: Plan, kind: str) -> Plan:
    """``p`` (planned with the fused ``kind``) saying so: the remedy, and how to turn it on."""
    from ..sources.fused import fused_loss_name, how_to_turn_on

    name = fused_loss_name(kind)
    how = f"the plan needs the {name} (the logits are never materialised): {how_to_turn_on(kind)}"
    return dataclasses.replace(p, remedies=(name, *p.remedies), warnings=(how, *p.warnings),
                               alternatives=tuple(dataclasses.replace(o, remedies=(name, *o.remedies))
                                                  for o in p.alternatives))  # fmt: skip


def _plan_setup(setup: Setup | None, precision: str | None, checkpointing: Checkpointing) -> Setup:
    """The setup every rung starts from: ``setup`` (None: precision and checkpointing chosen) with the
    fields given fixed.

    Raises:
        ConfigError: a setup that fixes what the plan chooses (the accumulation, the layout).
    """
    setup = Setup.of(Setup(precision=AUTO, checkpointing=AUTO) if setup is None else setup, precision=precision,
                     checkpointing=checkpointing)  # fmt: skip
    if setup.accumulation_steps is not None:
        raise ConfigError("a plan chooses the accumulation steps of its global batch; leave the setup's "
                          "accumulation_steps None (batchfit.fit takes a fixed count)")  # fmt: skip
    if setup.parallel is not None:
        raise ConfigError("a plan chooses the layout of its GPUs; leave the setup's parallel None and fix the "
                          "degree with tensor_parallel= and sequence_parallel= (--tp, --sp)")  # fmt: skip
    return setup


def _rungs(
    wl: Workload, dev: Device, gpus: int, setup: Setup, tensor_parallel: int | None, sequence_parallel: bool | None,
    gpus_per_node: int,
) -> list[Rung]:  # fmt: skip
    """The ladder's configurations, cheapest remedies first, with a fixed tensor-parallel degree kept alone."""
    degrees, sequence_parallel = _tensor_parallel_degrees(wl, gpus, tensor_parallel, sequence_parallel, gpus_per_node)
    rungs = ladder(dev, gpus, setup, bool(wl.checkpoint_blocks), degrees, sequence_parallel)
    if tensor_parallel is not None:
        rungs = [c for c in rungs if c.tensor_parallel == max(1, tensor_parallel)]
    return rungs


@dataclass
class _Walk:
    """One walk up the ladder: each rung that could fit is fitted, the first that fits is chosen, and up to
    ``ALTERNATIVES`` more are fitted to be shown beside it."""

    wl: Workload
    dev: Device
    gpus: int
    global_batch_size: int
    margin: float
    interconnect: str
    progress: Callable[[str], None] | None
    choose_blocks: bool = False
    """Checkpointing is the plan's choice: a rung that checkpoints every block may keep fewer."""
    chosen: _Fitted | None = None
    options: list[tuple[_Fitted, PlanOption]] = field(default_factory=list)
    failed: list[tuple[Rung, TraceError]] = field(default_factory=list)
    """Rungs whose step could not be traced (a model whose ops mix dtypes under autocast), left out and
    said so once another rung's step ran; the first step traced failing is the plan's error instead (a
    bug in the step, not in one configuration of it)."""
    traced: bool = False
    alternatives: int = ALTERNATIVES
    """Configurations fitted beside the first that fits."""

    def share_of(self, config: Rung) -> int:
        """Items of the global batch the first rank (group) takes under ``config``."""
        return rank_shares(self.global_batch_size, config.data_parallel(self.gpus))[0]

    def could_fit(self, config: Rung) -> bool:
        """Whether ``config``'s parameters, gradients and optimizer states alone leave room (no trace)."""
        return _could_fit(self.wl, self.dev, config, self.gpus, int(self.dev.total_bytes * (1 - self.margin)))

    def first_rungs(self, rungs: list[Rung]) -> list[Rung]:
        """The rungs the walk fits if none errs: the first 1 + ``alternatives`` that could fit (all but the
        first can be fitted ahead, in other processes, while the walk reaches them)."""
        first: list[Rung] = []
        for config in rungs:
            if len(first) > self.alternatives:
                break
            if not _split_after_whole(config, first) and self.could_fit(config):
                first.append(config)
        return first

    def labelled(self, config: Rung, progress: Callable[[str], None] | None) -> Callable[[str], None] | None:
        """``progress`` with each line prefixed by the configuration's remedies."""
        label = ", ".join(config.remedies) or config.precision
        return None if progress is None else (lambda text: progress(f"{label}: {text}"))

    def fit_later(self, config: Rung, progress: Callable[[str], None] | None = None) -> None:
        """Fit ``config`` ahead of the walk (its answer cached); an error is raised again when the walk
        reaches it."""
        with contextlib.suppress(TraceError):
            _fit_config(self.wl, self.dev, config, self.gpus, self.share_of(config), self.margin, verify=False,
                        progress=self.labelled(config, progress))  # fmt: skip

    def climb(self, rungs: list[Rung], workers: int) -> None:
        """Fit the rungs in order until one fits and ``alternatives`` more have been fitted beside it."""
        first = self.first_rungs(rungs)
        with fit_ahead(self.wl, first, workers, self.fit_later) as ahead:
            if ahead.children and self.progress is not None:
                self.progress(f"fitting {len(first) - 1} more configurations in {ahead.children} other "
                              f"process{'es' if ahead.children > 1 else ''}")  # fmt: skip
            for config in rungs:
                if self.chosen is not None and len(self.options) > self.alternatives:
                    break
                if self.chosen is not None and _split_after_whole(config, [self.chosen.config]):
                    continue
                self.step(config, ahead)

    def step(self, config: Rung, ahead: Any) -> None:
        """Fit one rung (unless it cannot fit), and keep it as the plan or as an alternative."""
        try:
            if not self.could_fit(config):
                return
            ahead.wait(config, lambda later: self.fit_later(later, self.progress))
            fitted = _fit_config(self.wl, self.dev, config, self.gpus, self.share_of(config), self.margin,
                                 verify=self.chosen is None, progress=self.labelled(config, self.progress))  # fmt: skip
        except TraceError as e:
            if not self.traced:
                raise
            self.failed.append((config, e))
            return
        self.traced = True
        if fitted is None:
            return
        self.options.append((fitted, _option(fitted, self.dev, self.gpus, self.global_batch_size, self.interconnect)))
        if self.chosen is None:
            self.chosen = fitted


def _plan_of(walk: _Walk, lr: Any) -> Plan:
    """The plan of the chosen rung: the global batch split into micro-batches at its largest micro-batch,
    the estimate at the micro-batch the split uses, its warnings, and the alternatives fastest first."""
    chosen, wl, dev, gpus, global_batch_size = walk.chosen, walk.wl, walk.dev, walk.gpus, walk.global_batch_size
    assert chosen is not None
    result, config, fitted_wl = chosen.result, chosen.config, chosen.rank_workload(gpus)
    picked = next(o for f, o in walk.options if f is chosen)
    others = [o for f, o in walk.options if f is not chosen]
    remedies, blocks, split_at, selective = config.remedies, None, result.max_batch_size, False
    fewer = _fewer_blocks(walk) if walk.choose_blocks and config.checkpointing == "blocks" else []
    fewer.sort(key=lambda f: _by_time(f[0]))
    if fewer and _by_time(fewer[0][0]) >= _by_time(picked):  # every block at its larger micro-batch is faster
        others += [option for option, _ in fewer]
        fewer = []
    if fewer:
        others.append(picked)  # every block checkpointed: shown beside it, with its time
        (picked, est), *rest = fewer
        others += [option for option, _ in rest]
        remedies, blocks, split_at = picked.remedies, picked.checkpointed_blocks, picked.micro_batch_size
        selective = picked.selective_rest
    splits = plan_splits(config, global_batch_size, gpus, split_at)
    micro = max(max(s) for s in splits)
    if not fewer:
        est = result.estimate
        if micro != result.max_batch_size:
            shards = config.arithmetic_shards(gpus)
            est = fit_estimate_at(fitted_wl, dev, config.setup, shards > 1, shards, micro)
    accumulation = max(len(s) for s in splits)
    if est.accumulation_steps > 1 < accumulation:  # any count >= 2 traces alike: name the real one
        est = dataclasses.replace(est, accumulation_steps=accumulation)
    warnings = _warnings(wl, micro, global_batch_size, config.data_parallel(gpus)) + tuple(
        f"not considered: {', '.join(c.remedies) or 'fp32'}, whose step failed when traced: {e}" for c, e in walk.failed
    )
    if result.expandable_max_batch_size and accumulation > 1:  # a larger micro-batch would cut the accumulation
        warnings += (expandable_remedy(result.max_batch_size, result.expandable_max_batch_size),)
        others += _expandable_option(walk, result.expandable_max_batch_size, accumulation)
    if result.known_error:
        warnings += (result.known_error,)
    alternatives = tuple(sorted(others, key=_by_time))
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
        remedies=remedies,
        alternatives=alternatives,
        warnings=warnings,
        scaled_lr=None if lr is None else lr.lr,
        lr_rule=None if lr is None else lr.rule,
        predicted_step_s=picked.predicted_step_s,
        interconnect=str(walk.interconnect),
        changes_numerics=picked.changes_numerics,
        tensor_parallel=config.tensor_parallel,
        sequence_parallel=config.sequence_parallel,
        checkpointed_blocks=blocks,
        selective_rest=selective,
    )


def _fewer_blocks(walk: _Walk) -> list[tuple[PlanOption, Estimate]]:
    """The chosen rung with the fewest blocks checkpointed that its micro-batch needs, the others kept or
    checkpointed selectively, at the micro-batch its split uses and at the next smaller one (fewer items, fewer
    blocks: which is faster is the cost model's to say), each worth finding (``partial.fastest_first``) as an
    option and its estimate (NOTE [ Checkpointing only what the micro-batch needs ]); empty: every block is
    needed."""
    chosen = walk.chosen
    assert chosen is not None
    config, result, dev = chosen.config, chosen.result, walk.dev
    shards = config.arithmetic_shards(walk.gpus)
    micro = max(max(s) for s in plan_splits(config, walk.global_batch_size, walk.gpus, result.max_batch_size))
    sizes = [micro]
    if micro > 1:
        sizes.append(max(max(s) for s in plan_splits(config, walk.global_batch_size, walk.gpus, micro - 1)))
    searches = []
    for size, selective in itertools.product(sizes, (False, True)):
        steps = max(len(s) for s in plan_splits(config, walk.global_batch_size, walk.gpus, size))
        accumulation = 2 if steps > 1 else 1
        wl = with_accumulation(chosen.rank_workload(walk.gpus), accumulation)  # a tensor-parallel rank's own step
        search = BlockSearch(wl, dev, config.setup, shards > 1, shards, size, result.capacity_bytes, walk.progress,
                             selective)  # fmt: skip
        if search.of >= 2:
            searches.append(search)
    options: dict[tuple[BlockSearch, int], PlanOption] = {}

    def option(search: BlockSearch, k: int) -> PlanOption:
        if (search, k) not in options:
            ck = blocks_setting(k, search.of, search.selective)
            partial = dataclasses.replace(config, setup=dataclasses.replace(config.setup, checkpointing=ck))
            setup, wl, size, est = partial.setup, search.wl, search.micro, search.at(k)
            trace = trace_for_device(setup.workload(wl), size, dev, setup.policy(dev), setup.classes(wl))
            whole = with_accumulation(chosen.workload, wl.accumulation_steps)  # the cost model splits the whole model
            fewest = FewestBlocks(k, search.of, est, search.selective)
            timed = timed_option(partial, whole, dev, walk.gpus, walk.global_batch_size, walk.interconnect, size,
                                 trace, est.device_total_bytes, result.capacity_bytes,
                                 fewest.remedies(config.remedies))  # fmt: skip
            options[(search, k)] = dataclasses.replace(timed, checkpointed_blocks=k, selective_rest=search.selective)
        return options[(search, k)]

    def seconds(search: BlockSearch, k: int) -> float:
        return option(search, k).predicted_step_s or math.inf

    return [(option(search, k), search.at(k)) for search, k in fastest_first(searches, seconds)]


EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
"""The remedy of an option that needs expandable segments: the setting, as the user makes it."""


def _expandable_option(walk: _Walk, size: int, accumulation: int) -> list[PlanOption]:
    """The chosen rung with expandable segments at the larger micro-batch its fit predicted for them, as an option
    with its time (fewer micro-batches per step than the plan's ``accumulation``), ranked with the others; empty
    when the larger micro-batch does not cut the micro-batches per step, or the step estimated at the split's
    micro-batch, with expandable segments and the gradients alive, does not fit after all. The plan itself keeps
    the allocator as it is: the setting must be made before the process first touches CUDA."""
    chosen = walk.chosen
    assert chosen is not None
    config, result, dev, gpus = chosen.config, chosen.result, walk.dev, walk.gpus
    grown = dataclasses.replace(config, setup=config.setup.with_fields(expandable_segments=True))
    splits = plan_splits(grown, walk.global_batch_size, gpus, size)
    micro, steps = max(max(s) for s in splits), max(len(s) for s in splits)
    if steps >= accumulation:
        return []
    traced = 2 if steps > 1 else 1  # any count >= 2 traces alike
    wl = with_accumulation(chosen.rank_workload(gpus), traced)
    shards, setup = config.arithmetic_shards(gpus), grown.setup
    est = fit_estimate_at(wl, dev, setup, shards > 1, shards, micro)
    if est.device_total_bytes > result.capacity_bytes:
        return []
    trace = trace_for_device(setup.workload(wl), micro, dev, setup.policy(dev), setup.classes(wl))
    whole = with_accumulation(chosen.workload, traced)
    return [timed_option(grown, whole, dev, gpus, walk.global_batch_size, walk.interconnect, size, trace,
                         est.device_total_bytes, result.capacity_bytes, (*config.remedies, EXPANDABLE))]  # fmt: skip


def _split_after_whole(config: Rung, before: list[Rung]) -> bool:
    """Whether ``config`` splits the model while a configuration before it keeps it whole.

    Tensor parallelism is the last remedy: its collectives sit in every layer, and a rank's step costs
    more to trace (a TP + SP x FSDP2 rank with every block, minutes for a 70B), so a plan fits split
    layouts only when nothing whole fits, or when ``tensor_parallel`` fixes the degree (the ladder then
    holds split layouts only)."""
    return config.tensor_parallel > 1 and any(c.tensor_parallel <= 1 for c in before)


def _tensor_parallel_degrees(
    wl: Workload, gpus: int, asked: int | None, sequence_parallel: bool | None, gpus_per_node: int
) -> tuple[tuple[int, ...], bool | None]:
    """The tensor-parallel degrees the ladder tries: the one asked for (checked), else every degree up to a
    node that splits the model's plan and divides the GPUs; none for a model without a plan. With them,
    sequence parallelism as asked, or off for a plan outside numbered blocks (which it needs).

    Raises:
        ConfigError: an asked degree that does not fit the model, a node or the GPUs (naming the valid
            ones), or sequence parallelism asked of a plan outside numbered blocks.
    """
    if asked is not None:
        check_batch_size(asked, "the tensor-parallel degree")
    check_batch_size(gpus_per_node, "GPUs per node")
    if asked == 1 or (asked is None and gpus == 1):
        return (), sequence_parallel
    facts = CACHE.fact("tensor-parallel facts", wl, None, lambda: split_facts(model_structure(wl), wl.tp_plan))
    if facts.error is None and not facts.blocks:
        if sequence_parallel:
            raise ConfigError(
                "sequence parallelism splits the activations of a model's repeated blocks (a numbered container "
                "like layers.0, layers.1), and this model's plan names none; drop --sp"
            )
        sequence_parallel = False
    if asked is not None:
        error = degree_error(asked, facts, gpus, gpus_per_node)
        if error is not None:
            raise ConfigError(error)
        return (asked,), sequence_parallel
    if facts.error is not None:
        return (), sequence_parallel
    degrees = tuple(d for d in facts.degrees if d <= gpus_per_node and gpus_per_node % d == 0 and gpus % d == 0)
    return degrees, sequence_parallel


def _scaled_lr(
    wl: Workload, global_batch_size: int, base_lr: float | None, base_batch_size: int | None, rule: str
) -> Any:
    """``LrScaling`` of ``base_lr`` to the global batch, or None without a reference learning rate."""
    if base_lr is None and base_batch_size is None:
        return None
    if base_lr is None or base_batch_size is None:
        raise ConfigError(
            "give both base_lr and base_batch_size (--base-lr, --base-batch-size): a learning rate and the "
            "global batch it was tuned at"
        )

    return lr_scaling(base_lr, base_batch_size, global_batch_size, rule, optimizer=wl.optimizer)
