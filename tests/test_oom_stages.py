"""An out-of-memory error anywhere in a step: re-planned (micro-batch stages) or one ``DoesNotFitError``
naming the stage; never a raw ``torch.OutOfMemoryError`` out of ``Trainer.step`` or an ``Accumulator``.

Scripted faults (``fake_oom`` raised where named) on the tiny float64 model of ``test_oom``, and real
ones on simulated GPUs. Every finished run equals the full-batch reference (float64, 1e-12); every
refusal leaves the trainer clean, so that the same step can run again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_oom import assert_same, build_faulty, data, fake_oom, faulty_trainer, loss_fn, reference_params
from torch import nn

import batchfit.train.finish as finish_module
import batchfit.train.oom_resplit as oom_module
import batchfit.train.window_noise as window_noise_module
from batchfit.errors import DoesNotFitError
from batchfit.runtime.simulated import SimulatedDevice
from batchfit.train.accumulate import Accumulator
from batchfit.train.oom_errors import MicroBatchOutOfMemory
from batchfit.train.results import Replan
from batchfit.train.save_resume import save_checkpoint
from batchfit.train.trainer import Trainer

MiB = 2**20

pytestmark = pytest.mark.usefixtures("one_thread")


def failing_at(calls: set[int], real: Any) -> Any:
    """``real``, except that the calls counted in ``calls`` (from 0) raise an out-of-memory error."""
    count = [0]

    def fn(*args: Any, **kwargs: Any) -> Any:
        call, count[0] = count[0], count[0] + 1
        if call in calls:
            raise fake_oom()
        return real(*args, **kwargs)

    return fn


def initial_params() -> list[torch.Tensor]:
    return [p.detach().clone() for p in build_faulty().parameters()]


# -- before the forward: re-planned like a forward ------------------------------------------------------------
def test_an_oom_while_slicing_the_batch_resplits(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = data(2)
    model = build_faulty()
    trainer, cache = faulty_trainer(monkeypatch, model, micro=4)
    monkeypatch.setattr(oom_module, "slice_batch", failing_at({1}, oom_module.slice_batch))
    first, second = (trainer.step(b) for b in batches)
    assert first.replanned == (Replan(4, 2, "forward", at_item=4, redone_items=0),)
    assert first.micro_batch_sizes == (4, 2, 2, 2, 2) and second.micro_batch_sizes == (2,) * 6
    assert cache.emptied == 1
    assert_same(model, reference_params(batches))


def test_an_oom_while_copying_to_the_device_resplits(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = data(1)
    model = build_faulty()
    trainer, cache = faulty_trainer(monkeypatch, model, micro=6)
    copied: list[int] = []

    def copy(micro: Any) -> Any:
        copied.append(len(micro[0]))
        return tuple(t.clone() for t in micro)

    trainer._move = failing_at({1}, copy)  # the second micro-batch's copy runs out of memory
    result = trainer.step(batches[0])
    assert result.replanned == (Replan(6, 3, "forward", at_item=6, redone_items=0),)
    assert result.micro_batch_sizes == (6, 3, 3) and copied == [6, 3, 3]
    assert_same(model, reference_params(batches))


# -- after the window: one line naming the stage ------------------------------------------------------------
def test_an_oom_while_clipping_refuses_and_leaves_the_trainer_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = data(1)
    model = build_faulty()
    trainer, cache = faulty_trainer(monkeypatch, model, micro=4)
    trainer.accumulator.max_grad_norm = 1e6  # clips nothing: the reference needs no clipping
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.utils, "clip_grad_norm_", failing_at({0}, torch.nn.utils.clip_grad_norm_))
        with pytest.raises(DoesNotFitError) as info:
            trainer.step(batches[0])
    message = str(info.value)
    assert message.startswith("clipping the gradient norm ran out of memory on fake-gpu (Tried to allocate 2.00 GiB)")
    assert "the parameters are as before this step" in message and "\n" not in message
    assert not isinstance(info.value, torch.OutOfMemoryError) and cache.emptied == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial_params()))
    assert all(p.grad is None for p in model.parameters()) and not trainer.accumulator.needs_reset
    trainer.step(batches[0])  # the same step again, now that it fits
    assert_same(model, reference_params(batches))


def test_an_oom_while_dividing_by_the_token_count_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    def tokens(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        return loss_fn(model, batch) * len(batch[1]), len(batch[1])

    model = build_faulty()
    trainer, _ = faulty_trainer(monkeypatch, model, micro=4)
    trainer.loss = tokens
    with monkeypatch.context() as patch:
        patch.setattr(torch, "_foreach_mul_", failing_at({0}, torch._foreach_mul_))
        with pytest.raises(DoesNotFitError, match="^dividing the gradients by the token count ran out of memory"):
            trainer.step(data(1)[0])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial_params()))


def test_an_oom_in_the_scheduler_says_the_parameters_were_updated(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = data(1)
    model = build_faulty()
    trainer, _ = faulty_trainer(monkeypatch, model, micro=4)
    scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1)
    scheduler.step = failing_at({0}, scheduler.step)  # type: ignore[method-assign]
    trainer.accumulator.scheduler = scheduler
    with pytest.raises(DoesNotFitError) as info:
        trainer.step(batches[0])
    assert str(info.value).startswith("the scheduler step ran out of memory on fake-gpu")
    assert "the parameters may be partly updated: resume from your last checkpoint" in str(info.value)
    assert_same(model, reference_params(batches))  # the optimizer step had run


def test_the_optimizers_first_state_allocation_on_a_simulated_gpu() -> None:
    """A real OOM: the window fits (58 MiB reserved at most, as with SGD), AdamW's first step does not (its
    states, 2 x 12 MiB, and the temporaries of its update need 94 MiB)."""
    torch.manual_seed(0)
    model = nn.Linear(1024, 3072)  # 12 MiB of float32 weights
    batch = (torch.randn(8, 1024), torch.randn(8, 3072))

    def mse(m: nn.Module, b: Any) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]), b[1])

    with SimulatedDevice("72MiB") as gpu:
        trainer = Trainer(model, torch.optim.AdamW(model.parameters()), mse, global_batch_size=8, micro_batch_size=4,
                          device=gpu)  # fmt: skip
        with pytest.raises(DoesNotFitError) as info:
            trainer.step(batch)
    message = str(info.value)
    assert message.startswith("the optimizer step ran out of memory on a simulated 72.00 MiB GPU (Tried to allocate")
    assert "it was the optimizer's first step, which allocates its state" in message
    assert "the parameters may be partly updated" in message  # weight decay had run (single-tensor AdamW)
    assert "use a lighter optimizer (SGD)" in message and "\n" not in message
    assert gpu.stats().num_ooms >= 1 and all(p.grad is None for p in model.parameters())


# -- the noise scale is advice: an OOM while measuring skips this step's measurement ----------------------------
@pytest.mark.parametrize("which", [0, 1], ids=["small-batch", "big-batch"])
def test_an_oom_while_measuring_the_noise_scale_skips_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, which: int
) -> None:
    batches = data(2)
    model = build_faulty()
    trainer, _ = faulty_trainer(monkeypatch, model, micro=4)
    # grad_sq_norm runs once after the window's first micro-batch, once for the window (no clipping)
    monkeypatch.setattr(window_noise_module, "grad_sq_norm", failing_at({which}, window_noise_module.grad_sq_norm))
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        results = [trainer.step(b) for b in batches]
    assert "while measuring the gradient noise scale" in caplog.text and "this step is not measured" in caplog.text
    assert trainer.noise_scale is not None and trainer.noise_scale.steps == 1  # the second step measured
    assert not any(r.replanned for r in results)
    assert_same(model, reference_params(batches))


# -- the one host read: falls back to reading tensor by tensor --------------------------------------------------
def test_the_final_read_needs_no_memory_when_stacking_and_concatenating_do_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = [torch.tensor(0.25, dtype=torch.float32), torch.tensor(1 / 3, dtype=torch.float64)]
    parts = {"losses": values, "norm": torch.tensor([2.5], dtype=torch.float64)}
    expected = finish_module.read_floats({"losses": torch.stack([v.double() for v in values]), "norm": parts["norm"]})
    with monkeypatch.context() as patch:
        patch.setattr(torch, "stack", failing_at({0}, torch.stack))
        patch.setattr(torch, "cat", failing_at({0}, torch.cat))
        assert finish_module.stacked(values) == values  # the list itself
        assert finish_module.read_floats(parts) == expected == {"losses": [0.25, 1 / 3], "norm": [2.5]}


# -- the Accumulator in a loop of one's own ------------------------------------------------------------------
def test_an_accumulator_turns_a_forward_oom_into_one_line_that_still_is_an_oom() -> None:
    batch = data(1)[0]
    model = build_faulty(forward_at={1})
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), global_batch_size=12)
    with acc.accumulate(tuple(t[0:6] for t in batch), last=False) as micro:
        micro.backward_weighted(loss_fn(model, tuple(t[0:6] for t in batch)))
    with pytest.raises(MicroBatchOutOfMemory) as info:
        with acc.accumulate(tuple(t[6:12] for t in batch), last=True) as micro:
            micro.backward_weighted(loss_fn(model, tuple(t[6:12] for t in batch)))
    error = info.value
    assert isinstance(error, torch.OutOfMemoryError) and isinstance(error, DoesNotFitError)
    assert (error.phase, error.n_items) == ("forward", 6) and not acc.needs_reset
    assert str(error) == (
        "out of memory on cpu in the forward pass of a micro-batch of 6 (Tried to allocate 2.00 GiB); the window's "
        "earlier gradients stay valid: run these items again as smaller micro-batches (batchfit.Trainer "
        "re-splits by itself)"
    )
    for start, stop in ((6, 9), (9, 12)):  # the same items as two smaller micro-batches
        piece = tuple(t[start:stop] for t in batch)
        with acc.accumulate(piece, last=stop == 12) as micro:
            micro.backward_weighted(loss_fn(model, piece))
    assert acc.step().micro_batch_sizes == (6, 3, 3)
    assert_same(model, reference_params([batch]))


def test_an_accumulator_says_a_backward_oom_needs_a_reset() -> None:
    batch = data(1)[0]
    model = build_faulty(backward_at={1})
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), global_batch_size=12)
    with pytest.raises(MicroBatchOutOfMemory, match="call reset\\(\\) and run the window again") as info:
        for i, (start, stop) in enumerate(((0, 6), (6, 12))):
            piece = tuple(t[start:stop] for t in batch)
            with acc.accumulate(piece, last=i == 1) as micro:
                micro.backward_weighted(loss_fn(model, piece))
    assert info.value.phase == "backward" and acc.needs_reset


def test_an_accumulator_given_a_simulated_device_uses_it_unentered() -> None:
    model = build_faulty()
    gpu = SimulatedDevice("1GiB")
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), global_batch_size=12,
                      device=gpu)  # fmt: skip
    assert gpu.stats().allocated_bytes == 1024 + 3 * 512 and not gpu.active  # the model, placed there
    batch = data(1)[0]
    for i, (start, stop) in enumerate(((0, 6), (6, 12))):
        piece = gpu.to_device(tuple(t[start:stop] for t in batch))  # as .to("cuda") would
        with acc.accumulate(piece, last=i == 1) as micro:
            assert gpu.active
            micro.backward_weighted(loss_fn(model, piece))
        assert not gpu.active
    acc.step()
    stats = gpu.stats()
    assert stats.peak_allocated_bytes > 2 * (1024 + 3 * 512)  # gradients, activations, momentum: counted
    assert_same(model, reference_params([batch]))
    with pytest.raises(DoesNotFitError, match="the model does not fit on a simulated 2.00 MiB GPU"):
        big = nn.Linear(1024, 1024)
        Accumulator(big, torch.optim.SGD(big.parameters(), lr=0.1), global_batch_size=4, device=SimulatedDevice("2MiB"))


# -- the checkpoint write ------------------------------------------------------------------------------------------
def test_an_oom_while_writing_a_checkpoint_keeps_the_old_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import batchfit.train.save_resume as checkpoint_module

    model = build_faulty()
    path = save_checkpoint(tmp_path / "ck.pt", model=model, step=1)
    old = path.read_bytes()
    real = checkpoint_module.model_and_optimizer_states
    monkeypatch.setattr(checkpoint_module, "model_and_optimizer_states", failing_at({0}, real))
    with pytest.raises(DoesNotFitError) as info:
        save_checkpoint(path, model=model, step=2)
    assert str(info.value).startswith(f"writing the checkpoint {path} ran out of memory (Tried to allocate 2.00 GiB)")
    assert "the file is as it was" in str(info.value) and path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]  # no temporary file left behind
