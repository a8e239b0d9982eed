"""Tests of ``batchfit.plan``: exact splits of any global batch, and the remedies ladder.

The splitting functions are pure and cheap, so they are checked exhaustively over every global batch
up to 300 and every GPU count up to 8. The ladder is checked by computing, with the estimator, the
memory of one item under each remedy and setting the device's capacity exactly there: the plan must
then pick that remedy and no earlier one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from batchfit import ConfigError, DoesNotFitError, Estimate, TraceError, Workload, estimate, get_device, presets
from batchfit.batching import make_splits, rank_shares, split_share
from batchfit.gpu.catalog import Device
from batchfit.memory.estimate import with_accumulation
from batchfit.memory.synthesis.sharding import unit_of
from batchfit.models import hf
from batchfit.planning.fit import fit
from batchfit.planning.ladder import ladder
from batchfit.planning.plan import describe_split, fit_estimate_at, plan
from batchfit.train.fsdp import fsdp_units
from batchfit.workload import AUTO, Setup

CHOOSE = Setup(precision=AUTO, checkpointing=AUTO)
"""What a plan starts from when nothing is fixed: it chooses the precision and the checkpointing."""

MLP = presets.get("mlp")
GPT = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
CNN = presets.get("cnn")
# The same small GPT with long sequences: at one item its activations, not the cuBLAS workspaces and
# the allocator's segments, set the peak, so every remedy of the ladder lowers the memory of one item.
LONG_GPT = presets.get("gpt", n_layer=2, n_embd=256, n_head=2, vocab_size=256, seq_len=2048)

MAX_MICROS = [*range(1, 65), 97, 128, 150, 299, 300, 1000]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- splitting: exhaustive ------------------------------------------------------------------------------
def test_rank_shares_are_as_equal_as_possible_and_sum_to_the_global_batch() -> None:
    for gpus in range(1, 9):
        for global_batch_size in range(gpus, 301):
            shares = rank_shares(global_batch_size, gpus)
            assert len(shares) == gpus
            assert sum(shares) == global_batch_size
            assert max(shares) - min(shares) <= 1
            assert shares == sorted(shares, reverse=True)  # the first ranks take the extra items


def test_split_share_uses_the_fewest_micro_batches_and_is_equal_whenever_it_can_be() -> None:
    for max_micro in range(1, 301):
        for share in range(1, 301):
            pieces = split_share(share, max_micro)
            fewest = ceil_div(share, max_micro)
            assert sum(pieces) == share
            assert max(pieces) <= max_micro
            assert min(pieces) >= 1
            assert len(pieces) == fewest
            assert max(pieces) - min(pieces) <= 1
            assert pieces == sorted(pieces, reverse=True)
            # An equal split into the fewest micro-batches exists exactly when their count divides the share.
            assert (len(set(pieces)) == 1) == (share % fewest == 0), (share, max_micro, pieces)
    assert split_share(0, 8) == []


def test_make_splits_sum_to_the_global_batch_never_exceed_the_max_and_are_equal_when_possible() -> None:
    for gpus in range(1, 9):
        for global_batch_size in range(gpus, 301):
            shares = rank_shares(global_batch_size, gpus)
            for max_micro in MAX_MICROS:
                splits = make_splits(global_batch_size, gpus, max_micro)
                assert len(splits) == gpus
                assert [sum(s) for s in splits] == shares
                assert sum(map(sum, splits)) == global_batch_size
                assert all(1 <= m <= max_micro for s in splits for m in s)
                assert [len(s) for s in splits] == [ceil_div(x, max_micro) for x in shares]  # fewest per rank
                # If every rank can run the same number of equal micro-batches, the fewest there can be,
                # the split must be exactly that.
                steps = ceil_div(shares[0], max_micro)
                micro, rest = divmod(global_batch_size, gpus * steps)
                if rest == 0 and micro <= max_micro:
                    assert splits == [[micro] * steps] * gpus, (global_batch_size, gpus, max_micro, splits)


def test_make_splits_for_fsdp_give_every_rank_the_busiest_rank_s_count_whenever_each_share_can_fill_it() -> None:
    """Under FSDP every micro-batch is a collective, so ranks must run equally many of them."""
    for gpus in range(1, 9):
        for global_batch_size in range(gpus, 301):
            shares = rank_shares(global_batch_size, gpus)
            for max_micro in MAX_MICROS:
                splits = make_splits(global_batch_size, gpus, max_micro, same_count=True)
                assert [sum(s) for s in splits] == shares
                busiest = ceil_div(shares[0], max_micro)  # the fewest micro-batches the largest share needs
                assert [len(s) for s in splits] == [busiest] * gpus
                assert all(max(s) - min(s) <= 1 and max(s) <= max_micro for s in splits)
                padding = sum(m == 0 for s in splits for m in s)
                if all(share >= busiest for share in shares):
                    assert padding == 0
                else:  # one item per micro-batch: the smaller shares end with one empty (padding) piece each
                    assert max_micro == 1 and padding == sum(shares[0] - share for share in shares)
                    assert all(s[-1] == 0 for s, share in zip(splits, shares) if share < busiest)


# -- plan end to end ----------------------------------------------------------------------------------
def test_plan_of_the_docstring_example() -> None:
    p = plan("mlp", 300, device="1GiB", gpus=3)
    assert p.splits == [[100], [100], [100]]
    assert (p.micro_batch_size, p.accumulation_steps, p.gpus) == (100, 1, 3)
    assert (p.precision, p.checkpointing, p.sharded, p.remedies) == ("fp32", False, False, ())
    assert p.items_per_step == 300
    assert p.tokens_per_step is None  # not a token model


@pytest.mark.parametrize(
    ("workload", "global_batch_size", "gpus"),
    [(GPT, 10_000, 2), (CNN, 5_001, 3), (GPT, 7, 7)],
)
def test_plan_splits_by_the_fitted_maximum(workload, global_batch_size: int, gpus: int) -> None:
    """The precision is pinned: this is about splitting, the ladder has its own tests below."""
    device = "1GiB"
    p = plan(workload, global_batch_size, device=device, gpus=gpus, precision="fp32", checkpointing=False)
    share = rank_shares(global_batch_size, gpus)[0]
    # A share of several micro-batches is fitted as the accumulating step (gradients alive in its later forwards)
    fitted = fit(with_accumulation(workload, 2) if share > 1 else workload, device)
    assert (p.precision, p.checkpointing, p.sharded) == ("fp32", False, False)
    assert p.max_micro_batch_size == min(fitted.max_batch_size, share)  # no search beyond a rank's share
    assert p.splits == make_splits(global_batch_size, gpus, p.max_micro_batch_size)
    assert p.micro_batch_size == max(max(s) for s in p.splits) <= fitted.max_batch_size
    assert p.accumulation_steps == max(len(s) for s in p.splits)
    assert p.items_per_step == global_batch_size
    expected_tokens = workload.tokens_per_item * global_batch_size if workload.tokens_per_item else None
    assert p.tokens_per_step == expected_tokens
    # The estimate is that of the micro-batch the plan runs, and it fits with the reported headroom.
    assert p.estimate.batch_size == p.micro_batch_size
    assert p.estimate.device_total_bytes == estimate(workload, p.micro_batch_size, device=device).device_total_bytes
    assert p.headroom_bytes == fitted.capacity_bytes - p.estimate.device_total_bytes >= 0


def test_plan_to_dict_is_json_with_the_documented_fields() -> None:
    # bf16-true on two GPUs: four configurations keep that precision, so there are alternatives to show.
    p = plan(GPT, 5_000, device="1GiB", gpus=2, precision="bf16-true")
    assert (p.precision, p.checkpointing, p.sharded) == ("bf16-true", False, False)
    assert not p.changes_numerics and p.remedies == ()  # the precision asked for is not a remedy the plan chose
    d = json.loads(json.dumps(p.to_dict()))
    for name in (
        "micro_batch_size",
        "accumulation_steps",
        "gpus",
        "precision",
        "checkpointing",
        "splits",
        "estimate",
        "headroom_bytes",
        "alternatives",
        "predicted_step_s",
        "interconnect",
    ):
        assert name in d, name
    assert d["splits"] == p.splits
    assert d["micro_batch_size"] == p.micro_batch_size
    assert d["estimate"]["device_total_bytes"] == p.estimate.device_total_bytes
    alternatives = {(a["checkpointing"], a["sharded"]) for a in d["alternatives"]}
    assert alternatives == {(False, True), (True, False), (True, True)}
    assert all(a["precision"] == "bf16-true" and not a["changes_numerics"] for a in d["alternatives"])
    times = [a["predicted_step_s"] for a in d["alternatives"]]
    assert times == sorted(times) and all(t > 0 for t in times)


# -- the remedies ladder --------------------------------------------------------------------------------
def _order(device: str, gpus: int, has_blocks: bool = True) -> list[tuple[str, bool, bool]]:
    return [(c.precision, c.checkpointing is not None, c.sharded)
            for c in ladder(get_device(device), gpus, CHOOSE, has_blocks)]  # fmt: skip


def test_the_ladder_tries_remedies_cheapest_first() -> None:
    """Accumulation, then mixed precision, sharding, checkpointing, and bf16 weights last."""
    assert _order("A100-40GB", 2) == [
        ("fp32", False, False),
        ("bf16", False, False),
        ("fp32", False, True),
        ("bf16", False, True),
        ("fp32", True, False),
        ("bf16", True, False),
        ("fp32", True, True),
        ("bf16", True, True),
        ("bf16-true", False, False),
        ("bf16-true", False, True),
        ("bf16-true", True, False),
        ("bf16-true", True, True),
    ]
    # Without native bf16 (T4, V100): fp16 autocast, and no bf16 weights to fall back on; one GPU: no FSDP.
    assert _order("T4", 1) == [("fp32", False, False), ("fp16", False, False), ("fp32", True, False),
                               ("fp16", True, False)]  # fmt: skip
    assert _order("T4", 1, has_blocks=False) == [("fp32", False, False), ("fp16", False, False)]


def one_item(device: Device, rung: tuple[str, bool, bool], gpus: int) -> Estimate:
    """The estimate of one item on ``device`` under ``rung``, from the estimator (not from the planner).

    With accumulation: every plan below has more items per GPU than fit in one micro-batch.
    """
    precision, checkpointing, sharded = rung
    wl = dataclasses.replace(LONG_GPT, accumulation_steps=2)
    return fit_estimate_at(wl, device, Setup(precision, "blocks" if checkpointing else None), sharded, gpus, 1)


def one_item_bytes(device: Device, rung: tuple[str, bool, bool], gpus: int) -> int:
    """What one item needs on ``device`` under ``rung``: the smallest capacity, from what it reserves with room
    to spare down in 2 MiB steps (a large segment's rounding), at which the allocator model, releasing cached
    segments where the capacity is short, still completes the step."""
    need = one_item(device, rung, gpus).device_total_bytes
    while one_item(device.with_overrides(total_bytes=need - (2 << 20)), rung, gpus).fits:
        need -= 2 << 20
    return need


@pytest.fixture(scope="module")
def needs() -> dict[tuple[str, bool, bool], int]:
    device = get_device("1GiB")
    return {rung: one_item_bytes(device, rung, 2) for rung in _order("1GiB", 2)}


def test_the_plan_is_the_cheapest_configuration_that_fits(needs: dict[tuple[str, bool, bool], int]) -> None:
    """At every capacity, the plan takes the first configuration of the ladder whose one item fits (the
    model left whole: splitting it is ``test_parallel_plan.py``'s)."""
    order = _order("1GiB", 2)
    checked = set()
    for capacity in sorted(set(needs.values()), reverse=True):
        device = get_device("1GiB").with_overrides(total_bytes=capacity)
        # Decided at that capacity: near it the allocator model releases cached segments, so whether a rung fits
        # need not follow the order of what each reserves with room to spare.
        expected = next(rung for rung in order if one_item(device, rung, 2).fits)
        if expected in checked:
            continue
        checked.add(expected)
        p = plan(LONG_GPT, 64, device=device, gpus=2, tensor_parallel=1)
        assert (p.precision, p.checkpointing, p.sharded) == expected, capacity
        assert p.estimate.device_total_bytes <= capacity and p.headroom_bytes >= 0
        assert sum(map(sum, p.splits)) == 64
        assert any("FSDP" in r for r in p.remedies) == expected[2]
        assert p.changes_numerics == (expected[0] == "bf16-true")
    assert len(checked) >= 4  # the capacities tell several configurations apart


def test_a_plan_that_fits_the_model_whole_fits_no_split_layout(needs: dict) -> None:
    """Splitting the model is the last remedy: where a whole configuration fits (here only with FSDP and
    checkpointing), no tensor-parallel layout is traced, as the choice or as an alternative."""
    device = get_device("1GiB").with_overrides(total_bytes=needs[("bf16", True, True)])
    p = plan(LONG_GPT, 64, device=device, gpus=2)
    assert (p.precision, p.checkpointing, p.sharded, p.tensor_parallel) == ("bf16", True, True, 1)
    assert p.alternatives and all(a.tensor_parallel == 1 for a in p.alternatives)


def test_a_sharded_plan_gives_every_rank_the_same_number_of_micro_batches(needs: dict) -> None:
    device = get_device("1GiB").with_overrides(total_bytes=needs[("fp32", False, True)])
    p = plan(LONG_GPT, 3, device=device, gpus=2, precision="fp32", checkpointing=False)
    assert p.sharded
    assert len({len(s) for s in p.splits}) == 1, p.splits


def test_a_gpu_without_bf16_plans_with_fp16() -> None:
    t4 = get_device("T4")
    need = one_item_bytes(t4, ("fp16", False, False), 1)
    assert need < one_item_bytes(t4, ("fp32", False, False), 1)
    p = plan(LONG_GPT, 64, device=t4.with_overrides(total_bytes=need), gpus=1)
    assert (p.precision, p.checkpointing, p.sharded) == ("fp16", False, False)
    assert all("bf16" not in r for r in p.remedies) and all(a.precision != "bf16-true" for a in p.alternatives)


def test_nothing_fits_names_a_larger_gpu_or_a_gpu_count_where_it_would(needs: dict) -> None:
    # One byte short of the smallest allocated peak (and the context) of the ladder: nothing on it can fit.
    one_gib = get_device("1GiB")
    total = min(one_item(one_gib, rung, 2).peak_allocated_bytes for rung in needs) + one_gib.context_bytes - 1
    device = one_gib.with_overrides(total_bytes=total)
    with pytest.raises(DoesNotFitError) as info:
        plan(LONG_GPT, 64, device=device, gpus=2)
    message = str(info.value)
    assert "\n" not in message
    assert "would fit on" in message
    larger = re.search(r"a (\S+) \((\S+?)( \+ checkpointing)?\)", message)
    more = re.search(r"--gpus (\d+)", message)
    assert larger or more, message
    if larger:  # a catalog GPU, larger than this one, on which it really fits
        other = get_device(larger.group(1))
        assert other.total_bytes > total
        ck = "blocks" if larger.group(3) else None
        there = estimate(LONG_GPT, 1, device=other, precision=larger.group(2), checkpointing=ck)
        assert there.device_total_bytes <= other.total_bytes
    if more:
        assert int(more.group(1)) > 2


# -- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("global_batch_size", "gpus", "device", "match"),
    [
        (0, 1, "1GiB", "global batch size"),
        (-4, 1, "1GiB", "global batch size"),
        (2.5, 1, "1GiB", "global batch size"),
        (8, 0, "1GiB", "GPUs"),
        (8, -1, "1GiB", "GPUs"),
        (3, 4, "1GiB", "--global-batch-size >= 4"),
        (8, 1, "cpu", "capacity"),
    ],
)
def test_bad_input_is_a_one_line_config_error(global_batch_size, gpus, device: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        plan(MLP, global_batch_size, device=device, gpus=gpus)
    assert "\n" not in str(info.value)


def test_describe_split_names_runs_ranks_and_padding() -> None:
    assert describe_split([[42] * 11 + [41] * 5]) == "11 x 42 + 5 x 41"
    assert describe_split([[4, 3, 3], [4, 3, 3]]) == "each of 2 ranks: 1 x 4 + 2 x 3"
    assert describe_split([[1, 1], [1, 0]]) == "rank 0: 2 x 1; rank 1: 1 x 1 + 1 padding"
    assert describe_split([[2, 2], [2, 2], [2, 1]]) == "ranks 0-1: 2 x 2; rank 2: 1 x 2 + 1 x 1"


ACCUMULATING_GPT = presets.get("gpt", n_layer=2, n_embd=256, n_head=2, vocab_size=4096, seq_len=128)


def test_a_plan_that_accumulates_fits_with_the_gradients_alive() -> None:
    """Micro-batches 2..k run with the gradients alive: a micro-batch that fits a plain step may not."""
    base = get_device("8GiB")
    device = base.with_overrides(total_bytes=estimate(ACCUMULATING_GPT, 16, device=base).device_total_bytes)
    assert fit(ACCUMULATING_GPT, device).max_batch_size >= 16  # a plain step of 16 fits...
    assert estimate(ACCUMULATING_GPT, 16, device=device, accumulation_steps=2).device_total_bytes > device.total_bytes
    p = plan(ACCUMULATING_GPT, 64, device=device)  # ...but 64 items need accumulation, and 16 then does not fit
    assert p.accumulation_steps > 1 and p.micro_batch_size < 16 and sum(p.splits[0]) == 64
    assert p.estimate.accumulation_steps == p.accumulation_steps
    assert p.estimate.device_total_bytes <= device.total_bytes
    one_window = plan(ACCUMULATING_GPT, 16, device=device)  # no accumulation: the plain step is the step
    assert one_window.splits == [[16]] and one_window.estimate.accumulation_steps == 1


@pytest.mark.parametrize(
    "name, shape",
    [
        ("gpt", dict(n_layer=3, n_embd=32, n_head=2, vocab_size=64, seq_len=8)),
        pytest.param(
            "hf-llama-7b",
            dict(layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64, seq_len=8),
            marks=pytest.mark.skipif(not hf.available(), reason="transformers is not installed"),
        ),
    ],
)
def test_the_units_fsdp_runs_are_the_units_the_estimate_assumes(name: str, shape: dict) -> None:
    """``fully_shard`` per numbered block, the root for the rest (an untied head included)."""
    model = presets.get(name, **shape).build_model()
    runtime = {path for path, module in model.named_modules() if any(module is u for u in fsdp_units(model))}
    assumed = {unit_of(path.rpartition(".")[0]) for path, _ in model.named_parameters()}
    assert runtime and assumed == runtime | {""}


def test_progress_announces_every_step_a_cold_plan_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchfit.memory.cache import CACHE

    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path))  # cold: nothing traced before
    wl = presets.get("gpt", n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=16)
    lines: list[str] = []
    misses = CACHE.misses
    p = plan(wl, 64, device="410MiB", progress=lines.append)
    # The accumulating step fits 63 of the 64 items; the whole share as one micro-batch fits: its
    # trace is the one the accumulating step at 64 was written from (memory/synthesis/accumulation.py).
    assert (p.micro_batch_size, p.accumulation_steps) == (64, 1)
    assert "fp32: tracing a step of 64 items" in lines
    assert len(lines) == CACHE.misses - misses == 10


class _Positions(nn.Module):
    """Token ids to logits over a learned position table of one row per position, broadcast over the batch: at one
    item its gradient is the output's, at more a sum over the batch (a reduction one item does not run)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(4000, 64), nn.Parameter(torch.zeros(1, 512, 64))
        self.head = nn.Linear(64, 4000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) + self.positions)


def test_a_whole_share_far_past_the_line_of_the_accumulating_steps_is_not_traced() -> None:
    """The accumulating step fits one item, not two, so the search draws no line of traces, and the plain steps'
    line through 1 and 2 does not align (at one item the broadcast needs no reduction); the whole share of eight as
    one micro-batch lies far past the line through the two traced totals, so it is not traced (for a large model's
    tensor-parallel rank, seconds of tracing for nothing)."""
    wl = Workload(model=_Positions, batch=lambda b: (torch.randint(0, 4000, (b, 512)),) * 2,
                  loss=lambda m, b: nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()),
                  name="positions")  # fmt: skip
    device = get_device("A100-80GB")
    one, two = (estimate(wl, b, device=device, accumulation_steps=2).device_total_bytes for b in (1, 2))
    lines: list[str] = []
    p = plan(wl, 8, device=device.with_overrides(total_bytes=(one + two) // 2), setup=Setup(precision="fp32"),
             progress=lines.append, workers=1)  # fmt: skip
    assert (p.max_micro_batch_size, p.accumulation_steps) == (1, 8)
    assert "fp32: tracing a step of 8 items as one micro-batch" not in lines, lines


class _MixedScatter(nn.Module):
    """Under autocast its scatter gets a bf16 buffer and fp32 values (softmax runs in fp32): the step fails
    in mixed precision, as it would on a GPU, and runs in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        vals, idx = logits.topk(2, -1)
        return self.head(torch.zeros_like(logits).scatter(-1, idx, vals.softmax(-1)) * logits)


def test_a_configuration_whose_step_fails_is_left_out_and_named_not_the_end_of_the_plan() -> None:
    wl = Workload(model=_MixedScatter, batch=lambda b: (torch.randn(b, 16), torch.randint(0, 2, (b,))),
                  loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), name="mixed-scatter")  # fmt: skip
    with pytest.raises(TraceError, match="scatter"):
        estimate(wl, 4, device="A100-80GB", precision="bf16")
    p = plan(wl, 24, device="A100-80GB", gpus=2)
    assert p.precision == "fp32" and p.micro_batch_size == 12
    assert all("bf16 autocast" not in a.remedies for a in p.alternatives)
    left_out = [w for w in p.warnings if w.startswith("not considered: bf16 autocast")]
    assert left_out and all("scatter" in w for w in left_out), p.warnings
    # The step as asked (the plan's first configuration) failing is the plan's error.
    with pytest.raises(TraceError, match="scatter"):
        plan(wl, 24, device="A100-80GB", gpus=2, precision="bf16")


def test_a_failing_meta_kernel_is_one_error_without_torchs_logged_traceback(caplog: pytest.LogCaptureFixture) -> None:
    wl = Workload(model=_MixedScatter, batch=lambda b: (torch.randn(b, 16), torch.randint(0, 2, (b,))),
                  loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), name="mixed-scatter")  # fmt: skip
    with caplog.at_level("ERROR"), pytest.raises(TraceError):
        estimate(wl, 3, device="A100-80GB", precision="bf16")
    assert not [r for r in caplog.records if r.name.startswith("torch")], caplog.text


class _BrokenWide(nn.Module):
    """8M parameters and a forward that fails for any precision (a shape bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4096, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(-1, 7)


def test_a_broken_step_is_the_plans_error_even_when_the_first_configuration_needs_no_trace() -> None:
    wl = Workload(model=_BrokenWide, batch=lambda b: (torch.randn(b, 4096), torch.zeros(b).long()),
                  loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), name="broken-wide")  # fmt: skip
    # fp32 states (16 bytes a parameter, 128 MiB) exceed this device; bf16 weights and states (64 MiB) do not:
    # the first configuration traced fails, and nothing has run before it.
    base = get_device("1GiB")
    device = base.with_overrides(total_bytes=base.context_bytes + (100 << 20))
    with pytest.raises(TraceError, match="view"):
        plan(wl, 8, device=device)
