"""The Hugging Face Trainer, planned by batchfit: real ``Trainer`` runs with the planned arguments.

A tiny Llama built from transformers' config class trains on the CPU; the plans are made for a simulated
GPU (``hf_tiny.CAPACITY``) on which 5 items fit, so larger global batches need accumulation. The two-process
run starts its ranks as torchrun would, forked from a warm fork server (``tests/launch.py``): what it tests is
the adapter on two ranks, not the launcher.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import CAPACITY, arguments, example, tiny_llama, train_two_steps  # noqa: E402
from launch import LIBRARIES, run_script  # noqa: E402

from batchfit.cli import main  # noqa: E402
from batchfit.errors import ConfigError, DoesNotFitError  # noqa: E402
from batchfit.integrations._common import largest_divisor_at_most  # noqa: E402
from batchfit.integrations.transformers import (  # noqa: E402
    BatchfitCallback,
    plan_training_arguments,
    trainer_workload,
)
from batchfit.runtime.simulated import SimulatedDevice  # noqa: E402

WORKER = Path(__file__).with_name("hf_worker.py")


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf-out"))


def _gpu() -> SimulatedDevice:
    return SimulatedDevice(CAPACITY)


@pytest.fixture(scope="module")
def planned_four(model: Any, out_dir: str) -> tuple[Any, Any]:
    """Arguments planned for a global batch of 4, which fits in one micro-batch."""
    return plan_training_arguments(model, arguments(out_dir), 4, device=_gpu(), sample=example(0))


@pytest.mark.parametrize("global_batch_size", [4, 20])
def test_planned_arguments_train_exactly(
    model: Any, out_dir: str, planned_four: tuple[Any, Any], global_batch_size: int
) -> None:
    args = arguments(out_dir)
    if global_batch_size == 4:
        planned, plan = planned_four
    else:
        planned, plan = plan_training_arguments(model, args, global_batch_size, device=_gpu(), sample=example(0))
    micro, steps = planned.per_device_train_batch_size, planned.gradient_accumulation_steps
    assert micro * steps * planned.world_size == global_batch_size
    assert planned.world_size == 1
    assert micro == largest_divisor_at_most(global_batch_size, plan.max_micro_batch_size)
    assert (micro, steps) == (plan.micro_batch_size, plan.accumulation_steps)
    assert steps == (1 if global_batch_size == 4 else global_batch_size // micro) and (steps > 1) == (
        global_batch_size > plan.max_micro_batch_size
    )
    assert plan.splits == [[micro] * steps]
    assert plan.estimate.batch_size == micro and plan.headroom_bytes >= 0
    assert planned.bf16 is False and planned.activation_checkpointing is False  # fp32 fits one item
    assert planned.auto_find_batch_size is False
    assert args.per_device_train_batch_size == 8  # the arguments given are left as they were
    ran = train_two_steps(model, planned, global_batch_size)
    assert ran["global_step"] == 2
    assert ran["seen"] == [micro] * (2 * steps)


@pytest.mark.slow
def test_two_processes_train_with_the_same_plan(tmp_path: Path) -> None:
    sizes = [8, 30]
    done = run_script(2, WORKER, str(tmp_path / "run"), *map(str, sizes), timeout=420, preload=LIBRARIES)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"run.{r}.json").read_text()) for r in (0, 1)]
    for g, run0, run1 in zip(sizes, *ranks):
        assert run0["global_batch_size"] == run1["global_batch_size"] == g
        micro, steps = run0["per_device_train_batch_size"], run0["gradient_accumulation_steps"]
        assert (micro, steps) == (run1["per_device_train_batch_size"], run1["gradient_accumulation_steps"])
        assert run0["world_size"] == run1["world_size"] == 2
        assert micro * steps * 2 == g
        assert micro == largest_divisor_at_most(g // 2, run0["max_micro_batch_size"])
        for run in (run0, run1):
            assert run["global_step"] == 2
            assert run["seen"] == [micro] * (2 * steps)
    assert ranks[0][1]["gradient_accumulation_steps"] > 1  # 15 items per rank need accumulation


def test_what_the_trainer_runs_is_what_is_traced(model: Any, out_dir: str) -> None:
    """The optimizer of args.optim with its weight-decay groups, checkpointed layers, num_items_in_batch."""
    from transformers import Trainer

    args = arguments(out_dir, optim="sgd", weight_decay=0.1, learning_rate=0.5)
    wl = trainer_workload(model, args, sample=example(0))
    trainer = Trainer(model=model, args=args, train_dataset=[example(0)])
    reference = trainer.create_optimizer()
    built = wl.optimizer([p for p in model.parameters() if p.requires_grad])
    assert type(built) is type(reference) is torch.optim.SGD
    assert [[id(p) for p in g["params"]] for g in built.param_groups] == [
        [id(p) for p in g["params"]] for g in reference.param_groups
    ]
    assert [(g["lr"], g["weight_decay"]) for g in built.param_groups] == [(0.5, 0.1), (0.5, 0.0)]
    assert [c.__name__ for c in wl.checkpoint_blocks] == ["LlamaDecoderLayer"]
    seen: dict[str, Any] = {}
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    try:
        batch = wl.batch(3)
        loss = wl.loss(model, batch)
    finally:
        hook.remove()
    assert int(seen["num_items_in_batch"]) == 3 * 32  # no -100 labels in the sample
    assert batch["input_ids"].shape == (3, 32) and torch.equal(batch["input_ids"][2], batch["input_ids"][0])
    assert loss.dim() == 0


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adafactor", "sgd"])
def test_the_optimizer_of_args_optim_is_traced(model: Any, out_dir: str, optim: str) -> None:
    import batchfit
    from batchfit.integrations._hf_workload import trainer_config

    args = arguments(out_dir, optim=optim)
    wl = trainer_workload(model, args, sample=example(0))
    with trainer_config(model, args):
        states = batchfit.estimate(wl, 2, device="A100-80GB").breakdown["optimizer_states"]
    from batchfit.memory.allocator.caching import round_size

    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(round_size(p.numel() * p.element_size()) for p in trainable)  # in the allocator's blocks
    if optim.startswith("adamw"):  # exp_avg and exp_avg_sq of every weight, and a one-number step counter
        assert states == 2 * weights + len(trainable) * round_size(4)
    elif optim == "sgd":
        assert states == 0  # the Trainer's SGD has no momentum
    else:
        assert 0 < states < weights  # factored second moments


def _expected_states(optim: str, sizes: list[int]) -> int:
    """The states of ``optim`` on tensors of ``sizes`` values, in the allocator's blocks (a GPU estimate's)."""
    from batchfit.memory.allocator.caching import round_size as r

    moments = 1 if "lion" in optim else 2
    if optim.endswith("32bit"):  # bitsandbytes: fp32 whatever the parameter's dtype
        return sum(moments * r(4 * n) for n in sizes)
    if optim in ("adamw_bnb_8bit", "paged_adamw_8bit", "lion_8bit"):  # uint8 + an absmax per 256 from 4096 values
        quantised = sum(moments * (r(n) + r(4 * -(-n // 256))) if n >= 4096 else moments * r(4 * n) for n in sizes)
        return quantised + 2 * r(1024)  # the two quantisation maps, shared by every tensor
    codes, table = (1, 1024) if optim == "adamw_torch_8bit" else (2, 64)  # torchao: codes, a scale per 256, a map
    quantised = sum(2 * (r(n // codes) + r(4 * n // 256) + r(table)) if n >= 4096 and n % 256 == 0 else 2 * r(4 * n)
                    for n in sizes)  # fmt: skip
    return quantised + len(sizes) * r(4) + 2 * r(4)  # a 0-d step per parameter, a tensor lr per group


@pytest.mark.parametrize(
    "optim",
    ["adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit", "lion_32bit", "adamw_torch_8bit",
     "adamw_torch_4bit"],
)  # fmt: skip
def test_low_bit_and_paged_optimizers_of_args_optim_are_traced(model: Any, out_dir: str, optim: str) -> None:
    """The Trainer's own class and arguments, traced as ``--optimizer`` traces the same name: bitsandbytes' as
    they are (paged buffers only from 1e5 values: none here), torchao's through their stand-in."""
    import batchfit
    from batchfit.integrations._hf_workload import trainer_config

    args = arguments(out_dir, optim=optim)
    wl = trainer_workload(model, args, sample=example(0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    from transformers import Trainer

    reference = Trainer(model=model, args=args, train_dataset=[example(0)]).create_optimizer()
    built = wl.optimizer(trainable)
    assert type(built) is type(reference) and built.defaults == reference.defaults
    with trainer_config(model, args):
        est = batchfit.estimate(wl, 2, device="A100-80GB")
    assert est.breakdown["optimizer_states"] == _expected_states(optim, [p.numel() for p in trainable])
    assert est.paged_optimizer_bytes == 0 and est.analytic["optimizer"] == optim


def test_fixed_precision_and_checkpointing_are_kept(model: Any, out_dir: str) -> None:
    args = arguments(out_dir, bf16=True, activation_checkpointing=True)
    planned, plan = plan_training_arguments(model, args, 4, device=_gpu(), sample=example(0))
    assert (plan.precision, plan.checkpointing) == ("bf16", True)
    assert planned.bf16 and planned.activation_checkpointing and not planned.fp16
    assert planned.per_device_train_batch_size * planned.gradient_accumulation_steps == 4


def test_a_collated_batch_and_a_synthetic_one_give_the_shapes(model: Any, out_dir: str) -> None:
    args = arguments(out_dir)
    collated = {"input_ids": torch.arange(64).view(2, 32) % 512, "labels": torch.arange(64).view(2, 32) % 512}
    wl = trainer_workload(model, args, sample=collated)
    assert wl.batch(5)["input_ids"].shape == (5, 32)
    synthetic = trainer_workload(model, args, seq_len=16)
    assert synthetic.batch(2)["input_ids"].shape == (2, 16) and synthetic.tokens_per_item == 16
    with pytest.raises(ConfigError, match="not both"):
        trainer_workload(model, args, sample=example(0), seq_len=16)


def test_bad_input_is_one_clear_error(model: Any, out_dir: str) -> None:
    from transformers import LlamaModel

    args = arguments(out_dir)
    with pytest.raises(ConfigError, match="cannot give each of 2 processes an item"):
        plan_training_arguments(model, args, 1, device=_gpu(), sample=example(0), world_size=2)
    with pytest.raises(ConfigError, match="use 6 or 8 instead of 7"):
        plan_training_arguments(model, args, 7, device=_gpu(), sample=example(0), world_size=2)
    with pytest.raises(ConfigError, match="nn.Module"):
        plan_training_arguments("gpt2", args, 8, device=_gpu())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot build optimizer 'galore_adamw'"):  # its package is not installed
        plan_training_arguments(model, arguments(out_dir, optim="galore_adamw"), 8, device=_gpu(), sample=example(0))
    body = LlamaModel(model.config)  # no head: the Trainer cannot train it (no loss)
    with pytest.raises(ConfigError, match="returned no loss"):
        plan_training_arguments(body, args, 8, device=_gpu(), sample=example(0))
    tried = r"tried: fp32, bf16, bf16 \+ activation checkpointing; at the last, one item needs"
    with pytest.raises(DoesNotFitError, match=tried):
        plan_training_arguments(model, args, 8, device=SimulatedDevice("8MiB"), sample=example(0))


class FakeCuda:
    """``torch.cuda``'s memory functions, reporting a growing peak per logging period."""

    def __init__(self) -> None:
        self.resets = 0

    def is_available(self) -> bool:
        return True

    def reset_peak_memory_stats(self, device: int = 0) -> None:
        self.resets += 1

    def max_memory_allocated(self, device: int = 0) -> int:
        return self.resets * 2**20

    def max_memory_reserved(self, device: int = 0) -> int:
        return self.resets * 2**21


class NoNvml:
    def nvmlInit(self) -> None:
        raise RuntimeError("no NVML library")


def test_callback_prints_the_plan_and_logs_peaks_beside_the_estimate(model: Any, planned_four: tuple[Any, Any]) -> None:
    planned, plan = planned_four
    lines: list[str] = []
    cuda = FakeCuda()
    callback = BatchfitCallback(plan, cuda=cuda, nvml=NoNvml(), write=lines.append)
    train_two_steps(model, planned, 4, callbacks=[callback])
    assert lines[0].startswith("batchfit: global batch 4 = 4 per device x 1 accumulation x 1 GPUs on simulated ")
    assert [r.step for r in callback.history] == [1, 2]
    assert [r.peak_reserved_bytes for r in callback.history] == [2**21, 2 * 2**21]  # one reset before each period
    assert all(r.estimated_peak_reserved_bytes == plan.estimate.peak_reserved_bytes for r in callback.history)
    assert lines[1].startswith("batchfit: step 1: peak allocated 1.00 MiB (estimate ")
    assert len(lines) == 3 and cuda.resets == 3


def test_callback_warns_when_the_arguments_differ_from_the_plan(
    model: Any, out_dir: str, planned_four: tuple[Any, Any]
) -> None:
    _, plan = planned_four
    lines: list[str] = []

    class NoCuda(FakeCuda):
        def is_available(self) -> bool:
            return False

    callback = BatchfitCallback(plan, cuda=NoCuda(), write=lines.append)
    train_two_steps(model, arguments(out_dir, per_device_train_batch_size=2), 4, callbacks=[callback])
    assert "not the planned 4 on 1" in lines[1] and "2 x 1 x 1 = 2 items per step" in lines[1]
    assert callback.history == []  # no GPU: nothing measured


def test_cli_writes_the_training_arguments(tmp_path: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from transformers import TrainingArguments

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config_dir = tmp_path / "tiny"
    config = tiny_llama().config
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(config_dir)
    out = tmp_path / "args.json"
    code = main(["plan", str(config_dir), "--global-batch-size", "64", "--gpus", "2", "--device", "410MiB",
                 "--seq-len", "32", "--hf-args", str(out), "--json"])  # fmt: skip
    stdout, err = capsys.readouterr()
    assert code == 0, err
    fields = json.loads(out.read_text())
    plan = json.loads(stdout)
    micro, steps = fields["per_device_train_batch_size"], fields["gradient_accumulation_steps"]
    assert micro * steps * 2 == 64 and steps > 1
    assert (micro, steps) == (plan["micro_batch_size"], plan["accumulation_steps"])
    assert micro == largest_divisor_at_most(32, plan["max_micro_batch_size"])
    assert {"bf16": False, "fp16": False, "activation_checkpointing": False}.items() <= fields.items()
    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[], **fields)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (micro, steps)
    code = main(["plan", str(config_dir), "-g", "7", "--gpus", "2", "--seq-len", "32", "--hf-args", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "" and err.count("\n") == 1 and "use 6 or 8 instead of 7" in err
    code = main(["plan", str(config_dir), "-g", "8", "--precision", "bf16-true", "--hf-args", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "torch_dtype=torch.bfloat16" in err
