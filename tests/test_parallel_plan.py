"""Tensor-parallel plans: what a model publishes, a user's own, the degrees they allow, and the ladder's layouts.

Everything here is one process: plans are resolved on fake models, ranks traced on the fake process
group. That a traced rank is what a gloo rank holds is ``tests/test_parallel_memory.py``'s.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch
from hf_tiny import llama_config_dir
from torch import nn

import batchfit
from batchfit.errors import ConfigError
from batchfit.gpu.catalog import get_device
from batchfit.memory.categories import Category
from batchfit.memory.trace.fake_step import fake_model, trace_workload
from batchfit.memory.trace.tp_plan import degree_error, published_plan, resolve_plan, split_facts
from batchfit.planning.cost import tensor_parallel_bytes
from batchfit.planning.ladder import ladder, more_split_first
from batchfit.planning.plan import describe_split, plan
from batchfit.sources import load
from batchfit.workload import AUTO, ParallelLayout, Setup

CHOOSE = Setup(precision=AUTO, checkpointing=AUTO)
"""What a plan starts from when nothing is fixed: it chooses the precision and the checkpointing."""

HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4}
"""Head counts that degrees 2 and 4 split and 8 does not."""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> batchfit.Workload:
    pytest.importorskip("transformers")
    return load(str(llama_config_dir(tmp_path_factory.mktemp("llama"), **HEADS)), seq_len=16)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)
        self.up, self.down = nn.Linear(24, 48), nn.Linear(48, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 24)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(24, 40)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def own_workload(**kw: object) -> batchfit.Workload:
    return batchfit.Workload(
        model=Net,
        batch=lambda b: (torch.randint(0, 40, (b, 6)), torch.randint(0, 40, (b, 6))),
        loss=lambda m, batch: nn.functional.cross_entropy(m(batch[0]).flatten(0, 1), batch[1].flatten()),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        **kw,
    )


OWN_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


# -- the plan ---------------------------------------------------------------------------------------
def test_a_transformers_model_publishes_its_plan_and_its_head_splits_the_loss(llama: batchfit.Workload) -> None:
    model = fake_model(llama)
    assert published_plan(model) == {
        "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "loss_parallel",
    }  # fmt: skip
    resolved = resolve_plan(model, None)
    assert len(resolved) == 2 * 7 + 1 and resolved["model.layers.1.mlp.down_proj"] == "rowwise"
    facts = split_facts(model, None)
    assert facts.heads == (4, 8) and facts.degrees == (2, 4)  # 4 key/value heads
    assert degree_error(4, facts, gpus=8) is None


def test_a_degree_that_does_not_split_the_heads_or_a_node_is_one_line_naming_the_valid_ones(
    llama: batchfit.Workload,
) -> None:
    facts = split_facts(fake_model(llama), None)
    assert degree_error(8, facts, gpus=16) == (
        "tensor parallel degree 8 does not divide the heads (4, 8); valid degrees: 1, 2, 4"
    )
    assert degree_error(3, facts, gpus=12) == (
        "tensor parallel degree 3 does not divide the heads (4, 8) or the 8 GPUs of a node; valid degrees: 1, 2, 4"
    )
    assert degree_error(4, facts, gpus=6) == (
        "tensor parallel degree 4 does not divide the 6 GPUs; valid degrees: 1, 2"
    )
    with pytest.raises(ConfigError, match=r"^tensor parallel degree 8 does not divide the heads \(4, 8\); valid "):
        plan(llama, 64, device="H100-80GB", gpus=16, tensor_parallel=8)


def test_a_model_without_a_plan_says_how_to_give_one() -> None:
    wl = own_workload()
    with pytest.raises(ConfigError, match=r"^Net publishes no tensor-parallel plan; pass Workload\(tp_plan="):
        plan(wl, 8, device="A100-40GB", gpus=2, tensor_parallel=2)
    assert not [c for c in ladder(get_device("A100-40GB"), 2, CHOOSE, True) if c.tensor_parallel > 1]


@pytest.mark.parametrize(
    ("tp_plan", "match"),
    [
        ({"blocks.*.up": "columns"}, r"'blocks\.\*\.up': 'columns' is not a style batchfit knows; use one of"),
        ({"blocks.*.norm": "colwise"}, r"names blocks\.0\.norm \(LayerNorm\); 'colwise' splits nn\.Linear"),
        ({"layers.*.up": "colwise"}, r"matches no module of Net; write its keys as module paths"),
    ],
)
def test_a_plan_that_does_not_fit_the_model_is_one_line(tp_plan: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_plan(fake_model(own_workload()), tp_plan)


def test_a_users_own_plan_splits_exactly_the_layers_it_names() -> None:
    """Rank 0 of TP 2 holds half of each planned weight (the bias of a row-wise layer whole) and the rest whole."""
    whole = own_workload()
    split = own_workload(tp_plan=OWN_PLAN, parallel=ParallelLayout(tensor_parallel=2))
    params = {}
    for name, wl in (("whole", whole), ("split", split)):
        trace = trace_workload(wl, 4, param_dtype=None, autocast=None)
        params[name] = sum(n for sid, n in trace.nbytes.items() if trace.role.get(sid) is Category.PARAMETERS)
    planned = 2 * 4 * (48 * 24 + 48 + 24 * 48)  # up (weight and bias) and down's weight, both blocks
    assert params["whole"] - params["split"] == planned // 2
    est = batchfit.estimate(split, 4, device="A100-40GB")
    assert any("one rank of TP 2 (2 GPUs)" in n for n in est.notes)


# -- the ladder and the plan ----------------------------------------------------------------------------
def test_the_ladder_puts_tensor_parallelism_after_checkpointing_each_with_fsdp_across_groups() -> None:
    rungs = ladder(get_device("H100-80GB"), 16, CHOOSE, True, tp_degrees=(2, 8))
    layouts = [(c.precision, c.checkpointing is not None, c.tensor_parallel, c.sequence_parallel) for c in rungs]
    first_tp = next(i for i, c in enumerate(rungs) if c.tensor_parallel > 1)
    assert all(c.tensor_parallel == 1 and c.precision != "bf16-true" for c in rungs[:first_tp])
    assert layouts[first_tp:first_tp + 4] == [("fp32", False, 2, True), ("fp32", False, 2, False),
                                              ("fp32", False, 8, True), ("fp32", False, 8, False)]  # fmt: skip
    assert all(c.sharded and c.data_parallel(16) == 16 // c.tensor_parallel for c in rungs if c.tensor_parallel > 1)
    assert rungs[first_tp].remedies == ("FSDP sharding", "tensor parallel 2 + sequence parallel")
    assert rungs[-1].precision == "bf16-true"  # a change to the maths stays last
    only = ladder(get_device("H100-80GB"), 8, CHOOSE, True, tp_degrees=(8,), sequence_parallel=False)
    assert {(c.tensor_parallel, c.sequence_parallel, c.sharded) for c in only if c.tensor_parallel > 1} == {
        (8, False, False)  # one group: nothing for FSDP to shard across
    }


def test_a_plan_with_a_fixed_degree_splits_per_group(llama: batchfit.Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(llama, 4, device="A100-80GB", gpus=4, tensor_parallel=2, sequence_parallel=True, precision="bf16")
    assert (p.tensor_parallel, p.sequence_parallel, p.data_parallel) == (2, True, 2)
    assert p.sharded and p.layout == ParallelLayout(2, True, fsdp=2)
    assert p.splits == [[2], [2]]  # two items per group: the global batch splits over the groups, not the GPUs
    assert "tensor parallel 2 + sequence parallel" in p.remedies
    assert all(o.tensor_parallel == 2 for o in p.alternatives)
    d = p.to_dict()
    assert (d["tensor_parallel"], d["sequence_parallel"], d["data_parallel"]) == (2, True, 2)
    assert describe_split(p.splits, "groups").startswith("each of 2 groups: ")
    # A split below the largest micro-batch that fits (one item at a time, here forced) is estimated again at the
    # micro-batch it runs: one rank's step of the layout, not the whole model's.
    module = importlib.import_module("batchfit.planning.plan")
    monkeypatch.setattr(module, "plan_splits", lambda config, g, gpus, micro: [[1] * 2] * config.data_parallel(gpus))
    one = plan(llama, 4, device="A100-80GB", gpus=4, tensor_parallel=2, sequence_parallel=True, precision="bf16")
    assert one.micro_batch_size == 1 < one.max_micro_batch_size == 2
    rank = batchfit.estimate(llama, 1, device="A100-80GB", precision="bf16", parallel=p.layout, accumulation_steps=2)
    assert one.estimate.peak_allocated_bytes == rank.peak_allocated_bytes


def test_tensor_parallel_traffic_is_the_traced_collectives(llama: batchfit.Workload) -> None:
    """An all-reduce sends 2(n-1)/n of its tensor, an all-gather (n-1)/n of its output, a reduce-scatter n-1
    of its output: with n = 2, the traced collectives' output bytes x 1, 1/2 and 1."""
    from batchfit.memory.estimate import trace_for_device
    from batchfit.precision import policy_for

    wl = dataclasses.replace(llama, parallel=ParallelLayout(2, sequence_parallel=True))
    trace = trace_for_device(wl, 4, get_device("cpu"), policy_for("fp32"), ())
    factors = {"all_reduce": 1.0, "all_gather_into_tensor": 0.5, "reduce_scatter_tensor": 1.0}
    expected, seen = 0.0, set()
    phase = ""
    for i, e in enumerate(trace.events):
        phase, step = trace.phase_at(i)
        op = trace.op.get(e, "") if e >= 0 else ""
        for name, factor in factors.items():
            if step == 1 and phase in ("forward", "backward") and op.startswith(f"_c10d_functional.{name}"):
                expected += trace.nbytes[e] * factor
                seen.add(name)
    assert seen == set(factors)  # sequence parallelism gathers and reduce-scatters; the loss all-reduces
    assert tensor_parallel_bytes(trace, 2) == expected > 0


def test_estimate_takes_a_layout_and_the_command_line_names_valid_degrees(
    llama: batchfit.Workload, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from batchfit.cli import main

    layout = ParallelLayout(tensor_parallel=2, sequence_parallel=True, fsdp=2)
    est = batchfit.estimate(llama, 4, device="cpu", parallel=layout)
    same = batchfit.estimate(dataclasses.replace(llama, parallel=layout), 4)
    assert est.peak_allocated_bytes == same.peak_allocated_bytes < batchfit.estimate(llama, 4).peak_allocated_bytes
    config = llama_config_dir(tmp_path, **HEADS) / "config.json"
    flags = ["-b", "4", "--seq-len", "16", "--tp", "2", "--sp", "--fsdp", "2", "--json"]
    assert main(["estimate", str(config), *flags]) in (0, None)
    assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] == est.peak_allocated_bytes
    assert main(["estimate", str(config), "-b", "4", "--seq-len", "16", "--tp", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "batchfit: error: tensor parallel degree 3 does not divide the heads (4, 8) or the 8 GPUs of a node; "
        "valid degrees: 1, 2, 4"
    )
    with pytest.raises(ConfigError, match="fsdp must be a whole number >= 1"):
        batchfit.estimate(llama, 4, parallel=ParallelLayout(tensor_parallel=2, fsdp=0))


def test_when_nothing_else_fits_the_plan_splits_the_model(tmp_path: Path) -> None:
    """A large vocabulary at 2048 tokens: the logits outgrow the GPU whatever FSDP and checkpointing do;
    split over the vocabulary (loss parallel) and the sequence (sequence parallel), they fit."""
    from batchfit.planning.estimate import fit_estimate_at

    wl = load(str(llama_config_dir(tmp_path, vocab_size=32000, hidden_size=256, intermediate_size=512,
                                   max_position_embeddings=2048)), seq_len=2048)  # fmt: skip
    device = get_device("A100-80GB")
    whole = min(
        fit_estimate_at(wl, device, Setup(checkpointing=ck), sharded, 2, 1).device_total_bytes
        for ck in (None, "blocks") for sharded in (False, True)
    )  # fmt: skip
    # the step the plan runs split: one item per group, accumulated over the two of the global batch
    split = fit_estimate_at(wl, device, Setup(parallel=ParallelLayout(2, sequence_parallel=True),
                                              accumulation_steps=2), False, 2, 1)  # fmt: skip
    assert split.device_total_bytes < whole
    capacity = (split.device_total_bytes + whole) // 2
    p = plan(wl, 2, device=device.with_overrides(total_bytes=capacity), gpus=2, precision="fp32")
    assert (p.tensor_parallel, p.sequence_parallel, p.data_parallel, p.sharded) == (2, True, 1, False)
    assert p.remedies == ("tensor parallel 2 + sequence parallel",)
    assert p.estimate.device_total_bytes <= capacity and p.splits == [[1, 1]]
    assert p.predicted_step_s is not None and p.predicted_step_s > 0
    # The logits are what outgrew the GPU: with a fused loss the model fits whole, and the plan says so
    fused = [o for o in p.alternatives if o.remedies[:1] == ("Liger fused linear cross-entropy",)]
    assert fused and fused[0].tensor_parallel == 1 and fused[0].predicted_step_s < p.predicted_step_s


class Flat(nn.Module):
    """A feed-forward without numbered blocks: tensor parallelism splits it, sequence parallelism finds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_sequence_parallelism_needs_blocks_and_says_so() -> None:
    wl = batchfit.Workload(
        model=Flat, batch=lambda b: torch.randn(b, 4, 8), loss=lambda m, x: m(x).square().mean(),
        tp_plan={"up": "colwise", "down": "rowwise"},
    )  # fmt: skip
    p = plan(wl, 4, device="A100-40GB", gpus=2, tensor_parallel=2)
    assert (p.tensor_parallel, p.sequence_parallel) == (2, False)
    with pytest.raises(ConfigError, match=r"this model's plan names none; drop --sp$"):
        plan(wl, 4, device="A100-40GB", gpus=2, tensor_parallel=2, sequence_parallel=True)


def test_a_layout_is_fitted_only_after_the_more_split_ones_fit_one_item() -> None:
    """NOTE [ The most split layout first ]: before a tensor-parallel layout's fit, one item of the most split
    layout, of each more split degree between (widest first), of its own degree with sequence parallelism, and of
    itself must fit (each traced once, kept)."""
    rungs = ladder(get_device("H100-80GB"), 8, Setup(precision="bf16", checkpointing="blocks"), True, (2, 4, 8))
    layouts = {(r.tensor_parallel, r.sequence_parallel): r for r in rungs if r.tensor_parallel > 1}

    def chain(degree: int, sp: bool) -> list[tuple[int, bool, str, str]]:
        return [(r.tensor_parallel, r.sequence_parallel, r.remedies[-1], why)
                for r, why in more_split_first(layouts[degree, sp])]  # fmt: skip

    twin = "its degree with sequence parallelism"
    between = (4, True, "tensor parallel 4 + sequence parallel", "a more split layout")
    assert chain(2, False) == [(8, True, "tensor parallel 8 + sequence parallel", "the most split layout"), between,
                               (2, True, "tensor parallel 2 + sequence parallel", twin),
                               (2, False, "tensor parallel 2", "before its fit")]  # fmt: skip
    assert chain(2, True) == [(8, True, "tensor parallel 8 + sequence parallel", "the most split layout"), between,
                              (2, True, "tensor parallel 2 + sequence parallel", "before its fit")]  # fmt: skip
    assert chain(4, True) == [(8, True, "tensor parallel 8 + sequence parallel", "the most split layout"),
                              (4, True, "tensor parallel 4 + sequence parallel", "before its fit")]  # fmt: skip
    assert chain(8, True) == [(8, True, "tensor parallel 8 + sequence parallel", "the most split layout")]
