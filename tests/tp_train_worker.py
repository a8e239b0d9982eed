"""One rank of ``tests/test_tensor_parallel_train.py``: the Trainer under tensor parallelism against one process.

Run under ``torchrun --nproc_per_node=N``. Every rank builds the tiny Llama of the config directory given
(float64, seed 0), trains it through ``Trainer(..., tensor_parallel=T, sequence_parallel=...)`` with SGD
(learning rate 1: a step subtracts the gradient itself) and clipping, its group's share of each global
batch cut into micro-batches, and also replays the same steps on a plain copy, by hand: one forward of
the whole global batch, backward, clipping, SGD. It records both runs' losses and every parameter's
change (the gradient); rank 0 writes them to the JSON file named by the first argument.

The tests start its ranks with ``tests/launch.py``: forked from a warm server, as torchrun would start them.

Arguments: OUT CONFIG_DIR TENSOR_PARALLEL SEQUENCE_PARALLEL(0|1) GLOBAL_BATCH MICRO_BATCH STEPS.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch

from batchfit.batching import rank_shares, slice_batch
from batchfit.sources import load
from batchfit.train.distributed import init_distributed, shutdown
from batchfit.train.trainer import Trainer

SEQ_LEN = 8
MAX_GRAD_NORM = 0.5  # small enough that clipping acts


def global_batch(step: int, size: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (size, SEQ_LEN), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def next_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy in the logits' own dtype (transformers' loss upcasts to float32, which
    would hide float64 exactness); on vocabulary-split logits it runs under ``loss_parallel``."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    vocab = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), batch["labels"][:, 1:].reshape(-1))


class RecordingSGD(torch.optim.SGD):
    """SGD that notes whether a step read a gradient still held as partial sums (a ``Partial`` DTensor placement:
    NOTE [ Gradients left as partial sums ] in ``batchfit/train/finish.py``)."""

    partial_seen = False

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                placements = getattr(p.grad, "placements", ())
                self.partial_seen |= any(pl.is_partial() for pl in placements)
        return super().step(closure)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    out, config_dir = sys.argv[1], sys.argv[2]
    tp, sp, global_size, micro, steps = int(sys.argv[3]), sys.argv[4] == "1", *map(int, sys.argv[5:8])
    place = init_distributed("cpu")
    torch.set_default_dtype(torch.float64)
    wl = load(config_dir, seq_len=SEQ_LEN)
    torch.manual_seed(0)
    model = wl.build_model()
    reference = copy.deepcopy(model)
    vocab = model.config.vocab_size
    trainer = Trainer(
        model, RecordingSGD(model.parameters(), lr=1.0), next_token_loss, global_batch_size=global_size,
        micro_batch_size=micro, max_grad_norm=MAX_GRAD_NORM, tensor_parallel=tp, sequence_parallel=sp,
    )  # fmt: skip
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    groups = place.world_size // tp
    shares = rank_shares(global_size, groups)
    group = place.rank // tp
    first = sum(shares[:group])
    report: dict[str, Any] = {"losses": [], "ref_losses": [], "grad_diff": [], "grad_max": [], "sizes": []}
    for step in range(steps):
        batch = global_batch(step, global_size, vocab)
        before = {n: whole(p).detach().clone() for n, p in trainer.model.named_parameters()}
        result = trainer.step(slice_batch(batch, first, first + shares[group]))
        after = {n: whole(p).detach() for n, p in trainer.model.named_parameters()}
        loss = next_token_loss(reference, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
        grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        diff = max((before[n] - after[n] - grads[n]).abs().max().item() for n in grads)
        report["losses"].append(float(result.loss))
        report["ref_losses"].append(loss.item())
        report["grad_diff"].append(diff)
        report["grad_max"].append(max(g.abs().max().item() for g in grads.values()))
        report["sizes"].append(list(result.micro_batch_sizes))
    report["dtensor_params"] = all(hasattr(p, "full_tensor") for p in trainer.model.parameters())
    report["sharded"] = trainer.sharded
    report["partial_seen"] = trainer.optimizer.partial_seen
    del trainer, model
    shutdown(place)
    if place.is_main:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
