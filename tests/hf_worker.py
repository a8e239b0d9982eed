"""One rank of ``tests/test_integrations_hf.py``'s two-process run: plan TrainingArguments, train two steps.

Run under ``torchrun --nproc_per_node=2``. For each global batch, every rank plans with
``plan_training_arguments`` (rank 0 plans, the others receive its plan), trains two optimizer steps of
the HF ``Trainer`` (gloo on the CPU) with the arguments it got, and writes what it ran to
``OUT.<rank>.json``.

The tests start its ranks with ``tests/launch.py``: forked from a warm server, as torchrun would start them.

Arguments: OUT GLOBAL_BATCH [GLOBAL_BATCH ...].
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from hf_tiny import CAPACITY, arguments, example, tiny_llama, train_two_steps  # noqa: E402

from batchfit.integrations.transformers import plan_training_arguments  # noqa: E402
from batchfit.runtime.simulated import SimulatedDevice  # noqa: E402


def main() -> None:
    out, sizes = sys.argv[1], [int(g) for g in sys.argv[2:]]
    model = tiny_llama()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        args = arguments(tmp)
        for global_batch_size in sizes:
            planned, plan = plan_training_arguments(
                model, args, global_batch_size, device=SimulatedDevice(CAPACITY), sample=example(0)
            )
            ran = train_two_steps(model, planned, global_batch_size)
            runs.append({
                "global_batch_size": global_batch_size,
                "per_device_train_batch_size": planned.per_device_train_batch_size,
                "gradient_accumulation_steps": planned.gradient_accumulation_steps,
                "world_size": planned.world_size,
                "max_micro_batch_size": plan.max_micro_batch_size,
                **ran,
            })  # fmt: skip
        Path(f"{out}.{args.process_index}.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
