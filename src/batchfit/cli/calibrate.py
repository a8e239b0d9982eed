"""``batchfit calibrate``: measure this machine's GPU and write a device profile for estimate, fit and plan."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ..gpu.profiles import save
from ..report.tables import profile_table
from . import options as opts
from .options import JsonOpt


def calibrate(
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="Where to write the profile (default: the cache directory, keyed by GPU, driver, CUDA and torch, "
            "where estimate, fit and plan find it).",
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Fewer training steps and convolution shapes (under a minute).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Measure this GPU: the CUDA context after real training steps, cuBLAS and cuDNN workspaces; write a profile.

    Needs a CUDA GPU and NVML (nvidia-ml-py). Copy the profile to machines with the same GPU, driver,
    CUDA and torch (or pass it with --profile) to use it there.
    """
    from ..runtime import calibrate as measuring

    gpu = measuring.TorchGpu()

    def progress(line: str) -> None:
        if not as_json:
            sys.stderr.write(f"batchfit: {line}\n")

    profile = measuring.calibrate_device(gpu, quick=quick, progress=progress)
    path = save(profile, output)
    if as_json:
        opts.emit_json({"path": str(path), "profile": profile.to_json()})
        return

    opts.console().print(profile_table(profile, str(path)))
