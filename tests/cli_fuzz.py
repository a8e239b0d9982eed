"""Generated command lines for ``batchfit.cli.main``, and the rule each must keep.

Shared by ``test_cli_fuzz.py`` (hypothesis draws) and ``benchmarks/fuzz_trainer.py`` (``random``). The
argument space is what a new user types: the commands and their options with odd numbers (0, -1,
3.5, 1e3, 10^20, empty), sizes with and without units, GPU and preset names misspelt, empty strings,
unknown options. Every command line must end with exit code 0, or with exactly one line
``batchfit: error: ...`` on stderr; never a traceback.

Values are kept where a run stays small: ``train`` builds real models, so its model overrides and
batch sizes stay tiny; the other commands trace on fake tensors, where sizes cost nothing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.cli import main

Choice = Callable[[Sequence[Any]], Any]
RandInt = Callable[[int, int], int]

COUNTS = ["1", "2", "7", "0", "-1", "3.5", "1e3", "", " ", "x", "+4", "1_0", "0x10", "99999999999999999999"]
DEVICES = ["cpu", "cuda", "cuda:1", "T4", "t4", "a100", "A100-40GB", "H100-80GB", "24GiB", "1.5GiB", "64MiB",
           "0B", "-5GiB", "1e30B", "GiB", "24 GB", "24gb", "foo", "", " ", "simulated:", "simulated:64MiB",
           "simulated:T4", "simulated:foo", "simulated:0B"]  # fmt: skip
PRECISIONS = ["fp32", "bf16", "fp16", "bf16-true", "FP16", "fp8", "float32", ""]
PRESETS = ["mlp", "cnn", "MLP", "mpl", "", " ", "nosuch", "x:y", ":", "nosuchmodule.x:y", "gpt2", "./nothere/"]
OPTIMIZERS = ["adamw", "sgd", "adam", "lion", ""]
SETS = ["hidden=16", "hidden=0", "hidden=-4", "hidden=x", "hidden=", "=3", "hidden", "", "nosuchkey=1",
        "lr=1e-3", "lr=nan", "lr=-1", "depth=2", "depth=0", "dropout=0.5", "dropout=2", "classes=1"]  # fmt: skip
TINY_GPT = ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2", "--set", "vocab_size=97"]
FRACTIONS = ["0.1", "0", "-0.5", "1", "2", "nan", "inf", "", "x"]
MICRO = ["auto", "AUTO", "1", "3", "16", "0", "-2", "", "big", "1.5"]
JUNK = ["--nosuch", "-x", "--json=1", "--", "extra", "--device"]


@dataclass(frozen=True)
class Verdict:
    kind: str
    """``ok`` (exit 0, no traceback), ``error`` (one ``batchfit: error:`` line) or ``bad`` (anything else)."""
    detail: str = ""

    @property
    def unexpected(self) -> bool:
        """One line, but about an exception the CLI did not expect (``main``'s last resort): a bug to fix."""
        return self.kind == "error" and self.detail.startswith("batchfit: error: unexpected ")


def _maybe(randint: RandInt) -> bool:
    return randint(0, 1) == 1


def random_argv(randint: RandInt, choice: Choice) -> list[str]:
    """One command line; ``{tmp}`` in a path stands for a fresh temporary directory (``check_argv``)."""
    command = choice(["estimate", "estimate", "fit", "plan", "plan", "train", "train", "gpus", "presets", "",
                      "nosuch", "--help"])  # fmt: skip
    argv = [command] if command else []
    if command in ("estimate", "fit", "plan", "train"):
        preset = choice(PRESETS + ["gpt"])
        argv.append(preset)
        if preset == "gpt":
            argv += TINY_GPT + ["--seq-len", choice(["16", "0", "-1", "8"])]
    if command == "estimate" and _maybe(randint):
        argv += [choice(["--batch-size", "-b"]), choice(COUNTS + ["100000"])]
    if command == "plan" and _maybe(randint):
        argv += [choice(["--global-batch-size", "-g"]), choice(COUNTS + ["4096"])]
    if command == "plan" and _maybe(randint):
        argv += ["--gpus", choice(COUNTS[:7])]
    if command in ("estimate", "fit", "plan", "train") and _maybe(randint):
        argv += [choice(["--device", "-d"]), choice(DEVICES)]
    if command in ("estimate", "fit", "plan", "train") and _maybe(randint):
        argv += [choice(["--precision", "-p"]), choice(PRECISIONS)]
    if command in ("estimate", "fit", "plan") and _maybe(randint):
        argv += ["--optimizer", choice(OPTIMIZERS)]
    if command in ("fit", "plan") and _maybe(randint):
        argv += ["--margin", choice(FRACTIONS)]
    if command in ("estimate", "fit") and _maybe(randint):
        argv += ["--accumulation-steps", choice(COUNTS[:8])]
    if command in ("estimate", "fit", "plan") and _maybe(randint):
        argv += ["--context-mib", choice(["0", "-1", "500", "1e9", "nan", "x", ""])]
    if command == "fit" and _maybe(randint):  # the longest sequence at a batch
        argv += ["--maximize", choice(["seq-len", "seq-len", "batch-size", "seq_len", "tokens", ""])]
        if _maybe(randint):
            argv += [choice(["--batch-size", "-b"]), choice(COUNTS)]
        if _maybe(randint):
            argv += ["--seq-multiple", choice(["1", "8", "0", "-1", "4096", "x", ""])]
    if command == "train":
        if _maybe(randint):  # kept small: train runs real steps
            argv += [choice(["--global-batch-size", "-g"]), choice(COUNTS[:13])]
        if _maybe(randint):
            argv += [choice(["--micro-batch-size", "-m"]), choice(MICRO)]
        argv += ["--steps", choice(["1", "2", "0", "-1", "", "x"])]
        if _maybe(randint):
            argv += ["--dtype", choice(["float32", "float64", "float16", ""])]
        if _maybe(randint):
            argv += ["--seed", choice(["0", "1", "-1", "x", ""])]
        if _maybe(randint):
            argv += [choice(["--save", "--checkpoint"]), choice(["{tmp}/w.pt", "{tmp}/nodir/w.pt", "{tmp}", ""])]
    if command in ("estimate", "fit", "plan", "train"):
        for _ in range(randint(0, 2)):
            argv += ["--set", choice(SETS)]
    if command and command != "--help" and _maybe(randint):
        argv.append("--json")
    if randint(0, 5) == 0 or not argv:  # not [] itself: see test_no_arguments_shows_the_help_once
        argv.append(choice(JUNK))
    return argv


def check_argv(argv: list[str]) -> Verdict:
    """Run ``main(argv)`` in this process, from a temporary directory, and judge its exit code and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [a.replace("{tmp}", tmp) for a in argv]
        out, err = io.StringIO(), io.StringIO()
        logger = logging.getLogger("batchfit")
        level, cwd = logger.level, os.getcwd()
        os.chdir(tmp)  # relative paths (``--save ''``) land in the temporary directory
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(args)
        except BaseException as exc:  # noqa: BLE001 - main must not raise at all
            return Verdict("bad", f"main raised {type(exc).__name__}: {exc}")
        finally:
            os.chdir(cwd)
            logger.setLevel(level)
    text = err.getvalue()
    if "Traceback" in text:
        return Verdict("bad", f"a traceback: {text[-400:]}")
    if code == 0:
        return Verdict("ok")
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) != 1 or not lines[0].startswith("batchfit: error:"):
        return Verdict("bad", f"exit {code} with stderr {text[-400:]!r}")
    return Verdict("error", lines[0])
