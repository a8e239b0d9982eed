"""``batchfit.Setup``: one value for how a step is run, taken by estimate, fit and plan, with their keyword
arguments as sugar; one spelling per meaning, so that two spellings of one setup share their answers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import batchfit
from batchfit import ConfigError, ParallelLayout, Setup, presets
from batchfit.memory.cache import CACHE
from batchfit.models.gpt import Block

GPT = presets.get("gpt", n_layer=2, n_embd=32, n_head=2, vocab_size=72, seq_len=16)
"""This file's own model (a vocabulary no other test uses): the cache holds none of its steps from elsewhere."""


def test_a_setup_is_one_value_whatever_its_spelling() -> None:
    assert Setup(precision="BF16", checkpointing=True) == Setup(precision="bf16", checkpointing="blocks")
    assert Setup(checkpointing=[Block]) == Setup(checkpointing=(Block,))
    assert Setup(checkpointing=False) == Setup() == Setup(checkpointing=0)
    assert Setup(checkpointing=3) == Setup(checkpointing=[2, 0, 1, 1]) == Setup(checkpointing=(0, 1, 2))
    assert len({Setup(checkpointing=[Block]), Setup(checkpointing=(Block,))}) == 1  # hashable: a cache key part
    assert Setup.of(None) == Setup() and Setup.of(Setup("fp16"), precision=None).precision == "fp16"
    assert Setup.of(Setup("fp16", "blocks"), precision="bf16") == Setup("bf16", "blocks")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(precision="fp8"), "unknown precision 'fp8'; use one of fp32, bf16, fp16, bf16-true"),
        (dict(checkpointing="everything"), "unknown checkpointing 'everything'; use 'blocks', 'reentrant'"),
        (dict(checkpointing=[int]), "checkpointing must be 'blocks', 'reentrant', 'selective', a number of blocks, a "
                                    "list of block indices (then 'selective' for the other blocks selectively) or a "
                                    "list of nn.Module classes"),
        (dict(checkpointing="2+selectve"), "unknown checkpointing '2+selectve'; use 'blocks', 'reentrant', "
                                           "'selective', a number of blocks, a list of block indices, 'K+selective'"),
        (dict(checkpointing=-1), "checkpointing=-1 blocks: pass a number >= 0 (the first k blocks are checkpointed)"),
        (dict(checkpointing=[2, -1]), "checkpointing=[2, -1]: block indices count from 0 (the first block)"),
        (dict(accumulation_steps=0), "accumulation_steps must be a whole number >= 1, got 0"),
        (dict(accumulation_steps=True), "accumulation_steps must be a whole number >= 1, got True"),
        (dict(parallel=2), "parallel must be a batchfit.ParallelLayout, got int"),
        (dict(parallel=ParallelLayout(tensor_parallel=0)), "tensor_parallel must be a whole number >= 1, got 0"),
        (dict(expandable_segments="yes"), "expandable_segments must be True or False, got 'yes'"),
    ],
)
def test_a_bad_field_is_one_line_naming_the_fix(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Setup(**fields)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_estimate_and_fit_take_a_setup_and_their_keywords_replace_its_fields() -> None:
    setup = Setup(precision="bf16", checkpointing="blocks", accumulation_steps=2, expandable_segments=True)
    by_setup = batchfit.estimate(GPT, 4, device="A100-40GB", setup=setup)
    by_keywords = batchfit.estimate(GPT, 4, device="A100-40GB", precision="bf16", checkpointing="blocks",
                                    accumulation_steps=2, expandable_segments=True)  # fmt: skip
    assert by_setup == by_keywords
    assert (by_setup.precision, by_setup.checkpointing, by_setup.accumulation_steps) == ("bf16", True, 2)
    off = batchfit.estimate(GPT, 4, device="A100-40GB", setup=setup, checkpointing=False, precision="fp32")
    assert off == batchfit.estimate(GPT, 4, device="A100-40GB", accumulation_steps=2, expandable_segments=True)
    assert not off.checkpointing and off.precision == "fp32"

    fitted = batchfit.fit(GPT, "1GiB", setup=Setup(precision="bf16", checkpointing=True))
    assert fitted.to_dict() == batchfit.fit(GPT, "1GiB", precision="bf16", checkpointing="blocks").to_dict()
    assert fitted.estimate.precision == "bf16" and fitted.estimate.checkpointing


def test_two_spellings_of_one_setup_share_their_fit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The fit is kept under its setup resolved against the workload: asked again in another spelling, it is
    read back whole (no allocator replayed); a setup that changes the step is searched anew."""
    from batchfit.memory import estimate

    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path))  # cold: nothing fitted before
    replays = []
    real_replay = estimate.replay
    monkeypatch.setattr(estimate, "replay", lambda *a, **k: replays.append(1) or real_replay(*a, **k))
    first = batchfit.fit(GPT, "1GiB", checkpointing=True)
    assert replays
    replays.clear()
    CACHE.clear_memory()  # as a new process would: from disk
    assert batchfit.fit(GPT, "1GiB", setup=Setup(checkpointing=[Block])).to_dict() == first.to_dict()
    assert replays == []
    batchfit.fit(GPT, "1GiB", setup=Setup(checkpointing=[Block], accumulation_steps=2))
    assert replays


def test_a_layout_in_the_setup_is_one_ranks_step() -> None:
    layout = ParallelLayout(fsdp=2)
    assert batchfit.estimate(GPT, 2, setup=Setup(parallel=layout)) == batchfit.estimate(
        dataclasses.replace(GPT, parallel=layout), 2
    )


def test_a_plan_chooses_what_its_setup_leaves_auto_and_keeps_what_it_fixes() -> None:
    chosen = batchfit.plan(GPT, 64, device="A100-40GB", gpus=2)
    fixed = batchfit.plan(GPT, 64, device="A100-40GB", gpus=2, setup=Setup(precision="bf16"))
    assert fixed.precision == "bf16" and not fixed.checkpointing
    assert all(o.precision == "bf16" and not o.checkpointing for o in fixed.alternatives)
    assert "bf16 autocast" not in fixed.remedies  # the user's own precision, not a remedy
    same = batchfit.plan(GPT, 64, device="A100-40GB", gpus=2, setup=Setup(precision="auto", checkpointing="auto"))
    assert same.to_dict() == chosen.to_dict()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: batchfit.estimate(GPT, 2, setup=Setup(precision="auto")),
         "an estimate runs one step as written and does not choose precision: give it (e.g. precision=bf16)"),
        (lambda: batchfit.fit(GPT, "1GiB", setup=Setup(precision="auto")),
         "a fit runs one step as written and does not choose precision"),
        (lambda: batchfit.estimate(GPT, 2, setup="bf16"), "setup must be a batchfit.Setup, got str"),
        (lambda: batchfit.plan(GPT, 8, device="1GiB", setup=Setup(accumulation_steps=2)),
         "a plan chooses the accumulation steps of its global batch"),
        (lambda: batchfit.plan(GPT, 8, device="1GiB", gpus=2, setup=Setup(parallel=ParallelLayout(fsdp=2))),
         "a plan chooses the layout of its GPUs"),
    ],
)  # fmt: skip
def test_a_setup_that_asks_the_impossible_is_refused_in_one_line(call, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError) as info:
        call()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_examples_in_the_setups_docstrings_run() -> None:
    import doctest

    import batchfit.workload

    failed, attempted = doctest.testmod(batchfit.workload)
    assert attempted >= 2 and failed == 0
