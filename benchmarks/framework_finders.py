"""Framework batch-size finders vs batchfit's adapters: real steps run to find the batch, out-of-memory
crashes, and the global batch that training ends up with.

Every run trains for real on the CPU inside the same simulated GPU (``SimulatedDevice``: a CUDA
caching-allocator model that raises ``torch.OutOfMemoryError`` where a GPU of that capacity would), and
every run is asked for the same global batch, ``--global-batch`` (60) items per optimizer step:

- **Hugging Face**: ``Trainer(auto_find_batch_size=True, per_device_train_batch_size=60)`` (Accelerate's
  decorator inside: x0.9 after each OOM, ``gradient_accumulation_steps`` left at 1) vs
  ``plan_training_arguments(model, args, 60, device=gpu)`` and a ``Trainer`` on the arguments it returns.
  A tiny Llama (1 layer, 32 tokens, built from ``LlamaConfig``).
- **Lightning**: ``BatchSizeFinder(mode="binsearch")`` and ``mode="power"`` (as ``Tuner.scale_batch_size``;
  ``steps_per_trial=3`` real optimizer steps per size) vs ``BatchfitTuner(60, device=gpu)``. An MLP on
  128 x 128 items, collated in host memory and copied to the GPU by ``transfer_batch_to_device``.
  Lightning's finder only finds memory: the global batch is whatever fits. It searches inside the run
  it then trains (and saves and restores a checkpoint around the search), so a size it rejects may
  still fit a fresh run.
- **Accelerate**: ``accelerate.utils.find_executable_batch_size(starting_batch_size=60)`` around a loop of
  one micro-batch per step vs ``batchfit.integrations.accelerate.find_executable_batch_size(60,
  workload=...)`` around ``train(micro_batch_size, accumulation_steps)``. The same MLP.

Simulated capacities are small (22 and 128 MiB), so that a CPU can run the steps; allocator segments
(2 and 20 MiB) are then a large share of them, and differences in allocation order between a framework's
loop and batchfit's traced step matter more than on a real GPU.

Columns: *search steps* are real micro-steps (forward passes on the simulated GPU) run before training
proper, at sizes being tried; *crashes* are the simulated GPU's out-of-memory errors; *traced steps* are
batchfit's steps on fake tensors (no memory, nothing can crash); the last columns are what training ran:
micro-batch x accumulation, and its product, the global batch.

Run: ``.venv/bin/python benchmarks/framework_finders.py`` (about two minutes on two CPU cores). Exits
with status 1 when a batchfit row crashed, searched with real steps, or changed the global batch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny models

from batchfit import SimulatedDevice  # noqa: E402

HF_CAPACITY = "22MiB"
MLP_CAPACITY = "128MiB"


@dataclass
class Row:
    framework: str
    finder: str
    search_steps: int
    crashes: int
    traced_steps: int
    micro: int
    accumulation: int

    def global_batch(self) -> int:
        return self.micro * self.accumulation


@contextlib.contextmanager
def counting_traces() -> Iterator[list[int]]:
    """Count batchfit's traced steps (each trace runs two training steps on fake tensors)."""
    import batchfit.memory.estimate  # noqa: F401
    import batchfit.planning.fit  # noqa: F401 - the modules, by name: `batchfit.fit` is the function

    modules = [sys.modules["batchfit.planning.fit"], sys.modules["batchfit.memory.estimate"]]
    count = [0]
    original = modules[1].trace_for_device

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    for module in modules:
        module.trace_for_device = counted
    try:
        yield count
    finally:
        for module in modules:
            module.trace_for_device = original


# -- Hugging Face -------------------------------------------------------------------------------------
def hf_rows(global_batch: int) -> list[Row]:
    from hf_tiny import arguments, example, tiny_llama, train_two_steps

    from batchfit.integrations.transformers import plan_training_arguments

    rows = []
    with tempfile.TemporaryDirectory() as out:
        model = tiny_llama()
        gpu = SimulatedDevice(HF_CAPACITY)
        args = arguments(out, per_device_train_batch_size=global_batch, auto_find_batch_size=True, logging_steps=50)
        with gpu:
            gpu.track(model)
            ran = train_two_steps(model, args, global_batch)
        final = ran["seen"][-1]
        training = 2 * args.gradient_accumulation_steps
        rows.append(Row("Hugging Face", "Trainer(auto_find_batch_size=True)", len(ran["seen"]) - training,
                        gpu.stats().num_ooms, 0, final, args.gradient_accumulation_steps))  # fmt: skip

        model = tiny_llama()
        gpu = SimulatedDevice(HF_CAPACITY)
        with counting_traces() as traces:
            planned, _ = plan_training_arguments(
                model, arguments(out, logging_steps=50), global_batch, device=gpu, sample=example(0)
            )
        with gpu:
            gpu.track(model)
            ran = train_two_steps(model, planned, global_batch)
        micro, steps = planned.per_device_train_batch_size, planned.gradient_accumulation_steps
        rows.append(Row("Hugging Face", "batchfit plan_training_arguments", len(ran["seen"]) - 2 * steps,
                        gpu.stats().num_ooms, traces[0], micro, steps))  # fmt: skip
    return rows


# -- the MLP of the Lightning and Accelerate rows -------------------------------------------------------
FEATURES, TOKENS, HIDDEN, ITEMS, LR = 128, 128, 4096, 256, 0.1


@functools.cache
def mlp_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Host memory: made once, before any simulated GPU is entered."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ITEMS, TOKENS, FEATURES, generator=g)  # (n, t, features)
    return x, torch.randn(ITEMS, TOKENS, 4, generator=g)  # (n, t, targets)


@functools.cache
def mlp_items() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The dataset as a list of items (views of host memory made once, before any simulated GPU is
    entered: a view made inside one would put the whole dataset's storage on it)."""
    return list(zip(*mlp_data()))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4))


def on_host(items: list) -> Any:
    """``default_collate`` outside the simulated GPU: a loader collates in host memory."""
    from torch.utils.data import default_collate

    from batchfit.memory.trace.fake_step import real_execution

    with real_execution():
        return default_collate(items)


def lightning_module() -> Any:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()
            self.batch_size = 2
            self.seen: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.seen.append(int(x.shape[0]))
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> Any:
            return DataLoader(mlp_items(), batch_size=self.batch_size, collate_fn=on_host)

        def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
            return [t.clone() for t in batch]  # the copy to the GPU

    return Module()


def lightning_rows(global_batch: int, out: str) -> list[Row]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder

    from batchfit.integrations.lightning import BatchfitTuner

    def trainer(callback: Any) -> Any:
        return pl.Trainer(
            accelerator="cpu", devices=1, max_steps=2, precision="32-true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out, callbacks=[callback],
        )  # fmt: skip

    rows = []
    for mode in ("binsearch", "power"):
        module, gpu = lightning_module(), SimulatedDevice(MLP_CAPACITY)
        fitted = trainer(BatchSizeFinder(mode=mode, init_val=2))
        with gpu:
            gpu.track(module)
            fitted.fit(module)
        steps = fitted.accumulate_grad_batches
        rows.append(Row("Lightning", f"BatchSizeFinder(mode={mode!r})", len(module.seen) - 2 * steps,
                        gpu.stats().num_ooms, 0, module.batch_size, steps))  # fmt: skip

    module, gpu = lightning_module(), SimulatedDevice(MLP_CAPACITY)
    fitted = trainer(BatchfitTuner(global_batch, device=gpu))
    with counting_traces() as traces, gpu:
        gpu.track(module)
        fitted.fit(module)
    steps = fitted.accumulate_grad_batches
    rows.append(Row("Lightning", "batchfit BatchfitTuner", len(module.seen) - 2 * steps, gpu.stats().num_ooms,
                    traces[0], module.batch_size, steps))  # fmt: skip
    return rows


# -- Accelerate ---------------------------------------------------------------------------------------
def mlp_loop(gpu: SimulatedDevice, seen: list[int]) -> Callable[[int, int], None]:
    """``train(micro_batch_size, accumulation_steps)``: two optimizer steps of the MLP inside ``gpu``."""

    def train(micro_batch_size: int, accumulation_steps: int) -> None:
        x, y = mlp_data()
        parts = [(x[i : i + micro_batch_size], y[i : i + micro_batch_size])  # host views, made outside the GPU
                 for i in range(0, 2 * accumulation_steps * micro_batch_size, micro_batch_size)]  # fmt: skip
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        with gpu:
            gpu.track(model)
            for step in range(2):
                for k in range(accumulation_steps):
                    seen.append(micro_batch_size)
                    xb, yb = (t.clone() for t in parts[step * accumulation_steps + k])  # the copy to the GPU
                    loss = nn.functional.mse_loss(model(xb), yb) / accumulation_steps
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()

    return train


def accelerate_rows(global_batch: int) -> list[Row]:
    from accelerate.utils import find_executable_batch_size as accelerate_finder

    from batchfit import Workload
    from batchfit.integrations.accelerate import find_executable_batch_size

    rows = []
    gpu, seen = SimulatedDevice(MLP_CAPACITY), []
    loop = mlp_loop(gpu, seen)

    @accelerate_finder(starting_batch_size=global_batch)
    def theirs(batch_size: int) -> int:
        loop(batch_size, 1)  # the user's accumulation (1) is kept: the global batch is what fits
        return batch_size

    final = theirs()
    rows.append(Row("Accelerate", "accelerate find_executable_batch_size", len(seen) - 2, gpu.stats().num_ooms, 0,
                    final, 1))  # fmt: skip

    workload = Workload(  # fresh tensors of the items' shapes: the loop copies its micro-batches to the GPU
        model=mlp,
        batch=lambda b: (torch.randn(b, TOKENS, FEATURES), torch.randn(b, TOKENS, 4)),
        loss=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]),
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )
    gpu, seen = SimulatedDevice(MLP_CAPACITY), []
    ours = find_executable_batch_size(global_batch, device=gpu, workload=workload)(mlp_loop(gpu, seen))
    with counting_traces() as traces:
        ours()
    last = ours.attempts[-1]
    rows.append(Row("Accelerate", "batchfit find_executable_batch_size", len(seen) - 2 * last.accumulation_steps,
                    gpu.stats().num_ooms, traces[0], last.micro_batch_size, last.accumulation_steps))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch", type=int, default=60, help="items per optimizer step asked of every finder")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lightning", "lightning.pytorch", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    mlp_items()
    rows: list[Row] = []
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory() as out:  # the frameworks' chatter
        rows += hf_rows(opts.global_batch)
        rows += lightning_rows(opts.global_batch, out)
        rows += accelerate_rows(opts.global_batch)
    table = Table(title=f"finding a batch on one simulated GPU, global batch {opts.global_batch} asked",
                  title_justify="left")  # fmt: skip
    for column in ("framework", "finder", "search steps (real)", "crashes (OOM)", "traced steps (fake)",
                   "micro x accumulation", "global batch"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("framework", "finder") else "right")
    failed = False
    for row in rows:
        ours = row.finder.startswith("batchfit")
        bad = ours and (row.crashes or row.search_steps or row.global_batch() != opts.global_batch)
        failed |= bool(bad)
        kept = "" if row.global_batch() == opts.global_batch else " (changed)"
        table.add_row(row.framework, row.finder, str(row.search_steps), str(row.crashes), str(row.traced_steps),
                      f"{row.micro} x {row.accumulation}", f"{row.global_batch()}{kept}")  # fmt: skip
    Console(width=200).print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
