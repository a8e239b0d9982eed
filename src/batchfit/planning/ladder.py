"""The ladder of configurations a plan tries: precision, sharding and checkpointing, cheapest remedies first.

``batchfit.plan`` walks this list in order and stops shortly after the first configuration that fits;
what each remedy costs the user, and so the order, is set out in NOTE [ Remedies ranked by what they
cost ] below. Nothing here traces or fits: a configuration is a value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..activation_checkpointing import Checkpointing
from ..gpu.catalog import Device
from ..workload import AUTO, ParallelLayout, Setup

# NOTE [ Remedies ranked by what they cost ]
# Accumulation is free for the maths, so every configuration first splits the global batch into
# micro-batches. Beyond it, each remedy costs the user something, and they are tried cheapest first:
# mixed precision (autocast, fp32 master weights: faster, numerically standard), sharding across the
# GPUs given (communication), activation checkpointing (a recomputed forward, ~30% more time), tensor
# parallelism inside a node (collectives in every layer, forward and backward, on the critical path;
# smaller degrees first, each with sequence parallelism first: the same traffic, less memory), and last
# bf16 weights and optimizer states (a change to the training maths, chosen only when nothing else fits).
# A configuration's cost is its remedies' ranks, most expensive first, compared as tuples: mixed
# precision alone (1) < sharding (2) < sharding with mixed precision (2, 1) < checkpointing (3) < ...
# Tensor parallelism always comes with FSDP across the tensor-parallel groups (PyTorch's 2-D recipe).
_RANK = {"autocast": 1, "sharding": 2, "checkpointing": 3, "tensor parallel": 4, "bf16-true": 5}


@dataclass(frozen=True)
class Rung:
    """One configuration of the ladder: how each rank's step is run (its ``Setup``: precision and
    checkpointing), whether FSDP shards it, its tensor-parallel layout, and what those remedies cost."""

    setup: Setup
    sharded: bool
    remedies: tuple[str, ...]
    cost: tuple[int, ...]
    tensor_parallel: int = 1
    """GPUs of one tensor-parallel group (1: none); FSDP shards across the groups when there are several."""
    sequence_parallel: bool = False
    widest_sp: bool = False
    """Whether the ladder's layouts include sequence parallelism (the most split ones do then)."""
    degrees: tuple[int, ...] = ()
    """The ladder's tensor-parallel degrees (NOTE [ The most split layout first ])."""

    @property
    def widest(self) -> int:
        """The largest tensor-parallel degree of the ladder (1: none)."""
        return max(self.degrees, default=1)

    @property
    def precision(self) -> str:
        return self.setup.precision

    @property
    def checkpointing(self) -> Checkpointing:
        return self.setup.checkpointing

    def data_parallel(self, gpus: int) -> int:
        """Ranks that take different items of the global batch: the tensor-parallel groups."""
        return gpus // self.tensor_parallel

    def arithmetic_shards(self, gpus: int) -> int:
        """GPUs FSDP's shards are derived over from a whole step's trace (``memory/synthesis/sharding.py``): FSDP
        alone; under tensor parallelism one rank's step, FSDP included, is traced instead."""
        return gpus if self.sharded and self.tensor_parallel == 1 else 1

    def state_shards(self, gpus: int) -> int:
        """GPUs one rank's parameters, gradients and optimizer states are divided over: FSDP's, or a tensor-parallel
        group's with FSDP across the groups (every GPU either way), else 1 (each rank holds them whole)."""
        return gpus if self.sharded or self.tensor_parallel > 1 else 1

    def layout(self, gpus: int) -> ParallelLayout | None:
        """The ``ParallelLayout`` one rank of this configuration is traced in (None: no tensor parallelism)."""
        if self.tensor_parallel <= 1:
            return None
        return ParallelLayout(self.tensor_parallel, self.sequence_parallel, fsdp=self.data_parallel(gpus))


def ladder(
    device: Device, gpus: int, setup: Setup, has_blocks: bool, tp_degrees: tuple[int, ...] = (),
    sequence_parallel: bool | None = None,
) -> list[Rung]:  # fmt: skip
    """Every configuration the plan may choose, cheapest remedies first (NOTE above).

    ``setup``'s precision and checkpointing are chosen where they are ``"auto"`` and fixed otherwise; its
    other fields hold on every rung. ``tp_degrees``: the tensor-parallel degrees to try (each divides the
    model's heads, a node and the GPUs); ``sequence_parallel`` fixes sequence parallelism for them (None:
    with it, then without).
    """
    low = "bf16" if device.bf16 else "fp16"
    precisions = ["fp32", low] + (["bf16-true"] if device.bf16 else [])
    chosen = setup.precision == AUTO
    if not chosen:
        precisions = [setup.precision]
    if setup.checkpointing == AUTO:
        ck_options: list[Checkpointing] = [None] + (["blocks"] if has_blocks else [])
    else:
        ck_options = [setup.checkpointing]
    layouts: list[tuple[int, bool, bool]] = [(1, False, False)] + ([(1, False, True)] if gpus > 1 else [])
    sp_options = [True, False] if sequence_parallel is None else [bool(sequence_parallel)]
    layouts += [(d, sp, gpus > d) for d in tp_degrees for sp in sp_options]
    configs = []
    for prec in precisions:
        for ck in ck_options:
            for degree, sp, sharded in layouts:
                used: list[tuple[int, str]] = []
                if not chosen:  # the user's own precision: not a remedy the plan applied
                    pass
                elif prec == "bf16-true":
                    used.append((_RANK["bf16-true"], "bf16 weights and optimizer states"))
                elif prec != "fp32":
                    used.append((_RANK["autocast"], f"{prec} autocast"))
                if sharded:
                    used.append((_RANK["sharding"], "FSDP sharding"))
                if ck is not None:
                    used.append((_RANK["checkpointing"], "activation checkpointing"))
                if degree > 1:
                    used.append((_RANK["tensor parallel"], tensor_parallel_remedy(degree, sp)))
                used.sort()
                remedies = tuple(name for _, name in used)
                cost = tuple(sorted((r for r, _ in used), reverse=True))
                rung_setup = dataclasses.replace(setup, precision=prec, checkpointing=ck)
                configs.append(Rung(rung_setup, sharded, remedies, cost, degree, sp, True in sp_options,
                                    tuple(tp_degrees)))  # fmt: skip
    return sorted(configs, key=lambda c: (c.cost, c.tensor_parallel, not c.sequence_parallel))


# NOTE [ The most split layout first ]
# A 70B model's tensor-parallel rank at 32k tokens takes seconds to trace cut (a minute at full depth), and for a
# given precision and checkpointing most layouts do not fit even one item. Each rank's memory only falls
# as the degree grows and with sequence parallelism (parameters, gradients, states and the planned
# layers' activations are split further; the gathered sequence is the same size), so before any
# tensor-parallel layout is fitted, the most split one of its precision and checkpointing (the widest
# degree, with sequence parallelism where the ladder has it) is traced at one item: when even that does
# not fit, none of them does, and the others are skipped untraced. Then each degree between, widest first, with
# sequence parallelism where the ladder has it: the first that fits no item skips every layout less split than it
# (the ladder reaches tensor parallelism only when nothing whole fits, so its less split layouts often fit no
# item: one trace of the degree above them says so for all, and a degree that fits is one the walk fits soon).
# A layout that passes is traced at one item of its own before its fit: one trace says what a fit that finds
# nothing takes four to. Without sequence parallelism, its degree with it comes first (the ladder fitted it just
# before: the trace is kept), so a layout whose sequence-parallel twin fits no item is skipped untraced as well.
def more_split_first(config: Rung) -> list[tuple[Rung, str]]:
    """The layouts whose one-item step must fit before ``config`` is fitted, most split first, each with why it is
    traced: the most split one, the more split degrees between, ``config``'s degree with sequence parallelism, and
    ``config`` itself."""
    chain = [(_layout(config, config.widest, config.widest_sp), "the most split layout")]
    between = sorted((d for d in config.degrees if config.tensor_parallel < d < config.widest), reverse=True)
    chain += [(_layout(config, d, config.widest_sp), "a more split layout") for d in between]
    if config.widest_sp and not config.sequence_parallel:
        chain.append((_layout(config, config.tensor_parallel, True), "its degree with sequence parallelism"))
    chain.append((config, "before its fit"))
    out: list[tuple[Rung, str]] = []
    for layout, why in chain:
        if all(layout != seen for seen, _ in out):
            out.append((layout, why))
    return out


def _layout(config: Rung, degree: int, sequence_parallel: bool) -> Rung:
    """``config`` with another tensor-parallel layout, its remedies named for it."""
    name = tensor_parallel_remedy(degree, sequence_parallel)
    remedies = tuple(name if r.startswith("tensor parallel") else r for r in config.remedies)
    return dataclasses.replace(config, tensor_parallel=degree, sequence_parallel=sequence_parallel, remedies=remedies)


def tensor_parallel_remedy(degree: int, sequence_parallel: bool) -> str:
    """The remedy's name: ``tensor parallel 8 + sequence parallel``."""
    return f"tensor parallel {degree}" + (" + sequence parallel" if sequence_parallel else "")
