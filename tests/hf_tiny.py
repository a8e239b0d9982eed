"""A tiny Llama-style causal LM (built from transformers' config class) and its data, for the Trainer tests.

Shared by ``tests/test_integrations_hf.py`` and ``tests/hf_worker.py``. One layer and 32 tokens keep a
traced step short; ``CAPACITY`` is a simulated GPU on which 5 items fit (4 beside accumulated gradients),
so global batches above that need accumulation.
"""

from __future__ import annotations

from typing import Any

SEQ_LEN = 32
CAPACITY = "22MiB"
"""A simulated GPU's allocator capacity (its CUDA context is zero)."""


def tiny_llama(seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=512, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 64, "tie_word_embeddings": False,
}  # fmt: skip
"""A tiny Llama's ``config.json``: two layers whose heads and widths two or four ranks split evenly."""


def llama_config_dir(path: Any, **fields: Any) -> Any:
    """``path`` with a tiny Llama's ``config.json`` written in it (``fields`` change the config)."""
    import json

    (path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **fields}))
    return path


def example(i: int) -> dict[str, list[int]]:
    """One dataset example, as a tokenised dataset yields it (lists of ids)."""
    ids = [(7 * i + 3 * t) % 512 for t in range(SEQ_LEN)]
    return {"input_ids": ids, "labels": ids}


def arguments(out: str, **overrides: Any) -> Any:
    """``TrainingArguments`` for two quiet optimizer steps on the CPU."""
    from transformers import TrainingArguments

    base: dict[str, Any] = dict(
        output_dir=out, use_cpu=True, max_steps=2, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_drop_last=True, seed=0,
    )  # fmt: skip
    return TrainingArguments(**{**base, **overrides})


def train_two_steps(model: Any, args: Any, global_batch_size: int, callbacks: list | None = None) -> dict[str, Any]:
    """Train two steps on ``2 * global_batch_size`` examples; the micro-batch sizes every forward saw."""
    from transformers import Trainer

    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.append(int(k["input_ids"].shape[0])), with_kwargs=True)
    try:
        trainer = Trainer(
            model=model, args=args, train_dataset=[example(i) for i in range(2 * global_batch_size)],
            callbacks=callbacks or [],
        )  # fmt: skip
        trainer.train()
    finally:
        hook.remove()
    return {"seen": seen, "global_step": trainer.state.global_step}
