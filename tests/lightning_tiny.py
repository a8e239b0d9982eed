"""A small LightningModule (float64) and the same training by hand, for the Lightning tests.

Shared by ``tests/test_integrations_lightning.py`` and ``tests/lightning_worker.py``. Items are 32 x 128
features; on the simulated GPU ``CAPACITY`` at most 5 fit in one micro-batch, so a global batch of 24
needs accumulation.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

CAPACITY = "28MiB"
SMALLER = "24MiB"
"""A GPU on which fewer items fit (2): what a rank that decided for itself would plan for."""
ITEMS = 128
LR = 0.1


@functools.cache
def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset, made once (so that it stays host memory when a simulated GPU is entered later)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ITEMS, 32, 128, generator=g, dtype=torch.float64)  # (n, t, features)
    y = torch.randn(ITEMS, 32, 4, generator=g, dtype=torch.float64)  # (n, t, targets)
    return x, y


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 4)).double()


def reference(global_batch_size: int, steps: int) -> dict[str, torch.Tensor]:
    """``steps`` plain SGD steps on whole global batches taken in order: what any split must equal."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = data()
    for step in range(steps):
        part = slice(step * global_batch_size, (step + 1) * global_batch_size)
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_module(**kwargs: Any) -> Any:
    """A ``LightningModule`` training ``net()`` with mean-squared error and SGD, reading ``batch_size``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self, batch_size: int | None = 2, returns_loss: bool = True) -> None:
            super().__init__()
            self.net = net()
            if batch_size is not None:
                self.batch_size = batch_size
            self.returns_loss = returns_loss
            self.seen: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            self.seen.append(int(x.shape[0]))
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss if self.returns_loss else None

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> Any:
            # In order, also under DDP (rank r takes items r, r + 2, ...): the global batches are then the
            # reference's, whatever the split.
            dataset = TensorDataset(*data())
            sampler = DistributedSampler(dataset, shuffle=False) if torch.distributed.is_initialized() else None
            return DataLoader(dataset, batch_size=getattr(self, "batch_size", 2), sampler=sampler)

    return Module(**kwargs)


def make_trainer(callbacks: list, **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    base: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=2, precision="64-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return pl.Trainer(callbacks=callbacks, **{**base, **kwargs})
