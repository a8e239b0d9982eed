"""The trace cache: a repeated trace is reused, and anything that changes the step changes the key."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchfit
import batchfit._version
from batchfit import presets
from batchfit.memory.cache import CACHE, cache_dir
from batchfit.models.gpt import token_batch

TINY = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=16)


@pytest.fixture(autouse=True)
def _a_cache_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test here counts what is traced and read back: it starts from an empty disk cache, whatever
    other tests (in any worker) traced into the run's."""
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path / "trace-cache"))


def _estimate(wl: batchfit.Workload, b: int = 4) -> batchfit.Estimate:
    return batchfit.estimate(wl, b, device="A100-40GB")


def _misses(fn) -> int:  # noqa: ANN001
    before = CACHE.misses
    fn()
    return CACHE.misses - before


def test_a_repeated_estimate_is_read_back_from_memory_and_from_disk() -> None:
    wl = presets.get("gpt", **TINY)
    first = _estimate(wl)
    hits = CACHE.hits
    assert _estimate(wl) == first and CACHE.hits == hits + 1
    CACHE.clear_memory()  # as a new process would: from disk
    assert _estimate(presets.get("gpt", **TINY)) == first and CACHE.hits == hits + 2
    assert any(cache_dir().rglob("*.pickle"))


def test_model_optimizer_batch_and_batch_size_changes_are_new_traces() -> None:
    wl = presets.get("gpt", **TINY)
    _estimate(wl)
    assert _misses(lambda: _estimate(wl)) == 0
    assert _misses(lambda: _estimate(presets.get("gpt", **{**TINY, "n_embd": 64}))) == 1
    assert _misses(lambda: _estimate(presets.get("gpt", **TINY, optimizer="sgd"))) == 1
    shorter = functools.partial(token_batch, seq_len=8, vocab_size=TINY["vocab_size"])
    assert _misses(lambda: _estimate(dataclasses.replace(wl, batch=shorter))) == 1
    assert _misses(lambda: _estimate(wl, 5)) == 1
    assert _misses(lambda: batchfit.estimate(wl, 4, device="A100-40GB", precision="bf16")) == 1
    assert _misses(lambda: batchfit.estimate(wl, 4, device="H100-80GB")) == 1  # another cuBLAS workspace
    assert _misses(lambda: batchfit.estimate(wl, 4, device="A100-80GB")) == 0  # only the capacity differs


def test_cudnn_settings_are_part_of_a_trace_and_of_a_fit() -> None:
    wl = presets.get("cnn", image_size=16, width=8, stages=2)
    heuristic = _estimate(wl)
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):  # faster engines, larger workspaces
        assert _misses(lambda: _estimate(wl)) == 1
        benchmarked = _estimate(wl)
    assert benchmarked.cudnn_workspace_bytes > heuristic.cudnn_workspace_bytes > 0
    marked = dataclasses.replace(batchfit.get_device("A100-40GB"), cudnn_benchmark=True)  # --cudnn-benchmark
    assert batchfit.estimate(wl, 4, device=marked).cudnn_workspace_bytes == benchmarked.cudnn_workspace_bytes
    assert _misses(lambda: _estimate(wl)) == 0
    fit = batchfit.fit(wl, "A100-40GB", max_batch_size=64)
    with torch.backends.cudnn.flags(enabled=False):
        assert batchfit.fit(wl, "A100-40GB", max_batch_size=64).estimate.cudnn_workspace_bytes == 0
    assert fit.estimate.cudnn_workspace_bytes > 0


def test_a_changed_model_class_is_a_new_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = (
        "import torch\nfrom torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n        return self.a(x){extra}\n"
    )
    (tmp_path / "zoo_net.py").write_text(source.format(extra=""))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("zoo_net")

    def workload() -> batchfit.Workload:
        return batchfit.Workload(model=lambda: module.Net(), batch=lambda b: torch.randn(b, 8),
                                 loss=lambda m, x: m(x).square().mean())  # fmt: skip

    plain = _estimate(workload())
    (tmp_path / "zoo_net.py").write_text(source.format(extra=".relu().exp()"))
    module = importlib.reload(module)
    assert _misses(lambda: _estimate(workload())) == 1
    assert _estimate(workload()).peak_allocated_bytes >= plain.peak_allocated_bytes
    sys.modules.pop("zoo_net", None)


def test_a_new_batchfit_version_never_reuses_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    wl = presets.get("gpt", **TINY)
    _estimate(wl)
    monkeypatch.setattr(batchfit._version, "__version__", "99.0")
    CACHE.clear_memory()
    assert _misses(lambda: _estimate(wl)) == 1


def test_an_edit_anywhere_in_batchfit_never_reuses_a_trace() -> None:
    """The source digest covers every module (the tracer and the estimator, not only the cache's own)."""
    from batchfit.memory.cache.keys import own_files

    root = Path(batchfit.__file__).resolve().parent
    names = {str(p.relative_to(root)) for p in own_files()}
    assert {"memory/trace/tracer.py", "memory/estimate.py", "memory/cache/keys.py", "workload.py"} <= names
    assert names == {str(p.relative_to(root)) for p in root.rglob("*.py")}


def test_a_corrupt_cache_file_is_ignored_with_a_note() -> None:
    wl = presets.get("gpt", **TINY)
    first = _estimate(wl, 3)
    CACHE.clear_memory()
    files = sorted(cache_dir().rglob("*.pickle"), key=lambda p: p.stat().st_mtime)
    files[-1].write_bytes(b"not a pickle")
    again = _estimate(wl, 3)
    assert again.peak_allocated_bytes == first.peak_allocated_bytes
    assert any("unreadable trace cache entry" in n for n in again.notes)


def test_an_indescribable_workload_is_traced_every_time() -> None:
    class Holder:  # an arbitrary object in the loss's closure: no stable description
        scale = 2.0

    holder = Holder()
    wl = batchfit.Workload(model=lambda: nn.Linear(8, 2), batch=lambda b: (torch.randn(b, 8), torch.zeros(b).long()),
                           loss=lambda m, batch: F.cross_entropy(m(batch[0]) * holder.scale, batch[1]))  # fmt: skip
    assert _misses(lambda: _estimate(wl)) == 0  # no key: not even counted as a miss
    assert _estimate(wl) == _estimate(wl)


def test_the_disk_cache_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHFIT_CACHE", "0")
    assert cache_dir() is None
    monkeypatch.delenv("BATCHFIT_CACHE")
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path / "elsewhere"))
    _estimate(presets.get("gpt", **TINY), 2)
    assert any((tmp_path / "elsewhere").rglob("*.pickle"))


def test_a_repeated_plan_traces_nothing_and_replays_no_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchfit.memory import estimate

    replays = []
    real_replay = estimate.replay
    monkeypatch.setattr(estimate, "replay", lambda *a, **k: replays.append(1) or real_replay(*a, **k))
    wl = presets.get("gpt", **TINY)
    # 100 items on a GPU that fits 63: two micro-batches of 50, whose estimate is not the fit's (63)
    first = batchfit.plan(wl, 100, device="410MiB")
    assert (first.max_micro_batch_size, first.micro_batch_size, first.accumulation_steps) == (63, 50, 2)
    assert replays
    replays.clear()
    CACHE.clear_memory()  # as a new process would: from disk
    assert _misses(lambda: batchfit.plan(wl, 100, device="410MiB")) == 0
    assert replays == []
    assert batchfit.plan(wl, 100, device="410MiB").to_dict() == first.to_dict()


WIDTH = 16
"""A module-level value a workload's factory reads (set from argv, an environment variable or a notebook)."""


def test_a_changed_module_level_value_the_factory_reads_is_a_new_trace() -> None:
    global WIDTH
    wl = batchfit.Workload(model=lambda: nn.Sequential(nn.Linear(8, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 2)),
                           batch=lambda b: (torch.randn(b, 8), torch.zeros(b).long()),
                           loss=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]))  # fmt: skip
    saved = WIDTH
    try:
        narrow = _estimate(wl)
        WIDTH = 4096
        assert _misses(lambda: _estimate(wl)) == 1
        wide = _estimate(wl)
        with batchfit.memory.cache.no_cache():
            assert wide == _estimate(wl)
        assert wide.breakdown["parameters"] > narrow.breakdown["parameters"]
        WIDTH = saved
        assert _misses(lambda: _estimate(wl)) == 0  # the same value again: the same key
    finally:
        WIDTH = saved


LOOKUP = torch.arange(4)
"""A module-level tensor: its values have no stable description."""


def test_a_module_level_tensor_the_batch_function_reads_makes_the_workload_uncacheable() -> None:
    wl = batchfit.Workload(model=lambda: nn.Linear(4, 2),
                           batch=lambda b: (LOOKUP.float().expand(b, 4), torch.zeros(b).long()),
                           loss=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]))  # fmt: skip
    assert _misses(lambda: _estimate(wl)) == 0  # no key: traced every time, never a stale answer


SIZES = {"hidden": 16}
"""A module-level dict the factory reads, changed in place."""


def test_a_module_level_dict_changed_in_place_is_a_new_trace() -> None:
    wl = batchfit.Workload(model=lambda: nn.Sequential(nn.Linear(8, SIZES["hidden"]), nn.Linear(SIZES["hidden"], 2)),
                           batch=lambda b: (torch.randn(b, 8), torch.zeros(b).long()),
                           loss=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]))  # fmt: skip
    try:
        narrow = _estimate(wl)
        SIZES["hidden"] = 1024
        assert _misses(lambda: _estimate(wl)) == 1
        assert _estimate(wl).breakdown["parameters"] > narrow.breakdown["parameters"]
    finally:
        SIZES["hidden"] = 16


def test_the_source_digest_covers_the_whole_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed estimator (any module of the package, not only the cache's) is a new key."""
    from pathlib import Path

    from batchfit.memory.cache.keys import _own_source

    before = _own_source.__wrapped__()
    read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: read(p) + (b"#" if p.name == "tracer.py" else b""))
    assert _own_source.__wrapped__() != before
