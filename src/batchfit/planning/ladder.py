"""The ladder of configurations a plan tries: precision, sharding and checkpointing, cheapest remedies first.

``batchfit.plan`` walks this list in order and stops shortly after the first configuration that fits;
what each remedy costs the user, and so the order, is set out in NOTE [ Remedies ranked by what they
cost ] below. Nothing here traces or fits: a configuration is a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..gpu.catalog import Device

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
                if precision is not None:  # the user's own precision: not a remedy the plan applied
                    pass
                elif prec == "bf16-true":
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
