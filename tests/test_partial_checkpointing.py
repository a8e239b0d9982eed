"""Checkpointing some blocks (NOTE [ Checkpointing some blocks ] in ``activation_checkpointing.py``): the first k
blocks or blocks by index, exact on the CPU for a decoder, an encoder, an encoder-decoder and a CNN; a
transformers model keeps its own switch (the unchosen layers' flags off); training with it computes the
unchecked run's losses and gradients."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from zoo import BY_NAME, deeper

import batchfit
from batchfit import presets
from batchfit.activation_checkpointing import (
    apply_checkpointing,
    checkpoint_blocks_of,
    checkpoint_classes,
    only_blocks,
    selected_blocks,
)
from batchfit.memory.measure import measure_cpu_peak
from batchfit.models import hf
from batchfit.sources import as_workload

pytestmark = pytest.mark.usefixtures("one_thread")

needs_hf = pytest.mark.skipif(not hf.available(), reason="needs transformers")


def _zoo(name: str, layers: int = 4) -> batchfit.Workload:
    return as_workload(deeper(BY_NAME[name].make, layers)())


CASES = {
    "gpt": lambda: presets.get("gpt", n_layer=4, n_embd=32, n_head=2, vocab_size=96, seq_len=64),
    "cnn": lambda: presets.get("cnn", image_size=16, width=4, stages=3, blocks=2),
    "llama": lambda: _zoo("llama-gqa"),
    "bert": lambda: _zoo("bert"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[needs_hf] if n in ("llama", "bert") else []) for n in CASES])
def test_some_blocks_checkpointed_are_the_allocators_peak(name: str) -> None:
    wl = CASES[name]()
    first, spread = (batchfit.estimate(wl, 2, device="cpu", checkpointing=ck) for ck in (1, [1, 3]))
    assert first.peak_allocated_bytes == measure_cpu_peak(wl, 2, checkpointing=1)
    if name in ("gpt", "llama"):  # blocks by index through both ways a model is checkpointed
        assert spread.peak_allocated_bytes == measure_cpu_peak(wl, 2, checkpointing=[1, 3])
    assert first.checkpointing and spread.checkpointing
    assert first.peak_allocated_bytes != spread.peak_allocated_bytes  # the selection is what runs
    mixed = batchfit.estimate(wl, 2, device="cpu", checkpointing="1+selective")  # the others selectively
    assert mixed.peak_allocated_bytes == measure_cpu_peak(wl, 2, checkpointing=(0, "selective"))
    assert mixed.checkpointed_blocks == (0,) and mixed.selective_checkpointing


def test_some_blocks_save_some_of_what_every_block_saves() -> None:
    wl = CASES["gpt"]()
    peaks = [batchfit.estimate(wl, 4, device="A100-80GB", checkpointing=ck).peak_allocated_bytes
             for ck in (None, 1, 2, 3, "blocks")]  # fmt: skip
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 5


def test_the_first_k_blocks_peak_no_higher_than_k_blocks_that_recompute_the_last_one() -> None:
    """Every selection of k blocks keeps the same activations alive at the end of the forward; one that holds the
    last block recomputes it when backward starts, at the peak (NOTE [ Checkpointing some blocks ])."""
    wl = presets.get("gpt", n_layer=6, n_embd=64, n_head=2, vocab_size=96, seq_len=32)
    peak = {ck: batchfit.estimate(wl, 8, device="A100-80GB", checkpointing=ck).peak_allocated_bytes
            for ck in ((0, 1, 2), (0, 2, 4), (3, 4, 5))}  # fmt: skip
    assert peak[(0, 1, 2)] <= peak[(0, 2, 4)] < peak[(3, 4, 5)]


@needs_hf
def test_a_transformers_model_keeps_its_switch_with_only_the_chosen_layers_on() -> None:
    wl = _zoo("llama-gqa")
    model = wl.build_model()
    classes = checkpoint_classes([0, 2], wl.checkpoint_blocks)
    assert selected_blocks(classes) == (0, 2)
    assert apply_checkpointing(model, classes) == 2
    layers = checkpoint_blocks_of(model, wl.checkpoint_blocks)
    assert [m.gradient_checkpointing for m in layers] == [True, False, True, False]
    assert all("forward" not in vars(m) for m in layers)  # flagged by transformers' switch, not wrapped


def test_a_selection_is_one_marker_that_pickles_by_name() -> None:
    marker = only_blocks((0, 1, 2))
    assert marker is only_blocks((0, 1, 2)) and marker is not only_blocks((0, 1))
    assert pickle.loads(pickle.dumps(marker)) is marker
    assert checkpoint_classes(3, (torch.nn.Linear,)) == (torch.nn.Linear, marker)
    assert checkpoint_classes(0, (torch.nn.Linear,)) == ()


@pytest.mark.parametrize("setting", [[0, 2], (0, 2, "selective")], ids=["blocks 0 and 2", "the rest selectively"])
def test_training_with_some_blocks_checkpointed_is_the_unchecked_run(setting: object) -> None:
    """Two optimizer steps of a float64 model with blocks 0 and 2 checkpointed (and the others selectively): the
    same losses and gradients, to the bit, as without checkpointing."""
    wl = presets.get("gpt", n_layer=4, n_embd=32, n_head=2, vocab_size=96, seq_len=16)
    torch.manual_seed(0)
    plain = wl.build_model().double()
    partial = copy.deepcopy(plain)
    wrapped = apply_checkpointing(partial, checkpoint_classes(setting, wl.checkpoint_blocks))
    assert wrapped == (4 if "selective" in setting else 2)  # type: ignore[operator]
    runs = []
    for model in (plain, partial):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, grads = [], []
        for step in range(2):
            torch.manual_seed(step)
            total, tokens = wl.loss(model, wl.batch(3))  # summed over the tokens (batchfit's token-level loss)
            loss = total / tokens
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        runs.append((losses, grads))
    (losses_a, grads_a), (losses_b, grads_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    assert all(torch.equal(a, b) for ga, gb in zip(grads_a, grads_b) for a, b in zip(ga, gb))


# -- a plan checkpoints the fewest blocks its micro-batch needs ----------------------------------------------------
LONG = presets.get("gpt", n_layer=6, n_embd=64, n_head=2, vocab_size=128, seq_len=1024)
"""Activations large beside the allocator's 2 MiB segments: one block checkpointed more or less shows."""


def _just_short_of_one_plain_item() -> batchfit.Device:
    """A GPU (no context) one byte short of one item without checkpointing: the plan must checkpoint."""
    from batchfit import SimulatedDevice

    plain = batchfit.estimate(LONG, 1, device=SimulatedDevice("1GiB").device).device_total_bytes
    return SimulatedDevice(f"{plain - 1}B").device


def test_fit_auto_checkpoints_the_fewest_blocks_its_micro_batch_needs(capsys: pytest.CaptureFixture) -> None:
    """``fit --checkpointing auto -b 64``: 64 items fit with every block checkpointed and with the fewest first blocks
    the estimates say (some, not all, of 4 on a 445 MiB GPU); 4 items need none. The steps it looked at are the
    estimates of those settings."""
    import json

    from batchfit.cli import main

    gpt = ["gpt", "--set", "n_layer=4", "--set", "n_embd=32", "--set", "n_head=2", "--set", "vocab_size=96",
           "--seq-len", "64", "--device", "445MiB"]  # fmt: skip
    assert main(["fit", *gpt, "--checkpointing", "auto", "-b", "64", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    wl, dev = CASES["gpt"](), "445MiB"
    budget = got["capacity_bytes"]

    def total(ck: object, batch: int = 64) -> int:
        return batchfit.estimate(wl, batch, device=dev, checkpointing=ck).device_total_bytes

    fewest = next(k for k in range(5) if total(k or None) <= budget)
    assert 0 < fewest < 4  # the case in question: some blocks, not all
    assert (got["max_batch_size"], got["checkpointing"], got["checkpointed_blocks"]) == (64, True, fewest)
    assert got["estimate"]["device_total_bytes"] == total(fewest) and got["estimate"]["checkpointed_blocks"] == list(
        range(fewest)
    )
    looked = {a["checkpointed_blocks"]: a["device_total_bytes"] for a in got["attempts"] if a["checkpointed_blocks"]}
    assert looked == {k: total(k) for k in looked} and {fewest - 1, fewest} - {0} <= set(looked)
    with pytest.raises(batchfit.ConfigError, match="on a modelled GPU"):  # real steps cannot look at many settings
        batchfit.fit(wl, "cuda", checkpointing="auto")
    small = batchfit.fit(wl, dev, checkpointing="auto", max_batch_size=4)
    assert (small.max_batch_size, small.checkpointing, small.checkpointed_blocks) == (4, False, None)
    assert small.estimate.device_total_bytes == total(None, 4) <= budget


def test_a_plan_checkpoints_the_fewest_blocks_that_fit_and_shows_every_block_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One item needs some of 6 blocks checkpointed: of the fewest first blocks with the others kept and every block
    selectively (NOTE [ Some blocks whole, the rest selectively ]) the plan takes the faster, and shows every block
    beside it."""
    from batchfit.memory.cache import CACHE

    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path))  # cold: every step this plan looks at is traced here
    dev = _just_short_of_one_plain_item()
    lines: list[str] = []
    misses = CACHE.misses
    p = batchfit.plan(LONG, 4, device=dev, precision="fp32", progress=lines.append)
    assert len(lines) == CACHE.misses - misses  # a line for each step traced, the block searches' too
    assert any(line.startswith("checkpointing 0 of 6 blocks, the rest selectively") for line in lines)
    again: list[str] = []
    assert batchfit.plan(LONG, 4, device=dev, precision="fp32", progress=again.append) == p
    assert again == [] and CACHE.misses == misses + len(lines)  # nothing traced again, nothing announced
    capacity = p.headroom_bytes + p.estimate.device_total_bytes  # what the plan's fit kept room for

    def total(ck: object) -> int:
        return batchfit.estimate(LONG, p.micro_batch_size, device=dev, checkpointing=ck,
                                 accumulation_steps=p.accumulation_steps).device_total_bytes  # fmt: skip

    assert (p.checkpointed_blocks, p.selective_rest, p.checkpointing_setting) == (0, True, "selective")
    assert p.remedies == ("selective activation checkpointing",) and p.estimate.selective_checkpointing
    assert total(None) > capacity >= total("selective") == p.estimate.device_total_bytes
    every = next(o for o in p.alternatives if o.remedies == ("activation checkpointing",))
    assert every.checkpointed_blocks is None and every.predicted_step_s > p.predicted_step_s  # more recompute


def test_a_plan_keeps_every_block_where_that_is_faster_than_fewer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer blocks found only where they are slower (a smaller micro-batch): the plan keeps every block, and lists
    them beside it."""
    import dataclasses

    from batchfit.planning import plan as planning

    found = planning._fewer_blocks

    def slower(walk: object) -> list:
        return [(dataclasses.replace(o, predicted_step_s=o.predicted_step_s * 100), e) for o, e in found(walk)]

    monkeypatch.setattr(planning, "_fewer_blocks", slower)
    p = batchfit.plan(LONG, 4, device=_just_short_of_one_plain_item(), precision="fp32")
    assert (p.checkpointed_blocks, p.checkpointing_setting) == (None, "blocks")
    assert p.remedies == ("activation checkpointing",)
    assert any(o.selective_rest and o.predicted_step_s > p.predicted_step_s for o in p.alternatives)


class _Guessed:
    """A stand-in ``BlockSearch`` for ``fastest_first``: its guess, its least k, and whether it was finished."""

    def __init__(self, guess: int | None, least: int, selective: bool = False, of: int = 8) -> None:
        self._guess, self._least, self.selective, self.of, self.finished = guess, least, selective, of, False

    def guess(self) -> int | None:
        return self._guess

    def least(self) -> int:
        self.finished = True
        return self._least


def test_searches_are_finished_fastest_guess_first_while_a_guess_beats_what_was_found() -> None:
    """A guess's time is drawn between its ends' (here 0 s with no block, 8 s with every block); a search is
    finished (its steps in between traced at full depth) only while its guess is faster than the fastest found."""
    from batchfit.planning.partial import fastest_first

    a, b, c = _Guessed(4, 5), _Guessed(6, 6), _Guessed(2, 5, selective=True)
    none, every, nothing = _Guessed(None, 0), _Guessed(8, 8), _Guessed(0, 0)  # no choice of blocks: not searched
    ends = {0: 0.0, 8: 8.0}

    def seconds(search: object, k: int) -> float:
        return ends[k] if k in ends else k + 0.5

    found = fastest_first([a, b, c, none, every, nothing], seconds)  # type: ignore[list-item]
    # c's guess (2 s) first: 5 blocks, 5.5 s; a's guess (4 s) is faster: 5 blocks; b's (6 s) is not: left
    assert found == [(c, 5), (a, 5)]
    assert [s.finished for s in (a, b, c, none, every, nothing)] == [True, False, True, False, False, False]


def test_the_fewest_blocks_with_the_rest_selective_are_the_least_that_fit() -> None:
    """With the other blocks checkpointed selectively, the least k of the first blocks recomputed whole whose step
    fits the budget: k fits, k - 1 does not."""
    from batchfit.gpu.catalog import get_device
    from batchfit.planning.partial import fewest_blocks
    from batchfit.workload import Setup

    dev, setup = get_device("A100-80GB"), Setup(precision="fp32")
    total = {ck: batchfit.estimate(LONG, 2, device=dev, checkpointing=ck).device_total_bytes
             for ck in ((0, 1, "selective"), (0, 1, 2, "selective"))}  # fmt: skip
    budget = total[(0, 1, 2, "selective")]
    assert total[(0, 1, "selective")] > budget
    found = fewest_blocks(LONG, dev, setup, False, 1, 2, budget, selective=True)
    assert found is not None and (found.blocks, found.setting) == (3, (0, 1, 2, "selective"))
    assert found.estimate.device_total_bytes == budget
    assert found.remedies(("activation checkpointing",)) == ("activation checkpointing of 3 of 6 blocks, the rest "
                                                             "selectively",)  # fmt: skip


def test_the_trainer_runs_the_plans_blocks_within_the_gpu() -> None:
    from batchfit import SimulatedDevice
    from batchfit.train.trainer import Trainer

    gpu = SimulatedDevice(_just_short_of_one_plain_item().total_bytes)
    torch.manual_seed(0)
    model = LONG.build_model()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), LONG.loss, global_batch_size=4,
                      device=gpu, workload=LONG)  # fmt: skip
    trainer.step(LONG.batch(4))
    k, selective = trainer.plan.checkpointed_blocks, trainer.plan.selective_rest
    assert k is not None and (0 < k < 6 or selective)
    blocks = checkpoint_blocks_of(model, LONG.checkpoint_blocks)
    wrapped = [i for i, m in enumerate(blocks) if "forward" in vars(m)]
    assert wrapped == list(range(6 if selective else k))
    contexts = [blocks[i].forward.args[2] is not None for i in wrapped]  # a selective policy's context_fn
    assert contexts == [i >= k for i in wrapped]
    assert gpu.stats().num_ooms == 0 and gpu.stats().peak_reserved_bytes <= gpu.device.total_bytes


# -- selective checkpointing: matmul outputs kept, the rest recomputed ---------------------------------------------
@pytest.mark.parametrize("name", [pytest.param("gpt"), pytest.param("llama", marks=[needs_hf])])
def test_selective_checkpointing_is_the_allocators_peak(name: str) -> None:
    """Through the block wrapper (gpt) and through a transformers model's own switch (Llama)."""
    small = presets.get("gpt", n_layer=2, n_embd=32, n_head=2, vocab_size=96, seq_len=32)
    wl = CASES[name]() if name == "llama" else small
    est = batchfit.estimate(wl, 2, device="cpu", checkpointing="selective")
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, 2, checkpointing="selective")


def test_selective_checkpointing_saves_less_than_none_and_more_than_every_block() -> None:
    wl = CASES["gpt"]()
    peak = {ck: batchfit.estimate(wl, 4, device="A100-80GB", checkpointing=ck).peak_allocated_bytes
            for ck in (None, "selective", "blocks")}  # fmt: skip
    assert peak[None] > peak["selective"] > peak["blocks"]


WRITTEN = {  # setting, layers: the blocks the synthesis writes (NOTE [ A stack some of whose blocks are checkpointed ])
    "selective": ("gpt", 6, 6),
    6: ("gpt", 8, 6),  # the first 6 of 8 blocks whole: the stack is cut in them, the last 2 traced
    "2+selective": ("gpt", 8, 6),  # the last 6 selectively
    "5+selective": ("llama", 8, 5),  # transformers' own switch, each layer's function set
    4: ("gpt", 8, 0),  # two runs of 4: neither is long enough to cut, the step is traced whole and says why
    7: ("gpt", 12, 12),  # runs of 7 and 5, each cut as a stack of its own in the one container
    "6+selective": ("gpt", 12, 12),  # the same with the rest selective
}


@pytest.mark.parametrize("setting", [pytest.param(k, marks=[needs_hf] if name == "llama" else [])
                                     for k, (name, _, _) in WRITTEN.items()])  # fmt: skip
def test_a_step_checkpointing_some_blocks_is_written_at_full_depth_as_traced(setting: object) -> None:
    """A stack narrowed to the blocks checkpointed alike is written event for event as the full depth is traced."""
    from trace_compare import everything

    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import _trace_for_device
    from batchfit.memory.synthesis.depth import STATS
    from batchfit.precision import policy_for

    name, layers, blocks_written = WRITTEN[setting]
    wl = (presets.get("gpt", n_layer=layers, n_embd=32, n_head=2, vocab_size=96, seq_len=16) if name == "gpt"
          else _zoo("llama-gqa", layers))  # fmt: skip
    dev = get_device("A100-80GB")
    classes = checkpoint_classes(setting, wl.checkpoint_blocks)
    policy = policy_for("bf16", bf16_supported=True, device_name=dev.name)
    traces = []
    for on in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", on)
            before = STATS.blocks_written
            traces.append((_trace_for_device(wl, 2, dev, policy, classes), STATS.blocks_written - before))
    (written, blocks), (traced, _) = traces
    bare = [everything(dataclasses.replace(t, notes=[])) for t in (written, traced)]  # the notes say how it was made
    assert blocks == blocks_written and bare[0] == bare[1]
    short = "its checkpointed blocks and the others make no run long enough to cut"
    assert any(short in n for n in written.notes) == (blocks_written == 0)


@pytest.mark.parametrize("name", [pytest.param("gpt"), pytest.param("llama", marks=[needs_hf])])
def test_a_neighbouring_selection_is_written_from_the_cut_step_it_shares(name: str) -> None:
    """NOTE [ One cut step for neighbouring selections ]: the first 6 of 12 blocks whole and the rest selectively cut
    to the same model as the first 7 (four blocks of each run, renumbered alike; a transformers layer's
    ``layer_idx`` aside), so its step is written from the first 7's cut step, untraced, event for event as its full
    depth is traced; the first 10 (a run of 2 left uncut) is another cut model, traced."""
    from trace_compare import everything

    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import _trace_for_device
    from batchfit.memory.synthesis import depth
    from batchfit.precision import policy_for

    wl = (presets.get("gpt", n_layer=12, n_embd=32, n_head=2, vocab_size=96, seq_len=16) if name == "gpt"
          else _zoo("llama-gqa", 12))  # fmt: skip
    dev = get_device("A100-80GB")
    policy = policy_for("bf16", bf16_supported=True, device_name=dev.name)

    def trace(setting: str) -> tuple[object, int]:
        before = depth.STATS.blocks_traced
        t = _trace_for_device(wl, 2, dev, policy, checkpoint_classes(setting, wl.checkpoint_blocks))
        return t, depth.STATS.blocks_traced - before

    assert trace("7+selective")[1] == 8
    shared, traced = trace("6+selective")
    assert traced == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHFIT_DEPTH_SYNTHESIS", "0")
        full, _ = trace("6+selective")
    assert everything(dataclasses.replace(shared, notes=[])) == everything(dataclasses.replace(full, notes=[]))
    assert trace("10+selective")[1] > 0


def test_selective_checkpointing_refuses_the_reentrant_variant() -> None:
    from batchfit.activation_checkpointing import Selective, UseReentrant

    model = presets.get("gpt", n_layer=2, n_embd=32, n_head=2, vocab_size=96, seq_len=16).build_model()
    with pytest.raises(batchfit.ConfigError, match="selective checkpointing runs non-reentrant"):
        apply_checkpointing(model, (type(model.transformer.h[0]), Selective, UseReentrant))


def test_a_framework_plan_keeps_the_fewest_blocks_when_it_chose_checkpointing() -> None:
    """The adapters' plan (equal micro-batches): a rung it turned checkpointing on for keeps the fewest first
    blocks whole (the others kept or selective, the faster), found as ``batchfit.plan`` finds them; one the user
    fixed keeps every block."""
    from batchfit.integrations._common import equal_plan
    from batchfit.planning.partial import blocks_setting

    gpu = _just_short_of_one_plain_item()
    rungs = [("fp32", False), ("fp32", True)]
    chosen = equal_plan(LONG, 4, device=gpu, world_size=1, rungs=rungs, framework="a test", choose_blocks=True)
    k, selective = chosen.checkpointed_blocks, chosen.selective_rest
    assert chosen.checkpointing and k is not None and (0 < k < 6 or selective)
    capacity = chosen.headroom_bytes + chosen.estimate.device_total_bytes

    def total(ck: object) -> int:
        return batchfit.estimate(LONG, chosen.micro_batch_size, device=gpu, checkpointing=ck,
                                 accumulation_steps=chosen.accumulation_steps).device_total_bytes  # fmt: skip

    fewer = blocks_setting(k - 1, 6, selective) if k else None  # one block fewer whole (or nothing at all)
    assert chosen.estimate.device_total_bytes == total(chosen.checkpointing_setting) <= capacity < total(fewer)
    fixed = equal_plan(LONG, 4, device=gpu, world_size=1, rungs=rungs, framework="a test")
    assert fixed.checkpointing and fixed.checkpointed_blocks is None


@needs_hf
@pytest.mark.parametrize("selective", [False, True], ids=["the rest kept", "the rest selectively"])
def test_the_hugging_face_callback_turns_off_the_layers_after_the_plans_first_k(selective: bool) -> None:
    """The Trainer switches every layer on (``activation_checkpointing=True``); ``BatchfitCallback`` turns the
    others off when training begins (or gives them the selective policy), which is the step the plan estimated."""
    from types import SimpleNamespace

    from batchfit.integrations.transformers import BatchfitCallback

    wl = _zoo("llama-gqa")
    model = wl.build_model()
    model.gradient_checkpointing_enable()
    plan = SimpleNamespace(checkpointed_blocks=1, estimate=batchfit.estimate(wl, 1, device="A100-80GB"),
                           global_batch_size=2, micro_batch_size=1, accumulation_steps=2, gpus=1, device="A100-80GB",
                           precision="fp32", checkpointing=True, headroom_bytes=0,
                           selective_rest=selective)  # fmt: skip
    args = SimpleNamespace(world_size=1, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    lines: list[str] = []
    BatchfitCallback(plan, write=lines.append).on_train_begin(args, SimpleNamespace(is_world_process_zero=True),
                                                              None, model=model)  # fmt: skip
    layers = checkpoint_blocks_of(model, wl.checkpoint_blocks)
    assert [m.gradient_checkpointing for m in layers] == [True, selective, selective, selective]
    policies = ["context_fn" in m._gradient_checkpointing_func.keywords for m in layers]
    assert policies == [False, selective, selective, selective]
    rest = ", the rest selectively" if selective else ""
    assert f"activation checkpointing of the first 1 layers{rest};" in lines[0]


BEYOND = {  # setting on a 6-block gpt, what the error names, and the same on the command line's 12-block gpt
    "indices": ([2, 50], "block 50", "2,50"),
    "first blocks": (8, "blocks 6, 7", "13"),
    "first blocks, the rest selectively": ("8+selective", "blocks 6, 7", "13+selective"),
}


@pytest.mark.parametrize("case", list(BEYOND))
def test_a_block_the_model_does_not_have_is_one_clear_error(case: str, capsys: pytest.CaptureFixture) -> None:
    """Indices (or a number of first blocks) beyond the model's blocks: a one-line error naming them and the range,
    not a step that checkpoints less than asked; on the command line, that line and exit 2."""
    from batchfit.cli import main
    from batchfit.errors import ConfigError

    setting, named, on_the_line = BEYOND[case]
    wl = presets.get("gpt", n_layer=6, n_embd=32, n_head=2, vocab_size=96, seq_len=16)
    with pytest.raises(ConfigError, match="the model has 6 blocks to checkpoint \\(0 to 5\\)") as info:
        batchfit.estimate(wl, 2, device="A100-80GB", checkpointing=setting)
    assert f"checkpointing {named}" in str(info.value) and "\n" not in str(info.value)
    code = main(["estimate", "gpt", "-b", "1", "--device", "A100-80GB", "--checkpointing", on_the_line])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "the model has 12 blocks to checkpoint (0 to 11)" in err
