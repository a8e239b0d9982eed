"""The estimator through its public API: what each category holds, on models small enough to count by hand."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import batchfit
from batchfit import ConfigError, Workload, presets


class Frozen(nn.Module):
    """A frozen base and a small trainable head: LoRA-style fine-tuning."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x)))


def _frozen_workload(optimizer=lambda ps: torch.optim.AdamW(ps)) -> Workload:
    return Workload(
        model=Frozen,
        batch=lambda b: (torch.randn(b, 64), torch.randint(0, 8, (b,))),
        loss=lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
        optimizer=optimizer,
        name="frozen",
    )


def test_frozen_parameters_get_no_gradients_or_optimizer_state() -> None:
    est = batchfit.estimate(_frozen_workload(), 1, device="cpu")
    assert est.peak_phase == "optimizer"
    head_bytes = (64 * 8 + 8) * 4
    all_bytes = head_bytes + (64 * 64 + 64) * 4
    assert est.breakdown["parameters"] == all_bytes
    # AdamW keeps exp_avg and exp_avg_sq per trainable tensor, plus a float32 step counter each.
    assert est.breakdown["optimizer_states"] == 2 * head_bytes + 2 * 4
    assert est.breakdown["gradients"] == head_bytes


def test_sgd_without_momentum_keeps_no_state() -> None:
    est = batchfit.estimate(_frozen_workload(lambda ps: torch.optim.SGD(ps, lr=0.1)), 4, device="cpu")
    assert est.breakdown["optimizer_states"] == 0


@pytest.mark.parametrize("device", ["cpu", "A100-40GB"])
def test_breakdown_and_modules_sum_to_the_peak(device: str) -> None:
    wl = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
    est = batchfit.estimate(wl, 4, device=device)
    assert sum(est.breakdown.values()) == est.peak_allocated_bytes
    assert sum(est.per_module.values()) == est.peak_allocated_bytes
    assert set(est.breakdown) == {
        "parameters",
        "gradients",
        "optimizer_states",
        "activations",
        "batch_data",
        "temporaries",
    }


def test_tied_weights_are_counted_once() -> None:
    wl = presets.get("gpt", n_layer=1, n_embd=32, n_head=2, vocab_size=128, seq_len=16)
    model = wl.build_model()
    distinct = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    est = batchfit.estimate(wl, 2, device="cpu")
    assert est.breakdown["parameters"] == sum(distinct.values()) + buffers


def test_cuda_device_counts_rounded_blocks_reserved_segments_and_context() -> None:
    wl = presets.get("mlp")
    est = batchfit.estimate(wl, 16, device="A100-40GB")
    dev = batchfit.get_device("A100-40GB")
    assert est.peak_allocated_bytes % 512 == 0
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes
    assert est.peak_reserved_bytes % (2 * 2**20) == 0  # every segment is a multiple of 2 MiB
    assert est.device_total_bytes == est.peak_reserved_bytes + dev.context_bytes
    assert est.workspace_bytes == 2 * dev.cublas_workspace_bytes
    assert est.fits and est.headroom_bytes == dev.total_bytes - est.device_total_bytes


def test_activations_grow_linearly_and_parameters_do_not() -> None:
    wl = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
    a, b, c = (batchfit.estimate(wl, n, device="cpu") for n in (8, 16, 24))
    assert a.peak_phase == b.peak_phase == c.peak_phase == "backward"
    assert a.breakdown["parameters"] == b.breakdown["parameters"] == c.breakdown["parameters"]
    # Affine, not proportional: the position ids (arange(T), int64) are saved whatever the batch.
    step = b.breakdown["activations"] - a.breakdown["activations"]
    assert c.breakdown["activations"] - b.breakdown["activations"] == step
    assert a.breakdown["activations"] - step == 32 * 8


def test_a_module_instance_estimates_like_its_factory() -> None:
    wl = presets.get("mlp")
    from dataclasses import replace

    torch.manual_seed(0)
    instance = replace(wl, model=wl.build_model())
    assert batchfit.estimate(instance, 8, device="cpu") == batchfit.estimate(wl, 8, device="cpu")


def test_bf16_true_halves_parameters_and_states() -> None:
    wl = presets.get("mlp")
    fp32 = batchfit.estimate(wl, 2, device="A100-40GB", precision="fp32")
    bf16 = batchfit.estimate(wl, 2, device="A100-40GB", precision="bf16-true")
    raw = sum(p.numel() for p in wl.build_model().parameters())
    assert fp32.analytic["parameters"] == 4 * raw
    assert bf16.analytic["parameters"] == 2 * raw


def test_checkpointing_a_user_block_class_lowers_activations() -> None:
    from batchfit.models.gpt import Block

    wl = presets.get("gpt", n_layer=4, n_embd=64, n_head=2, vocab_size=64, seq_len=64)
    plain = batchfit.estimate(wl, 8, device="cpu")
    ckpt = batchfit.estimate(wl, 8, device="cpu", checkpointing=[Block])
    assert ckpt.checkpointing
    assert ckpt.breakdown["activations"] < plain.breakdown["activations"] / 2


def test_expandable_segments_never_reserve_more_here() -> None:
    wl = presets.get("gpt", n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32)
    classic = batchfit.estimate(wl, 8, device="A100-40GB")
    expandable = batchfit.estimate(wl, 8, device="A100-40GB", expandable_segments=True)
    assert expandable.peak_allocated_bytes == classic.peak_allocated_bytes
    assert expandable.peak_reserved_bytes <= classic.peak_reserved_bytes


def test_estimate_to_dict_is_json() -> None:
    est = batchfit.estimate("mlp", 2, device="T4")
    d = json.loads(json.dumps(est.to_dict()))
    assert d["peak_allocated_bytes"] == est.peak_allocated_bytes
    assert d["fits"] is True


@pytest.mark.parametrize(
    ("loss", "fragment"),
    [
        (lambda m, b: m(b[0]), "shape"),
        (lambda m, b: "nope", "str"),
        (lambda m, b: (m(b[0]).sum(), 2.5), "n_items"),
    ],
)
def test_a_loss_of_the_wrong_form_is_one_clear_error(loss, fragment: str) -> None:
    wl = Workload(model=lambda: nn.Linear(4, 2), batch=lambda b: (torch.randn(b, 4),), loss=loss)
    with pytest.raises(ConfigError) as info:
        batchfit.estimate(wl, 2, device="cpu")
    assert fragment in str(info.value) and "\n" not in str(info.value)


class _SparseTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(64, 8, sparse=True)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).mean(1))


@pytest.mark.parametrize("device", ["cpu", "A100-80GB"])
def test_sparse_gradients_are_one_error_naming_the_dense_upper_bound(device: str) -> None:
    """A sparse gradient's size is its ids' distinct count, a value fake tensors do not have: one line
    naming the fix, not a claim that the step would fail on a GPU (it would not)."""
    wl = Workload(
        model=_SparseTables,
        batch=lambda b: (torch.randint(0, 64, (b, 5)), torch.randint(0, 2, (b,))),
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    with pytest.raises(batchfit.TraceError) as info:
        batchfit.estimate(wl, 2, device=device)
    assert "sparse=False" in str(info.value) and "\n" not in str(info.value)
    assert info.value.__cause__ is not info.value  # not its own cause: a walk down the chain ends


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_batch_size(bad) -> None:
    with pytest.raises(ConfigError, match="batch size"):
        batchfit.estimate("mlp", bad)


def test_bf16_on_a_gpu_without_it_names_fp16() -> None:
    with pytest.raises(ConfigError, match="fp16"):
        batchfit.estimate("mlp", 2, device="V100-16GB", precision="bf16")


@pytest.mark.parametrize("name", ["NAdam", "RAdam", "AdamW", "Adamax", "ASGD", "Rprop", "Adagrad"])
def test_every_torch_optimizer_steps_on_a_gpu_with_its_step_counters_known(name: str) -> None:
    """A GPU runs the multi-tensor (foreach) kernels, which bump the step counters in place and return
    nothing: their values stay known (NAdam divides by ``1 - mu_product``; read as 1, it raised)."""
    wl = _frozen_workload(optimizer=lambda ps: getattr(torch.optim, name)(ps, lr=1e-3))
    est = batchfit.estimate(wl, 4, device="A100-80GB")
    assert not [n for n in est.notes if "assumed" in n], est.notes


def test_a_capturable_optimizer_is_estimated_for_a_gpu_as_without_it_and_said_so() -> None:
    """``capturable=True`` keeps step counters on the GPU (for CUDA graphs); fake CPU tensors refuse it."""
    plain = batchfit.estimate(_frozen_workload(), 4, device="A100-80GB")
    wl = _frozen_workload(optimizer=lambda ps: torch.optim.AdamW(ps, capturable=True))
    est = batchfit.estimate(wl, 4, device="A100-80GB")
    assert est.device_total_bytes == plain.device_total_bytes
    assert est.breakdown == plain.breakdown
    assert any("capturable=True" in n for n in est.notes)
    planned = batchfit.plan(wl, 8, device="A100-80GB", gpus=2)
    without = batchfit.plan(_frozen_workload(), 8, device="A100-80GB", gpus=2)
    assert planned.estimate.device_total_bytes == without.estimate.device_total_bytes
    assert planned.micro_batch_size == without.micro_batch_size


def test_an_optimizer_that_needs_a_closure_is_one_error_saying_so() -> None:
    wl = _frozen_workload(optimizer=lambda ps: torch.optim.LBFGS(ps))
    with pytest.raises(batchfit.TraceError, match="needs a closure .*history_size") as info:
        batchfit.estimate(wl, 2, device="A100-80GB")
    assert "would fail on a real device" not in str(info.value) and "\n" not in str(info.value)


class _FrozenEncoder(nn.Module):
    """A frozen text encoder kept in eval mode and run under no_grad, with a padding mask: torch's
    inference fast path would pack the batch into a nested tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32, padding_idx=0)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2,
                                         enable_nested_tensor=True)  # fmt: skip
        self.enc.requires_grad_(False)
        self.head = nn.Linear(32, 5)

    def train(self, mode: bool = True) -> _FrozenEncoder:
        super().train(mode)
        self.enc.eval()
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.enc(self.embed(ids), src_key_padding_mask=ids == 0)
        return self.head(h.mean(1))


def test_a_frozen_encoders_inference_fast_path_is_estimated_as_its_padded_path() -> None:
    from batchfit.memory.measure import measure_cpu_peak

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 64, (b, 12))
        ids[:, 8:] = 0  # padding
        return ids, torch.randint(0, 5, (b,))

    wl = Workload(model=_FrozenEncoder, batch=batch, loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    gpu = batchfit.estimate(wl, 4, device="A100-80GB")  # a nested tensor fake tensors cannot make: refused before
    assert gpu.device_total_bytes > gpu.context_bytes
    assert batchfit.estimate(wl, 4, device="cpu").peak_allocated_bytes >= measure_cpu_peak(wl, 4)  # an upper bound


_LAZY_MODULE = '''
import functools
import torch


@functools.lru_cache
def table(n):
    return torch.arange(n, dtype=torch.float32)
'''


class LazyTable(nn.Module):
    """Imports its helper module in the first forward, as transformers imports its submodules lazily, and
    caches a tensor there per size."""

    def __init__(self, module: str) -> None:
        super().__init__()
        self.module, self.fc = module, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import importlib

        return self.fc(x) + importlib.import_module(self.module).table(16)


def test_a_cache_of_a_module_the_trace_imports_is_left_empty(tmp_path, monkeypatch) -> None:
    """The trace's fake tensors never stay in a cache, even in a module first imported during the trace: the
    next real step computes its own (a fake one would fail it)."""
    import sys

    (tmp_path / "lazy_table_mod.py").write_text(_LAZY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_table_mod", raising=False)
    wl = Workload(model=lambda: LazyTable("lazy_table_mod"), batch=lambda b: torch.randn(b, 16),
                  loss=lambda m, x: m(x).sum())  # fmt: skip
    batchfit.estimate(wl, 2, device="A100-40GB")
    assert "lazy_table_mod" in sys.modules  # imported by the trace
    assert sys.modules["lazy_table_mod"].table.cache_info().currsize == 0
    model = LazyTable("lazy_table_mod")
    model(torch.randn(2, 16)).sum().backward()  # a real step, with a real table
    assert type(sys.modules["lazy_table_mod"].table(16)) is torch.Tensor


def test_the_caches_watched_are_those_of_packages_that_can_hold_a_tensor(tmp_path, monkeypatch) -> None:
    """A cache can hand a model a fake tensor only in a package that works with torch (binds it, or defines
    a layer); a package torch never reaches (sympy's, numpy's) is not read."""
    import importlib
    import sys

    from batchfit.memory.trace import compat

    cache = "import functools\n\n@functools.lru_cache\ndef table(n):\n    return n\n"
    layer = "from torch import nn\n\nclass Layer(nn.Module):\n    pass\n"
    sources = {"plain_cached_pkg": "", "torch_cached_pkg": "import torch\n", "layer_cached_pkg": layer}
    for package, head in sources.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "helpers.py").write_text(head + cache)
        monkeypatch.delitem(sys.modules, package, raising=False)
        monkeypatch.delitem(sys.modules, f"{package}.helpers", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    tables = {p: importlib.import_module(f"{p}.helpers").table for p in ("plain_cached_pkg", "torch_cached_pkg",
                                                                           "layer_cached_pkg")}  # fmt: skip
    every, of_layers = compat._lru_wrappers()
    assert [p for p, t in tables.items() if any(w is t for w in every)] == ["torch_cached_pkg", "layer_cached_pkg"]
    assert [p for p, t in tables.items() if any(w is t for w in of_layers)] == ["layer_cached_pkg"]
