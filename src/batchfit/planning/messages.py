"""What a plan says besides its numbers: advice on the chosen micro-batch, where a model that fits
nowhere would fit, and a split of the global batch in words.

Each message names the observation and the change to make (a GPU, a GPU count, a layer to replace);
``batchfit.plan`` attaches them to the ``Plan`` or raises them, and ``report`` prints ``describe_split``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..advice.batchnorm import advice_for_layers, layer_facts
from ..errors import DoesNotFitError, TraceError
from ..gpu.catalog import Device, catalog
from ..memory.cache import CACHE
from ..memory.trace.fake_step import model_structure
from .estimate import fit_estimate_at
from .fit import fit
from .ladder import Rung

if TYPE_CHECKING:
    from ..workload import Workload


def _warnings(wl: Workload, micro: int, global_batch_size: int, gpus: int) -> tuple[str, ...]:
    layers = CACHE.fact("batchnorm layers", wl, None, lambda: layer_facts(model_structure(wl)))
    text = advice_for_layers(layers, micro, global_batch_size, gpus)
    return (text,) if text else ()


def expandable_remedy(micro: int, expandable: int) -> str:
    """The free remedy for fragmentation in one line, with the setting to make (``expandable_max_batch_size``)."""
    return (f"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and micro-batch {expandable} fits instead of "
            f"{micro} (predicted): the allocator's fragmentation, not the tensors, stops {micro + 1}; "
            "no speed cost")  # fmt: skip


_AN_LETTERS = frozenset("AEFHILMNORSX")  # letters whose names start with a vowel sound: "an H100", "an L4"


def with_article(name: str) -> str:
    """``name`` after "a" or "an" as it is read aloud: "an A100-40GB", "an H100-80GB", "an L4", "a V100-16GB",
    "an 80GB GPU" (eighty), "an 11GB GPU" (eleven), "a T4"."""
    head = name.lstrip()[:1].upper()
    if head.isdigit():
        digits = "".join(c for c in name.lstrip() if c.isdigit())
        vowel = digits.startswith("8") or (digits[:2] in ("11", "18") and len(digits) in (2, 5, 8))
    else:
        vowel = head in _AN_LETTERS
    return f"{'an' if vowel else 'a'} {name}"


def _nothing_fits(wl: Workload, dev: Device, gpus: int, rungs: list[Rung]) -> DoesNotFitError:
    """One line naming where it would fit: the smallest catalog GPU, or enough GPUs to shard over."""
    unsharded = [r for r in rungs if not r.sharded and r.tensor_parallel == 1] or rungs
    setup = unsharded[-1].setup
    prec, ck = setup.precision, setup.checkpointing
    where = []
    for other in catalog():
        if (other.total_bytes or 0) <= (dev.total_bytes or 0):
            continue
        p = prec if (other.bf16 or prec in ("fp32", "fp16")) else "fp16"
        try:
            fit(wl, other, setup=setup.with_fields(precision=p), verify=False)
        except DoesNotFitError:
            continue
        where.append(f"{with_article(other.name)} ({p}{' + checkpointing' if ck else ''})")
        break
    for n in (2, 4, 8, 16, 32, 64):
        if n <= gpus:
            continue
        try:
            fit(wl, dev, setup=setup, shard_over=n, verify=False)
        except DoesNotFitError:
            continue
        where.append(f"{n} x {dev.name} with FSDP sharding (--gpus {n})")
        break
    remedies: list[str] = []
    for rung in rungs:
        remedies += [name for name in rung.remedies if name not in remedies]
    tried = ", ".join(["accumulation alone", *remedies])
    hint = " or ".join(where) if where else "no catalog GPU or GPU count up to 64"
    items, why = _fewest_items(wl, dev, rungs[-1])
    return DoesNotFitError(
        f"{wl.name} does not fit on {gpus} x {dev.name} even with {items} per GPU (tried: {tried}{why}); "
        f"it would fit on {hint}"
    )


def _fewest_items(wl: Workload, dev: Device, rung: Rung) -> tuple[str, str]:
    """"one item", or "two items" and why when a step of one item cannot run at all (BatchNorm after a
    global pooling needs two values per channel): the fits then tried two, and the message says so."""
    try:
        fit_estimate_at(wl, dev, rung.setup, False, gpus=1, batch_size=1)
    except TraceError as e:
        return "two items", f"; a step of one item cannot run: {e}"
    return "one item", ""


def describe_split(splits: list[list[int]], ranks: str = "ranks") -> str:
    """``"42 x 11 + 5 x 10"`` per rank, ranks with the same split written once (``"2 ranks: ..."``);
    ``ranks`` names them (``"groups"``: tensor-parallel groups, each one data-parallel rank)."""

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
        return text if len(splits) == 1 else f"each of {len(splits)} {ranks}: {text}"
    one = ranks[:-1]
    return "; ".join(
        f"{ranks} {ids[0]}-{ids[-1]}: {text}" if len(ids) > 1 else f"{one} {ids[0]}: {text}"
        for text, ids in groups.items()
    )
