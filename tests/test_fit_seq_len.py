"""Tests of ``fit(..., maximize="seq_len")``: the longest sequence that fits at a given batch.

The claim is exactness, as for the batch: at the answer ``L``, ``estimate`` of the workload built at ``L``
tokens fits the budget and at ``L + seq_multiple`` it does not, unless ``L`` is the model's longest
sequence. The checks build the workloads at those lengths afresh (``presets.get(..., seq_len=L)``), not
through the fitter's own ``at_seq_len``; on a ``SimulatedDevice`` they run real steps in a loop written here.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest
import torch
from real_steps import two_real_steps_fit
from torch import nn

from batchfit import ConfigError, DoesNotFitError, SimulatedDevice, Workload, estimate, get_device, presets
from batchfit.cli import main
from batchfit.gpu.catalog import Device
from batchfit.memory.estimate import trace_for_device
from batchfit.memory.synthesis.scaling import TraceCurve
from batchfit.models import hf
from batchfit.planning.fit import FitResult, fit
from batchfit.precision import policy_for

GPT_KNOBS = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=4096)
"""Flash attention on CUDA: memory is affine in the sequence length."""
EAGER_KNOBS = dict(layers=2, n_embd=64, n_head=2, vocab_size=256, n_positions=4096, attn_implementation="eager")
"""An explicit softmax keeps B x H x T x T probabilities (and a dropout mask): memory is quadratic in T."""
needs_hf = pytest.mark.skipif(not hf.available(), reason="needs transformers")


def _gpt(seq_len: int = 32) -> Workload:
    return presets.get("gpt", **GPT_KNOBS, seq_len=seq_len)


def _eager(seq_len: int = 32) -> Workload:
    return presets.get("hf-gpt2", **EAGER_KNOBS, seq_len=seq_len)


BUILDERS = {"gpt": _gpt, "hf-gpt2-eager": _eager}


def assert_longest(build, result: FitResult, device: str | Device) -> None:
    """``estimate(L) <= capacity < estimate(L + multiple)`` at the result's batch, the workloads built afresh."""
    length, b, m = result.max_seq_len, result.max_batch_size, result.seq_multiple
    assert length is not None and length % m == 0
    at = estimate(build(length), b, device=device, precision=result.precision).device_total_bytes
    assert at <= result.capacity_bytes
    assert result.estimate.device_total_bytes == at and result.estimate.batch_size == b
    if not result.capped:
        past = estimate(build(length + m), b, device=device, precision=result.precision).device_total_bytes
        assert result.capacity_bytes < past, (length, at, result.capacity_bytes, past)


# -- exactness against the estimator ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "device", "batch_size", "multiple"),
    [
        ("gpt", "600MiB", 8, 1),
        ("gpt", "500MiB", 3, 64),
        pytest.param("hf-gpt2-eager", "600MiB", 4, 1, marks=needs_hf),
        pytest.param("hf-gpt2-eager", "2GiB", 4, 128, marks=needs_hf),
    ],
)
def test_the_longest_sequence_is_exact_against_the_estimator(name: str, device: str, batch_size: int, multiple: int):
    build = BUILDERS[name]
    result = fit(build(), device, maximize="seq_len", batch_size=batch_size, seq_multiple=multiple)
    assert not result.capped and result.capacity_bytes == get_device(device).total_bytes
    assert_longest(build, result, device)
    # Three traces draw the curve, two verify the answer: five steps, whether memory is affine or quadratic.
    assert result.trials == 5 == len(result.attempts)
    assert all(a.kind == "trace" and a.batch_size == batch_size for a in result.attempts)
    fitting = [a.seq_len for a in result.attempts if a.fits]
    failing = [a.seq_len for a in result.attempts if not a.fits]
    assert max(fitting) == result.max_seq_len
    assert min(s for s in failing if s > result.max_seq_len) == result.max_seq_len + multiple
    assert sorted(result.traces) == sorted(a.seq_len for a in result.attempts)


def test_the_longest_sequence_moves_with_the_batch_and_the_multiple() -> None:
    one = fit(_gpt(), "600MiB", maximize="seq_len", batch_size=8).max_seq_len
    half_batch = fit(_gpt(), "600MiB", maximize="seq_len", batch_size=4).max_seq_len
    in_64s = fit(_gpt(), "600MiB", maximize="seq_len", batch_size=8, seq_multiple=64).max_seq_len
    assert half_batch > one  # fewer items, longer sequences
    assert in_64s == one // 64 * 64  # not the first answer served again from the cache


def test_when_the_longest_sequence_the_model_takes_fits_it_is_the_answer_in_one_trace() -> None:
    result = fit(_gpt(), "1GiB", maximize="seq_len", batch_size=2)
    assert result.capped and result.max_seq_len == GPT_KNOBS["block_size"]
    assert result.trials == 1
    assert_longest(_gpt, result, "1GiB")


def test_a_capacity_exactly_at_an_estimate_admits_that_length() -> None:
    needed = estimate(_gpt(1000), 8, device="1GiB").device_total_bytes
    device = get_device("1GiB").with_overrides(total_bytes=needed)
    result = fit(_gpt(), device, maximize="seq_len", batch_size=8)
    assert result.max_seq_len >= 1000
    assert_longest(_gpt, result, device)


def test_not_even_the_shortest_sequence_fitting_is_one_line_naming_the_remedies() -> None:
    needed = estimate(_gpt(16), 4, device="1GiB").device_total_bytes
    device = get_device("1GiB").with_overrides(total_bytes=needed - 1)
    with pytest.raises(DoesNotFitError) as info:
        fit(_gpt(), device, maximize="seq_len", batch_size=4, seq_multiple=16)
    message = str(info.value)
    assert "\n" not in message
    assert "even at batch size 4 with sequences of 16 tokens" in message
    for remedy in ("a smaller --batch-size than 4", "--precision", "--checkpointing", "larger GPU"):
        assert remedy in message
    assert fit(_gpt(), device.with_overrides(total_bytes=needed), maximize="seq_len", batch_size=4,
               seq_multiple=16).max_seq_len >= 16  # fmt: skip


def test_without_verification_the_curve_is_trusted_and_agrees_where_memory_is_a_polynomial() -> None:
    verified = fit(_gpt(), "600MiB", maximize="seq_len", batch_size=8)
    trusted = fit(_gpt(), "600MiB", maximize="seq_len", batch_size=8, verify=False)
    assert trusted.max_seq_len == verified.max_seq_len
    assert trusted.trials == 3 and trusted.estimate.device_total_bytes == verified.estimate.device_total_bytes


def test_how_a_workload_is_rebuilt_is_no_part_of_its_trace_key_but_is_of_its_answer() -> None:
    from batchfit.memory.cache import workload_digest

    base = _token_workload(100, limit=1 << 16)
    branching = dataclasses.replace(base, at_seq_len=partial(_token_workload, branch=20_000, limit=1 << 16))
    assert workload_digest(base, torch.float32) == workload_digest(branching, torch.float32)
    plain = fit(base, "1GiB", maximize="seq_len", batch_size=16).max_seq_len
    assert fit(branching, "1GiB", maximize="seq_len", batch_size=16).max_seq_len < plain


# -- the curve ---------------------------------------------------------------------------------------------
@needs_hf
def test_three_traces_predict_the_trace_at_any_length_even_where_attention_is_quadratic() -> None:
    dev = get_device("1GiB")
    policy = policy_for("fp32", bf16_supported=True, device_name=dev.name)
    traces = {n: trace_for_device(_eager(n), 2, dev, policy, ()) for n in (24, 40, 64, 200)}
    curve = TraceCurve([(n, traces[n]) for n in (24, 40, 64)])
    predicted, real = curve.at(200), traces[200]
    assert predicted.events == traces[64].events
    order = [e for e in predicted.events if e >= 0]
    real_order = [e for e in real.events if e >= 0]
    assert [predicted.nbytes[s] for s in order] == [real.nbytes[s] for s in real_order]
    assert predicted.flops == real.flops
    # Quadratic, not affine: a line through two of the traces misses the third.
    line = TraceCurve([(24, traces[24]), (40, traces[40])])
    assert line.at(64).nbytes != TraceCurve([(n, traces[n]) for n in (24, 40, 64)]).at(64).nbytes


def test_traces_of_different_steps_draw_no_curve() -> None:
    dev = get_device("1GiB")
    policy = policy_for("fp32", bf16_supported=True, device_name=dev.name)
    gpt = trace_for_device(_gpt(16), 2, dev, policy, ())
    mlp = trace_for_device(presets.get("mlp"), 2, dev, policy, ())
    with pytest.raises(ValueError):
        TraceCurve([(16, gpt), (32, mlp)])
    with pytest.raises(ValueError):
        TraceCurve([(16, gpt), (16, gpt)])


# -- a user's own workload ---------------------------------------------------------------------------------
class _Tokens(nn.Module):
    """Embeddings, a mixing layer and a head; with ``branch`` above a length, one more layer runs (the step's
    code then depends on the length, and no curve can be drawn)."""

    def __init__(self, branch: int | None = None) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64)
        self.extra, self.branch = nn.Linear(32, 32), branch

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mix(self.embed(ids)))  # (b, t, 32)
        if self.branch is not None and ids.shape[1] > self.branch:
            h = torch.relu(self.extra(h))
        return self.head(h)  # (b, t, 64)


def _token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def _token_workload(seq_len: int, branch: int | None = None, limit: int | None = None) -> Workload:
    return Workload(
        model=partial(_Tokens, branch),
        batch=lambda b: torch.randint(0, 64, (b, seq_len)),
        loss=_token_loss,
        name="tokens",
        config={"seq_len": seq_len},
        at_seq_len=partial(_token_workload, branch=branch, limit=limit),
        max_seq_len=limit,
    )


@pytest.mark.parametrize("limit", [None, 1 << 20])
def test_a_user_workload_with_at_seq_len_is_fitted_with_or_without_a_limit(limit: int | None) -> None:
    build = partial(_token_workload, limit=limit)
    result = fit(build(100), "1GiB", maximize="seq_len", batch_size=16)
    assert not result.capped
    assert_longest(build, result, "1GiB")
    assert result.trials == 5


def test_a_step_whose_code_changes_with_the_length_is_fitted_from_the_traces_that_run_its_ops() -> None:
    # 16,384 tokens run without the extra layer, 32,768 and 65,536 with it: the curve is drawn through those two.
    build = partial(_token_workload, branch=20_000, limit=1 << 16)
    result = fit(build(100), "1GiB", maximize="seq_len", batch_size=16)
    assert_longest(build, result, "1GiB")
    assert 20_000 < result.max_seq_len < 32_768 and result.trials == 5


def test_when_the_answer_is_where_the_step_changes_it_is_found_by_bisection_on_traces() -> None:
    # Without the extra layer 31,232 tokens would fit; with it (above 30,000 tokens) fewer than 30,000 do.
    build = partial(_token_workload, branch=30_000, limit=1 << 16)
    result = fit(build(100), "1GiB", maximize="seq_len", batch_size=16)
    assert result.max_seq_len == 30_000
    assert_longest(build, result, "1GiB")


class _Strided(nn.Module):
    """Strided convolutions over a waveform: their output lengths round down, so sizes are not a polynomial of
    the length and the curve's guess is a little off."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.head = nn.Conv1d(8, 64, 7, stride=5), nn.Conv1d(64, 64, 3, stride=2), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.c2(torch.relu(self.c1(x)))).mean(-1))


def _waveform_workload(samples: int) -> Workload:
    return Workload(
        model=_Strided,
        batch=lambda b: (torch.randn(b, 8, samples), torch.randint(0, 4, (b,))),  # (b, channels, samples), (b,)
        loss=lambda m, xy: nn.functional.cross_entropy(m(xy[0]), xy[1]),
        name="strided",
        config={"seq_len": samples, "seq_unit": "samples"},
        at_seq_len=_waveform_workload,
    )


def test_sizes_that_are_nearly_a_polynomial_cost_a_few_traces_more_and_the_answer_is_exact() -> None:
    result = fit(_waveform_workload(1000), "500MiB", maximize="seq_len", batch_size=4)
    assert_longest(_waveform_workload, result, "500MiB")
    assert result.seq_unit == "samples"
    assert 5 < result.trials <= 8  # the curve's guess fit, so did its neighbour: a short gallop up from it


def test_a_workload_whose_memory_does_not_grow_with_the_length_says_so() -> None:
    flat = dataclasses.replace(_token_workload(100), at_seq_len=lambda n: _token_workload(100))
    with pytest.raises(ConfigError, match="does not grow with the sequence length"):
        fit(flat, "1GiB", maximize="seq_len", batch_size=16)


@pytest.mark.parametrize(
    ("at_seq_len", "match"),
    [
        (lambda n: 3, r"at_seq_len\(\d+\) returned int"),
        (lambda n: 1 / 0, r"at_seq_len\(\d+\) raised ZeroDivisionError"),
    ],
)
def test_an_at_seq_len_that_fails_is_one_line(at_seq_len, match: str) -> None:
    wl = dataclasses.replace(_token_workload(100), at_seq_len=at_seq_len)
    with pytest.raises(ConfigError, match=match) as info:
        fit(wl, "1GiB", maximize="seq_len", batch_size=16)
    assert "\n" not in str(info.value)


def test_a_workload_function_taking_seq_len_is_rebuilt_by_it(tmp_path: Path) -> None:
    from batchfit.sources import load

    f = tmp_path / "tokens.py"
    f.write_text(
        "import torch\nfrom torch import nn\nimport batchfit\n\n"
        "def make(seq_len=100, width=32):\n"
        "    return batchfit.Workload(model=lambda: nn.Sequential(nn.Embedding(64, width), nn.Linear(width, 64)),\n"
        "        batch=lambda b: torch.randint(0, 64, (b, seq_len)),\n"
        "        loss=lambda m, ids: nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()))\n"
    )
    wl = load(f"{f}:make", width=16)
    assert wl.at_seq_len is not None and wl.max_seq_len is None
    rebuilt = wl.at_seq_len(300)
    assert rebuilt.batch(2).shape == (2, 300)
    assert rebuilt.build_model()[0].embedding_dim == 16  # the other arguments are kept
    assert load(f"{f}:make").at_seq_len(7).batch(1).shape == (1, 7)


# -- presets and hub models know their sequence --------------------------------------------------------------
def test_presets_rebuild_at_any_length_with_their_positions_pinned() -> None:
    import pickle

    wl = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=64)
    assert wl.max_seq_len == 1024  # GPT-2's positions
    longer = pickle.loads(pickle.dumps(wl)).at_seq_len(1000)
    assert longer.config["seq_len"] == 1000 and longer.config["block_size"] == 1024
    assert longer.config["n_layer"] == 2 and longer.max_seq_len == 1024
    assert presets.get("mlp").at_seq_len is None and presets.get("cnn").at_seq_len is None


@needs_hf
def test_hub_models_and_their_adapters_are_rebuilt_at_any_length(tmp_path: Path) -> None:
    import transformers

    from batchfit.sources import load

    d = tmp_path / "tiny-llama"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                             architectures=["LlamaForCausalLM"]).save_pretrained(d)  # fmt: skip
    wl = load(str(d), seq_len=32, lora="r=4,targets=q_proj+v_proj")
    assert wl.max_seq_len == 512
    rebuilt = wl.at_seq_len(200)
    assert rebuilt.config["seq_len"] == 200 and "adapters" in rebuilt.config
    assert rebuilt.batch(2)["input_ids"].shape == (2, 200)
    result = fit(wl, "600MiB", maximize="seq_len", batch_size=2)
    assert result.capped and result.max_seq_len == 512 and result.trials == 1
    plain = load(str(d), seq_len=32)
    needed = estimate(plain.at_seq_len(300), 4, device="1GiB").device_total_bytes
    device = get_device("1GiB").with_overrides(total_bytes=needed)
    result = fit(plain, device, maximize="seq_len", batch_size=4)
    assert 300 <= result.max_seq_len < 512
    assert_longest(lambda n: load(str(d), seq_len=n), result, device)


# -- a simulated device: real steps -------------------------------------------------------------------------
def test_on_a_simulated_device_the_answer_is_verified_by_real_steps(one_thread: None) -> None:
    build = partial(_gpt)
    result = fit(build(), SimulatedDevice("64MiB"), maximize="seq_len", batch_size=2)
    assert [a.kind for a in result.attempts][-2:] == ["real", "real"]
    assert result.trials == 5
    length = result.max_seq_len
    assert two_real_steps_fit(build(length), 2, "64MiB")
    assert not two_real_steps_fit(build(length + 1), 2, "64MiB")


# -- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("workload", "kwargs", "match"),
    [
        ("cnn", dict(maximize="seq_len", batch_size=4), "cnn has no sequence length to vary.*at_seq_len"),
        ("gpt", dict(maximize="seq_len"), "pass --batch-size B"),
        ("gpt", dict(batch_size=4), "only with --maximize seq-len"),
        ("gpt", dict(seq_multiple=64), "--seq-multiple applies to --maximize seq-len"),
        ("gpt", dict(maximize="tokens"), "maximize must be batch_size or seq_len"),
        ("gpt", dict(maximize="seq_len", batch_size=0), "--batch-size must be a whole number"),
        ("gpt", dict(maximize="seq_len", batch_size=2, seq_multiple=0), "--seq-multiple must be a whole number"),
        ("gpt", dict(maximize="seq_len", batch_size=2, seq_multiple=2048), "longer than the model's 1024 positions"),
        ("gpt", dict(maximize="seq_len", batch_size=2, max_batch_size=8), "max_batch_size applies"),
    ],
)
def test_bad_requests_are_one_line_naming_the_fix(workload: str, kwargs: dict, match: str) -> None:
    wl = presets.get(workload, **({"n_layer": 1, "n_embd": 32, "n_head": 2} if workload == "gpt" else {}))
    with pytest.raises(ConfigError, match=match) as info:
        fit(wl, "1GiB", **kwargs)
    assert "\n" not in str(info.value)


# -- the command line ------------------------------------------------------------------------------------------
TINY_GPT_ARGS = ["gpt", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2", "--set", "vocab_size=256",
                 "--set", "block_size=4096"]  # fmt: skip


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_prints_the_longest_sequence_and_its_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", *TINY_GPT_ARGS, "--device", "600MiB", "--maximize", "seq-len", "-b", "8", "--seq-multiple", "8"]
    code, out, _ = _run(capsys, *args, "--json")
    d = json.loads(out)
    api = fit(_gpt(), "600MiB", maximize="seq_len", batch_size=8, seq_multiple=8)
    assert code == 0 and d["maximize"] == "seq_len" and d["max_seq_len"] == api.max_seq_len
    assert d["max_batch_size"] == 8 and d["seq_multiple"] == 8 and d["trials"] == 5 and not d["capped"]
    assert [a["seq_len"] for a in d["attempts"]] == [a.seq_len for a in api.attempts]
    code, out, _ = _run(capsys, *args)
    assert code == 0
    assert f"longest sequence at batch 8: {api.max_seq_len} tokens (" in " ".join(out.split())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["fit", "cnn", "--maximize", "seq-len", "-b", "4"], "no sequence length to vary"),
        (["fit", *TINY_GPT_ARGS, "--maximize", "seq-len"], "--batch-size"),
        (["fit", *TINY_GPT_ARGS, "--seq-multiple", "64"], "--maximize seq-len"),
        (["fit", *TINY_GPT_ARGS, "--maximize", "tokens", "-b", "4"], "--maximize"),
    ],
)
def test_bad_cli_input_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str], match: str) -> None:
    code, out, err = _run(capsys, *args, "--device", "1GiB")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchfit: error:") and match in lines[0], err

