"""One rank of ``tests/test_distributed.py``'s FSDP test: the Trainer sharded with FSDP against the same steps by hand.

Run under ``torchrun --nproc_per_node=2``. Every rank trains a small GPT (padded token losses, tied
embeddings, numbered blocks) through ``Trainer(..., sharded=True)`` with AdamW and clipping, and also
replays the same steps on a plain copy of the model, by hand: one forward of the whole global batch,
``loss_sum / n_tokens``, backward, clipping, AdamW. It records what the Trainer fed the noise scale and
the same quantities by hand, and rank 0 writes everything to the JSON file named by the first argument.

The tests start its ranks with ``tests/launch.py``: forked from a warm server, as torchrun would start them.

Arguments: OUT GLOBAL_BATCH MICRO_BATCH STEPS.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch

from batchfit.advice.noise_scale import GradientNoiseScale
from batchfit.batching import make_splits, rank_shares, slice_batch
from batchfit.errors import ConfigError
from batchfit.runtime.simulated import SimulatedDevice
from batchfit.sources.presets import get
from batchfit.train.distributed import decided_on_main, init_distributed, shutdown
from batchfit.train.trainer import Trainer

MAX_GRAD_NORM = 0.05  # small enough that clipping acts on every step


class Recorded(GradientNoiseScale):
    """A noise scale that keeps every measurement it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[float, int, float, int]] = []

    def update(self, small_sq_norm: Any, small_batch: int, big_sq_norm: Any, big_batch: int) -> bool:
        self.calls.append((float(small_sq_norm), int(small_batch), float(big_sq_norm), int(big_batch)))
        return super().update(small_sq_norm, small_batch, big_sq_norm, big_batch)


def mean_grad_sq(model: torch.nn.Module, loss: Any, batch: Any) -> tuple[float, int]:
    """``|mean gradient|²`` of the token loss over ``batch``, and its token count (gradients left as None)."""
    loss_sum, n = loss(model, batch)
    grads = torch.autograd.grad(loss_sum / n, [p for p in model.parameters()])
    return float(sum(g.double().square().sum() for g in grads)), int(n)


def main() -> None:
    out, global_batch, micro, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    place = init_distributed("cpu")
    torch.set_default_dtype(torch.float64)
    wl = get("gpt", n_layer=2, n_embd=16, n_head=2, vocab_size=32, seq_len=8, pad=True)
    torch.manual_seed(0)
    model = wl.build_model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    noise = Recorded()
    trainer = Trainer(
        model,
        optimizer,
        wl.loss,
        global_batch_size=global_batch,
        micro_batch_size=micro,
        max_grad_norm=MAX_GRAD_NORM,
        noise_scale=noise,
        sharded=True,
    )
    shares = rank_shares(global_batch, place.world_size)
    splits = make_splits(global_batch, place.world_size, micro, same_count=True)
    first = sum(shares[: place.rank])
    expected_noise, sizes = [], []
    for step in range(steps):
        batch = wl.items(torch.arange(step * global_batch, (step + 1) * global_batch), 0)
        result = trainer.step(slice_batch(batch, first, first + shares[place.rank]))
        sizes.append(list(result.micro_batch_sizes))
        # The same step by hand: the union of every rank's first micro-batch is the small batch.
        starts = [sum(shares[:r]) for r in range(place.world_size)]
        small = tuple(torch.cat([t[s : s + split[0]] for s, split in zip(starts, splits)]) for t in batch)
        small_sq, small_n = mean_grad_sq(reference, wl.loss, small)
        big_sq, big_n = mean_grad_sq(reference, wl.loss, batch)
        if len(splits[0]) > 1:
            expected_noise.append((small_sq, small_n, big_sq, big_n))
        loss_sum, n = wl.loss(reference, batch)
        (loss_sum / n).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
    every_rank: list[Any] = [None] * place.world_size
    torch.distributed.all_gather_object(every_rank, sizes)
    sharded = {name: p.full_tensor() for name, p in model.named_parameters()}
    plain = dict(reference.named_parameters())
    worst = max(((sharded[k] - plain[k]).abs().max() / plain[k].abs().max()).item() for k in plain)
    report = {
        "max_rel_diff": worst,
        "sharded": trainer.sharded,
        "dtensor_params": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "optimizer_holds_sharded": all(
            p is q for p, q in zip(model.parameters(), (p for g in optimizer.param_groups for p in g["params"]))
        ),
        "micro_batch_sizes": every_rank,  # [rank][step] -> sizes
        "noise_calls": noise.calls,
        "noise_expected": expected_noise,
    }
    # Decisions (plans) are rank 0's on every rank, errors included.
    decided: list[Any] = [None] * place.world_size
    torch.distributed.all_gather_object(decided, decided_on_main(lambda: 10 + place.rank))

    def refuse() -> None:
        raise ConfigError("no plan here" if place.rank == 0 else "another rank's error")

    try:
        decided_on_main(refuse)
        refused = "nothing raised"
    except ConfigError as exc:
        refused = str(exc)
    refusals: list[Any] = [None] * place.world_size
    torch.distributed.all_gather_object(refusals, refused)
    report.update(decided=decided, refused=refusals)
    # fp16 under FSDP: the GradScaler made for it becomes a ShardedGradScaler (every rank skips alike).
    half = copy.deepcopy(reference)
    fp16 = Trainer(half, torch.optim.SGD(half.parameters(), lr=0.01), wl.loss, global_batch_size=global_batch,
                   micro_batch_size=micro, precision="fp16", sharded=True)  # fmt: skip
    fp16.step(slice_batch(batch, first, first + shares[place.rank]))
    scales: list[Any] = [None] * place.world_size
    torch.distributed.all_gather_object(scales, fp16.accumulator.grad_scaler.get_scale())
    report["fp16"] = {"scaler": type(fp16.accumulator.grad_scaler).__name__, "scales": scales}
    del fp16, half
    with SimulatedDevice("1GiB") as gpu:  # FSDP on a simulated GPU: refused in one line
        plain = copy.deepcopy(reference)
        try:
            Trainer(plain, torch.optim.SGD(plain.parameters()), wl.loss, global_batch_size=2, micro_batch_size=1,
                    device=gpu, sharded=True)  # fmt: skip
            report["simulated"] = "accepted"
        except ConfigError as exc:
            report["simulated"] = str(exc)
    del trainer, model, optimizer
    shutdown(place)
    if place.is_main:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
