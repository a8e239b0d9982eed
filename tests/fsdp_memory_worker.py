"""One rank of ``tests/test_sharding.py``: what ``fully_shard`` really keeps on rank 0, per category.

Run under ``torchrun --nproc_per_node=2``. For each workload of ``WORKLOADS`` every rank builds the
model, shards it as the Trainer does (``batchfit.train.fsdp.shard_model``: one unit per numbered block,
then the root), runs one step (forward, backward, AdamW) and measures the bytes of the distinct local
storages it holds: parameters and buffers after sharding, gradients after backward, optimizer states
after the step. Rank 0 writes them to the JSON file named by the first argument.

The tests start its ranks with ``tests/launch.py``: forked from a warm server, as torchrun would start them.

Arguments: OUT.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable

import torch
from torch import nn

from batchfit.sources.presets import get
from batchfit.train.distributed import init_distributed, shutdown
from batchfit.train.fsdp import shard_model
from batchfit.workload import Workload, trainable_parameters

BATCH_SIZE = 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(18, 27), nn.LayerNorm(27), nn.Linear(27, 18)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


class _Net(nn.Module):
    """Row counts that two ranks do not split evenly (33, 27, 5), a frozen embedding and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(33, 18)
        self.embed.weight.requires_grad_(False)  # sharded like any parameter; no gradient, no state
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(18, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))  # kept whole on every rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1)) * self.scale[:5]


def _net_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randint(0, 33, (b, 4), generator=g), torch.randint(0, 5, (b,), generator=g)


WORKLOADS = {
    # GPT-2 style: tied embeddings, fused qkv (54 rows), 33-token vocabulary.
    "gpt": lambda: get("gpt", n_layer=2, n_embd=18, n_head=2, vocab_size=33, seq_len=8),
    "frozen-and-buffer": lambda: Workload(
        model=_Net,
        batch=_net_batch,
        loss=lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
        name="frozen-and-buffer",
    ),
}


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(wl: Workload) -> dict[str, int]:
    torch.manual_seed(0)
    model = wl.build_model()
    optimizer = wl.optimizer(trainable_parameters(model))
    shard_model(model, optimizer)
    out = {"parameters": _local_bytes([*model.parameters(), *model.buffers()])}
    loss = wl.loss(model, wl.batch(BATCH_SIZE))
    loss_sum, n = loss if isinstance(loss, tuple) else (loss, 1)
    (loss_sum / n).backward()
    out["gradients"] = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    out["optimizer_states"] = _local_bytes(
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    )
    return out


def main() -> None:
    place = init_distributed("cpu")
    report = {name: measure(make()) for name, make in WORKLOADS.items()}
    if place.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f)
    shutdown(place)


if __name__ == "__main__":
    main()
