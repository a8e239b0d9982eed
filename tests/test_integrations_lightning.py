"""Lightning, planned by batchfit: ``Trainer.fit`` with ``BatchfitTuner`` sets the batch size and the
accumulation, trains, and ends with the weights of plain SGD on the whole global batches (float64).

The DDP run starts its two ranks as torchrun would, forked from a warm fork server (``tests/launch.py``):
Lightning sees torchrun's environment and joins the processes it was given; what is tested is the tuner on
two ranks, not the launcher.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from launch import LIBRARIES, run_script  # noqa: E402
from lightning_tiny import CAPACITY, make_module, make_trainer, reference  # noqa: E402

from batchfit.errors import ConfigError, DoesNotFitError  # noqa: E402
from batchfit.integrations._common import largest_divisor_at_most  # noqa: E402
from batchfit.integrations.lightning import BatchfitTuner, lightning_precision  # noqa: E402
from batchfit.runtime.simulated import SimulatedDevice  # noqa: E402

WORKER = Path(__file__).with_name("lightning_worker.py")
GLOBAL_BATCH = 24


@pytest.fixture(autouse=True)
def quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=0)


def test_fit_sets_batch_size_and_accumulation_and_trains_the_global_batch() -> None:
    module = make_module()
    tuner = BatchfitTuner(GLOBAL_BATCH, device=SimulatedDevice(CAPACITY))
    trainer = make_trainer([tuner])
    trainer.fit(module)
    plan = tuner.plan
    micro, steps = module.batch_size, trainer.accumulate_grad_batches
    assert micro * steps == GLOBAL_BATCH
    assert (micro, steps) == (plan.micro_batch_size, plan.accumulation_steps)
    assert plan.max_micro_batch_size < GLOBAL_BATCH and steps > 1  # it needed accumulation
    assert micro == largest_divisor_at_most(GLOBAL_BATCH, plan.max_micro_batch_size)
    assert plan.precision == "fp32" and plan.gpus == 1
    assert trainer.global_step == 2
    assert module.seen == [micro] * (2 * steps)  # the dataloader was reloaded with the new batch size
    _assert_same_weights(module.net.state_dict(), reference(GLOBAL_BATCH, 2))


def test_the_batch_size_is_set_where_batch_size_finder_sets_it() -> None:
    """On the datamodule when it holds ``batch_size`` (Lightning's own lookup)."""
    import lightning.pytorch as pl

    class Data(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 3
            self.module = make_module()

        def train_dataloader(self) -> Any:
            self.module.batch_size = self.batch_size
            return self.module.train_dataloader()

    data = Data()
    module = make_module(batch_size=None)
    trainer = make_trainer([BatchfitTuner(GLOBAL_BATCH, device=SimulatedDevice(CAPACITY))])
    trainer.fit(module, datamodule=data)
    assert data.batch_size * trainer.accumulate_grad_batches == GLOBAL_BATCH
    assert module.seen == [data.batch_size] * (2 * trainer.accumulate_grad_batches)


def test_bad_input_is_one_clear_error() -> None:
    from types import SimpleNamespace

    with pytest.raises(ConfigError, match="whole number >= 1"):
        BatchfitTuner(0, device="A100-80GB")
    with pytest.raises(ConfigError, match="precision 'transformer-engine' is not modelled"):
        lightning_precision(SimpleNamespace(precision="transformer-engine"))
    cases = [
        (make_module(batch_size=None), SimulatedDevice(CAPACITY), ConfigError, "sets `batch_size`"),
        (make_module(returns_loss=False), SimulatedDevice(CAPACITY), ConfigError, "training_step returned NoneType"),
        (make_module(), None, ConfigError, "needs device="),
        (make_module(), SimulatedDevice("4MiB"), DoesNotFitError, "one item needs"),
    ]
    for module, device, error, message in cases:
        trainer = make_trainer([BatchfitTuner(GLOBAL_BATCH, device=device)])
        with pytest.raises(error, match=message):
            trainer.fit(module)


@pytest.mark.slow
def test_ddp_ranks_get_rank_zeros_plan_and_train_exactly(tmp_path: Path) -> None:
    done = run_script(2, WORKER, str(tmp_path / "run"), str(GLOBAL_BATCH), timeout=300, preload=LIBRARIES)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"run.{r}.json").read_text()) for r in (0, 1)]
    micro, steps = ranks[0]["batch_size"], ranks[0]["accumulate_grad_batches"]
    for run in ranks:
        assert (run["batch_size"], run["accumulate_grad_batches"], run["world_size"]) == (micro, steps, 2)
        assert run["max_micro_batch_size"] == ranks[0]["max_micro_batch_size"]
        assert run["seen"] == [micro] * (2 * steps) and run["global_step"] == 2
    assert micro * steps * 2 == GLOBAL_BATCH
    assert micro == largest_divisor_at_most(GLOBAL_BATCH // 2, ranks[0]["max_micro_batch_size"])
    _assert_same_weights(torch.load(tmp_path / "run.pt", weights_only=True), reference(GLOBAL_BATCH, 2))
