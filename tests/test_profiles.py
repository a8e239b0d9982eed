"""Device profiles and the context an estimate assumes: written, matched, used, refused; the CLI's one lines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from gpu_fakes import H100, H100_TOTAL, PER_HANDLE, FakeGpu

import batchfit
from batchfit import Workload
from batchfit.cli import main
from batchfit.errors import ConfigError, ProfileError
from batchfit.gpu import profiles
from batchfit.gpu.catalog import CONTEXT_BYTES, EAGER_CONTEXT_BYTES, get_device
from batchfit.gpu.context import detect_module_loading, resolve_device
from batchfit.runtime.calibrate import calibrate_device
from batchfit.units import MiB

CONTEXT = 1100 * MiB  # what FakeGpu's readings give after the training steps
CONTEXT_BENCHMARK = 1500 * MiB


@pytest.fixture
def profile() -> profiles.DeviceProfile:
    return calibrate_device(FakeGpu())


@pytest.fixture
def cache(tmp_path: Path) -> dict[str, str]:
    return {"BATCHFIT_CACHE_DIR": str(tmp_path / "cache")}


def _resolve(spec: str, *, local=None, environ=None, **kw) -> tuple:
    r = resolve_device(spec, local=lambda: local, environ=environ or {}, cuda_version=None, cudnn_benchmark=False,
                       **kw)  # fmt: skip
    return r.device, r.notes


# -- written ---------------------------------------------------------------------------------------------
def test_a_profile_is_written_under_its_key_and_reads_back(profile, cache) -> None:
    path = profiles.save(profile, environ=cache)
    assert path == Path(cache["BATCHFIT_CACHE_DIR"]) / "profiles" / (
        "NVIDIA_H100_80GB_HBM3-driver580.65.06-cuda13.0-torch2.11.0_cu130.json"
    )
    assert profiles.load(path) == profile
    assert json.loads(path.read_text())["schema"] == profiles.SCHEMA
    assert profiles.find(H100, cache) == (profile, path)
    other = dataclasses.replace(H100, driver="570.1")
    assert profiles.find(other, cache) == (None, profiles.default_path(other, cache))


def test_the_cache_directory_follows_the_environment(tmp_path: Path) -> None:
    assert profiles.cache_dir({"BATCHFIT_CACHE_DIR": "/a"}) == Path("/a/profiles")
    assert profiles.cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path("/x/batchfit/profiles")
    assert profiles.cache_dir({"HOME": "/h"}) == Path("/h/.cache/batchfit/profiles")


# -- matched and used ------------------------------------------------------------------------------------
def test_the_stored_profile_of_this_gpu_is_used_automatically(profile, cache) -> None:
    path = profiles.save(profile, environ=cache)
    dev, notes = _resolve("H100-80GB", local=H100, environ=cache)
    assert (dev.context_source, dev.context_detail, dev.context_bytes) == ("profile", str(path), CONTEXT)
    assert (dev.total_bytes, dev.cublas_workspace_bytes, dev.cublas_handles) == (H100_TOTAL, PER_HANDLE, 2)
    assert dev.conv_workspace == profile.conv_workspace
    assert notes == (f"using the device profile {path} ({H100.describe()})",)
    # ... and by the name torch reports
    assert _resolve("NVIDIA H100 80GB HBM3", local=H100, environ=cache)[0].context_source == "profile"


def test_an_estimate_with_a_profile_uses_its_context_and_workspaces(profile, cache) -> None:
    profiles.save(profile, environ=cache)
    dev, _ = _resolve("H100-80GB", local=H100, environ=cache)
    wl = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda b: torch.randn(b, 64),
                  loss=lambda m, x: m(x).sum())  # fmt: skip
    est = batchfit.estimate(wl, 8, device=dev)
    default = batchfit.estimate(wl, 8, device="H100-80GB")
    assert (est.context_bytes, est.context_source) == (CONTEXT, "profile")
    assert est.device_total_bytes == est.peak_reserved_bytes + CONTEXT
    assert est.workspace_bytes == 2 * PER_HANDLE and default.workspace_bytes == 2 * 32 * MiB
    assert est.context_assumption.startswith("1.07 GiB: measured by batchfit calibrate")
    assert (default.context_source, default.context_bytes) == ("default", CONTEXT_BYTES["Hopper"])


def test_with_cudnn_benchmark_the_context_after_the_benchmark_runs_is_used(profile, cache) -> None:
    profiles.save(profile, environ=cache)
    r = resolve_device("H100-80GB", local=lambda: H100, environ=cache, cuda_version=None, cudnn_benchmark=True)
    assert (r.device.context_bytes, r.device.cudnn_benchmark) == (CONTEXT_BENCHMARK, True)


def test_an_explicit_profile_applies_on_a_machine_without_a_gpu(profile, tmp_path: Path) -> None:
    path = profiles.save(profile, tmp_path / "h100.json")
    for name in ("H100-80GB", "h100", "NVIDIA H100 80GB HBM3"):
        dev, notes = _resolve(name, local=None, profile=str(path))
        assert (dev.name, dev.context_source, dev.context_bytes, notes) == ("H100-80GB", "profile", CONTEXT, ())
    dev, _ = _resolve("H100-80GB", profile=str(path), context_mib=700)  # an override still wins for the context
    assert (dev.context_source, dev.context_bytes, dev.conv_workspace) == ("override", 700 * MiB,
                                                                           profile.conv_workspace)  # fmt: skip


def test_a_profile_of_a_gpu_outside_the_catalog_is_named_as_torch_names_it(profile, tmp_path: Path) -> None:
    odd = dataclasses.replace(profile, gpu=dataclasses.replace(H100, name="NVIDIA RTX A4000"), total_bytes=16 << 30,
                              compute_capability=(8, 6))  # fmt: skip
    path = profiles.save(odd, tmp_path / "a4000.json")
    dev, _ = _resolve("NVIDIA RTX A4000", profile=str(path))
    assert (dev.name, dev.total_bytes, dev.compute_capability, dev.context_bytes) == (
        "NVIDIA RTX A4000",
        16 << 30,
        (8, 6),
        CONTEXT,
    )


# -- refused when it does not match -----------------------------------------------------------------------
def test_a_stored_profile_is_not_used_for_another_setup(profile, cache) -> None:
    profiles.save(profile, environ=cache)
    for local, device in (
        (None, "H100-80GB"),  # no GPU here: automatic use needs the local GPU
        (dataclasses.replace(H100, driver="570.1"), "H100-80GB"),  # another driver
        (dataclasses.replace(H100, torch="2.10.0"), "H100-80GB"),  # another torch
        (H100, "A100-40GB"),  # the estimate is for another GPU
    ):
        dev, notes = _resolve(device, local=local, environ=cache)
        assert (dev.context_source, notes) == ("default", ()), (local, device)


def test_a_stored_profile_measured_with_other_module_loading_is_ignored_and_says_so(profile, cache) -> None:
    path = profiles.save(profile, environ=cache)  # measured LAZY
    dev, notes = _resolve("H100-80GB", local=H100, environ={**cache, "CUDA_MODULE_LOADING": "EAGER"})
    assert (dev.context_source, dev.context_bytes) == ("eager", EAGER_CONTEXT_BYTES)
    assert notes[0] == f"ignored the device profile {path}: measured with LAZY module loading, this run uses EAGER"


def test_an_explicit_profile_for_another_gpu_is_refused(profile, tmp_path: Path) -> None:
    path = profiles.save(profile, tmp_path / "h100.json")
    with pytest.raises(ProfileError, match=r"measured on NVIDIA H100 80GB HBM3 \(H100-80GB\), not on A100-40GB"):
        _resolve("A100-40GB", profile=str(path))
    with pytest.raises(ProfileError, match="describes a GPU, not cpu: pass --device H100-80GB"):
        _resolve("cpu", profile=str(path))
    with pytest.raises(ProfileError, match="LAZY module loading; --cuda-loading eager contradicts it"):
        _resolve("H100-80GB", profile=str(path), cuda_loading="eager")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "is not valid JSON (line 1"),
        ('{"schema": "other/2"}', "is not a batchfit device profile (schema 'other/2'"),
        ("[1, 2]", "schema 'list'"),
        ('{"schema": "batchfit-device-profile/1", "gpu": {}}', "damaged device profile (field 'name' is missing)"),
    ],
)
def test_a_corrupt_profile_is_one_clear_error(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        profiles.load(path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_damaged_values_are_refused(profile, tmp_path: Path) -> None:
    data = profile.to_json()
    for key, value in (("context_bytes", -1), ("total_bytes", 0), ("cublas_handles", "two"), ("context_bytes", 1.5)):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({**data, key: value}))
        with pytest.raises(ProfileError, match="damaged device profile"):
            profiles.load(path)
    path.write_text(json.dumps({**data, "context_bytes": H100_TOTAL}))
    with pytest.raises(ProfileError, match="the profile is damaged"):
        _resolve("H100-80GB", profile=str(path))
    with pytest.raises(ProfileError, match="no device profile at"):
        profiles.load(tmp_path / "missing.json")


def test_an_unreadable_stored_profile_is_skipped_with_a_note(cache) -> None:
    path = profiles.default_path(H100, cache)
    path.parent.mkdir(parents=True)
    path.write_text("{")
    dev, notes = _resolve("H100-80GB", local=H100, environ=cache)
    assert dev.context_source == "default" and notes[0].startswith("ignored a stored device profile:")


# -- the context without a profile ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("environ", "cuda", "expected"),
    [
        ({}, None, ("lazy", "")),
        ({}, "12.8", ("lazy", "")),
        ({}, "11.6", ("eager", "CUDA 11.6 predates lazy module loading (11.7)")),
        ({}, "11.7", ("lazy", "")),
        ({"CUDA_MODULE_LOADING": "eager"}, "12.8", ("eager", "CUDA_MODULE_LOADING=EAGER")),
        ({"CUDA_MODULE_LOADING": "LAZY"}, "11.2", ("lazy", "CUDA_MODULE_LOADING=LAZY")),
    ],
)
def test_module_loading_is_detected(environ: dict, cuda: str | None, expected: tuple) -> None:
    assert detect_module_loading(environ, cuda) == expected


def test_the_context_choice() -> None:
    dev, notes = _resolve("V100-16GB")
    assert (dev.context_source, dev.context_bytes, notes) == ("default", 320 * MiB, ())
    assert dev.describe_context() == "320.00 MiB: default, lazy module loading (CUDA >= 11.7), Volta estimate"
    dev, notes = _resolve("V100-16GB", environ={"CUDA_MODULE_LOADING": "EAGER"})
    assert (dev.context_source, dev.context_bytes, dev.context_detail) == ("eager", 1341 * MiB,
                                                                           "CUDA_MODULE_LOADING=EAGER")  # fmt: skip
    assert notes == ("CUDA_MODULE_LOADING=EAGER: assuming eager module loading, a CUDA context of 1.31 GiB",)
    assert dev.describe_context() == (
        "1.31 GiB: eager module loading (CUDA_MODULE_LOADING=EAGER), Hugging Face's V100 / CUDA 11.2 figure"
    )
    old = resolve_device("V100-16GB", environ={}, cuda_version="11.2", local=lambda: None, cudnn_benchmark=False)
    assert old.device.context_source == "eager" and "CUDA 11.2 predates" in old.notes[0]
    dev, notes = _resolve("V100-16GB", cuda_loading="eager")
    assert (dev.context_source, dev.context_detail, notes) == ("eager", "--cuda-loading eager", ())
    dev, _ = _resolve("V100-16GB", cuda_loading="lazy", environ={"CUDA_MODULE_LOADING": "EAGER"})
    assert dev.context_source == "default"  # asked for beats detected
    dev, _ = _resolve("V100-16GB", cuda_loading="eager", context_mib=500)
    assert (dev.context_source, dev.context_bytes) == ("override", 500 * MiB)
    assert _resolve("cpu", environ={"CUDA_MODULE_LOADING": "EAGER"})[0] == get_device("cpu")


def test_bad_context_choices_are_one_line() -> None:
    with pytest.raises(ConfigError, match="--cuda-loading takes lazy or eager"):
        _resolve("V100-16GB", cuda_loading="fast")
    with pytest.raises(ConfigError, match="applies to GPUs only"):
        _resolve("cpu", cuda_loading="eager")
    with pytest.raises(ConfigError, match="leaves nothing"):
        _resolve("1GiB", cuda_loading="eager")


# -- the command line ---------------------------------------------------------------------------------------
def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(code: int, out: str, err: str, fragment: str) -> None:
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchfit: error:") and fragment in lines[0], err


def test_calibrate_without_a_gpu_says_so_in_one_line(capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as here, even where tests run on a GPU
    _one_line(*_run(capsys, "calibrate"), "no CUDA GPU is visible here")


def test_calibrate_writes_a_profile_that_estimate_then_uses(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("batchfit.runtime.calibrate.TorchGpu", FakeGpu)
    code, out, err = _run(capsys, "calibrate", "--json")
    assert code == 0, err
    written = json.loads(out)
    path = tmp_path / "profiles" / f"{H100.key()}.json"
    assert written["path"] == str(path) and written["profile"]["context_bytes"] == CONTEXT
    code, out, err = _run(capsys, "calibrate", "--output", str(tmp_path / "mine.json"))
    assert code == 0 and "device profile: NVIDIA H100 80GB HBM3" in out and "measuring" in err
    assert profiles.load(tmp_path / "mine.json").context_bytes == CONTEXT
    # Used automatically on the machine it describes, and said so on stderr.
    monkeypatch.setattr("batchfit.gpu.context._local_identity", lambda: H100)
    code, out, err = _run(capsys, "estimate", "mlp", "-b", "8", "--device", "H100-80GB", "--json")
    est = json.loads(out)
    assert code == 0 and (est["context_source"], est["context_bytes"]) == ("profile", CONTEXT)
    assert err == f"batchfit: using the device profile {path} ({H100.describe()})\n"
    code, out, _ = _run(capsys, "estimate", "mlp", "-b", "8", "--device", "H100-80GB")
    assert "CUDA context (profile)" in out and "measured by batchfit calibrate" in out


def test_estimate_fit_and_plan_take_a_profile(capsys, profile, tmp_path: Path) -> None:
    path = str(profiles.save(profile, tmp_path / "h100.json"))
    code, out, err = _run(capsys, "estimate", "mlp", "-b", "8", "-d", "H100-80GB", "--profile", path, "--json")
    assert code == 0 and json.loads(out)["context_bytes"] == CONTEXT and err == ""
    code, out, _ = _run(capsys, "fit", "mlp", "-d", "H100-80GB", "--profile", path, "--json")
    assert code == 0 and json.loads(out)["estimate"]["context_source"] == "profile"
    code, out, _ = _run(capsys, "plan", "mlp", "-g", "64", "-d", "H100-80GB", "--profile", path, "--json")
    assert code == 0 and json.loads(out)["estimate"]["context_bytes"] == CONTEXT
    code, out, _ = _run(capsys, "estimate", "mlp", "-b", "8", "-d", "T4", "--cuda-loading", "eager", "--json")
    assert code == 0 and (json.loads(out)["context_source"], json.loads(out)["context_bytes"]) == ("eager", 1341 * MiB)
    code, out, _ = _run(capsys, "estimate", "mlp", "-b", "8", "-d", "T4", "--cudnn-benchmark", "--json")
    assert code == 0 and json.loads(out)["context_source"] == "default"


def test_bad_profiles_on_the_command_line_are_one_line(capsys, profile, tmp_path: Path) -> None:
    path = str(profiles.save(profile, tmp_path / "h100.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    _one_line(*_run(capsys, "estimate", "mlp", "-b", "8", "-d", "A100-40GB", "--profile", path), "not on A100-40GB")
    _one_line(*_run(capsys, "estimate", "mlp", "-b", "8", "--profile", path), "describes a GPU, not cpu")
    _one_line(*_run(capsys, "fit", "mlp", "-d", "H100-80GB", "--profile", str(bad)), "is not valid JSON")
    _one_line(*_run(capsys, "plan", "mlp", "-g", "8", "-d", "H100-80GB", "--profile", str(tmp_path / "no.json")),
              "no device profile at")  # fmt: skip
    _one_line(*_run(capsys, "estimate", "mlp", "-b", "8", "-d", "T4", "--cuda-loading", "fast"), "cuda-loading")
