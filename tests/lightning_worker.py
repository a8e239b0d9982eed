"""One rank of ``tests/test_integrations_lightning.py``'s DDP run: ``Trainer.fit`` with ``BatchfitTuner``.

Run under ``torchrun --nproc_per_node=2``; Lightning's DDP strategy (gloo on the CPU) joins the processes
torchrun started. Rank 1 is given a smaller GPU than rank 0: had it planned for itself, it would choose a
smaller batch, so agreeing on rank 0's answer shows the answer came through the strategy's broadcast.
Each rank writes what it ran to ``OUT.<rank>.json``; rank 0 also saves the weights to ``OUT.pt``.

The tests start its ranks with ``tests/launch.py``: forked from a warm server, as torchrun would start them.

Arguments: OUT GLOBAL_BATCH.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from lightning_tiny import CAPACITY, SMALLER, make_module, make_trainer  # noqa: E402

from batchfit.integrations.lightning import BatchfitTuner  # noqa: E402
from batchfit.runtime.simulated import SimulatedDevice  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    out, global_batch_size = sys.argv[1], int(sys.argv[2])
    module = make_module()
    rank = int(os.environ["RANK"])
    tuner = BatchfitTuner(global_batch_size, device=SimulatedDevice(CAPACITY if rank == 0 else SMALLER))
    trainer = make_trainer([tuner], devices=2, strategy="ddp", use_distributed_sampler=False)
    trainer.fit(module)
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "batch_size": module.batch_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "max_micro_batch_size": tuner.plan.max_micro_batch_size,
        "seen": module.seen,
        "global_step": trainer.global_step,
    }
    Path(f"{out}.{trainer.global_rank}.json").write_text(json.dumps(record))
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.net.state_dict().items()}, f"{out}.pt")


if __name__ == "__main__":
    main()
