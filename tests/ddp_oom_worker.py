"""One rank of the DDP out-of-memory tests in ``tests/test_ddp_oom.py``: rank 1 runs out of memory mid-window.

Run under ``torchrun --nproc_per_node=2`` (gloo, CPU). Both ranks train the float64 ``Faulty`` MLP of
``test_oom`` (plus one zero-valued ``tag`` parameter per item, outside the optimizer, whose gradient
counts each item's uses: see ``fuzz_cases``) through ``Trainer`` under DDP: global batch 24, shares of
12, micro-batch 4 (``[4, 4, 4]`` per rank), 2 steps. Only rank 1 fails, where the scenario says:

- ``forward``: its window's second micro-batch, in the forward pass;
- ``backward``: the same micro-batch, in the backward pass (its window is redone);
- ``last-forward``: its window's last micro-batch, in the forward pass (before it synchronises);
- ``one-item``: every forward (it re-splits down to one item, which does not fit either);
- ``simulated``: nothing scripted; rank 1's simulated GPU (48 MiB) cannot hold the forward workspace
  of 4 items (8 MiB each, as attention scores would be) beside cuBLAS's, rank 0's (1 GiB) can;
- ``sync-backward``: its window's last micro-batch, in the backward pass that all-reduces.

Scenarios named together run one after the other in the same process group (a scenario that stops
both ranks with the same error leaves the group usable). Each rank writes ``OUT.rank<R>.json``: per
scenario, its micro-batch sizes and micro-batch size per step, the error it stopped with (type and
message), the largest relative difference of its parameters from the full-batch reference, and each
step's item-use counts.

The tests start its ranks with ``tests/launch.py``: forked from a warm server, as torchrun would start them.

Arguments: OUT SCENARIO[,SCENARIO...].
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from test_oom import Faulty, Scratch
from torch import nn

from batchfit.runtime.simulated import SimulatedDevice
from batchfit.train.distributed import init_distributed
from batchfit.train.trainer import Trainer

G, MICRO, STEPS = 24, 4, 2
SCENARIOS: dict[str, dict[str, set[int]]] = {
    "forward": {"forward_at": {1}},
    "backward": {"backward_at": {1}},
    "last-forward": {"forward_at": {2}},
    "one-item": {"forward_at": set(range(1000))},
    "simulated": {},
    "sync-backward": {"backward_at": {2}},
}
CAPACITY = {"simulated": ["1GiB", "48MiB"]}  # by rank
WORKSPACE = 2**20  # float64 elements per item of the forward workspace (8 MiB) in "simulated"


class Tagged(nn.Module):
    def __init__(self, faulty: Faulty, workspace: int = 0) -> None:
        super().__init__()
        self.net = faulty
        self.tag = nn.Parameter(torch.zeros(G * STEPS, dtype=torch.float64))
        self.workspace = workspace

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tag = self.tag[ids]  # used inside forward, as DDP expects of every parameter
        return self.net(Scratch.apply(x, self.workspace, 0)), tag - tag.detach()


def loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, ids = batch
    logits, tags = model(x, ids)
    return (F.cross_entropy(logits, y, reduction="none") + tags).mean()


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(G, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (G,), generator=gen),
         torch.arange(t * G, (t + 1) * G))
        for t in range(STEPS)
    ]  # fmt: skip


def build(workspace: int = 0, **faults: set[int]) -> tuple[Tagged, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tagged(Faulty(**faults).double(), workspace)
    return model, torch.optim.SGD(model.net.parameters(), lr=0.1, momentum=0.9)


def reference(batches: list) -> Tagged:
    model, optimizer = build()
    for batch in batches:
        loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.tag.grad = None
    return model


def run(scenario: str, rank: int) -> dict[str, Any]:
    """One scenario on this rank: what it did, how it ended, and how far from the full batch."""
    faults = SCENARIOS[scenario] if rank == 1 else {}
    model, optimizer = build(WORKSPACE if scenario in CAPACITY else 0, **faults)
    uses: list[list[float]] = []

    def count_uses(opt: Any, args: Any, kwargs: Any) -> None:
        uses.append([g * G for g in model.tag.grad.tolist()])  # DDP averaged: 1/G per use
        model.tag.grad = None

    optimizer.register_step_pre_hook(count_uses)
    device: Any = SimulatedDevice(CAPACITY[scenario][rank]) if scenario in CAPACITY else "cpu"
    batches = global_batches()
    start = rank * (G // 2)
    report: dict[str, Any] = {"sizes": [], "micro": [], "replanned": [], "error": None}
    began = time.monotonic()
    try:
        trainer = Trainer(model, optimizer, loss, global_batch_size=G, micro_batch_size=MICRO, device=device)
        for batch in batches:
            result = trainer.step(tuple(t[start : start + G // 2] for t in batch))
            report["sizes"].append(list(result.micro_batch_sizes))
            report["micro"].append(result.micro_batch_size)
            report["replanned"].append(len(result.replanned))
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        report["error"] = {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
                           "message": str(exc)}  # fmt: skip
    report["seconds"] = time.monotonic() - began
    report["uses"] = uses
    ref = reference(batches)
    report["max_rel_diff"] = max(
        ((p - q).abs().max() / q.abs().max()).item() for p, q in zip(model.net.parameters(), ref.net.parameters())
    )
    return report


def main() -> None:
    out, scenarios = sys.argv[1], sys.argv[2].split(",")
    place = init_distributed("cpu", timeout_s=30.0)
    reports = {}
    for scenario in scenarios:
        reports[scenario] = report = run(scenario, place.rank)
        with open(f"{out}.rank{place.rank}.json", "w") as f:
            json.dump(reports, f)
        if report["error"] is not None and report["error"]["type"] != "DoesNotFitError":
            return  # the group is broken (sync-backward): leave without its collectives
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
