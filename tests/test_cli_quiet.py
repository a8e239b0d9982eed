"""Other libraries' warnings and logs stay off the terminal unless ``-v`` asks for them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.cli.quiet import take_verbose
from batchfit.models import hf

pytestmark = pytest.mark.skipif(not hf.available(), reason="needs transformers")


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BATCHFIT_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    env.pop("TORCH_LOGS", None)
    code = "import sys; from batchfit.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)


def test_a_lora_estimate_of_a_named_model_prints_no_other_librarys_warnings(tmp_path: Path) -> None:
    import transformers

    d = tmp_path / "tiny"
    # A tiny config whose special tokens lie outside its vocabulary: transformers warns about it.
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, bos_token_id=100, eos_token_id=101,
                             architectures=["LlamaForCausalLM"]).save_pretrained(d)  # fmt: skip
    args = ["estimate", str(d), "-b", "2", "--seq-len", "64", "--device", "1GiB", "--lora", "r=4", "--checkpointing",
            "--json"]  # fmt: skip
    quiet = _run(args, tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    loud = _run([*args, "-v"], tmp_path)
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout == quiet.stdout
    assert "bos_token_id" in loud.stderr  # transformers' own line about the config, shown with -v


def test_verbose_is_taken_anywhere_on_the_line() -> None:
    assert take_verbose(["-v", "plan", "gpt"]) == (["plan", "gpt"], True)
    assert take_verbose(["plan", "gpt", "--verbose"]) == (["plan", "gpt"], True)
    assert take_verbose(["plan", "gpt"]) == (["plan", "gpt"], False)
