"""Optimizers by name (``--optimizer``, ``optimizer=``): the real classes they build, their states to the byte,
paged states as unified memory on a GPU, and CPU estimates equal to the allocator's peak.

The network has a weight of 8192 values (8-bit states in bitsandbytes and torchao), tensors under 4096
values (fp32 states in both) and, for the paged cases, a weight of 131072 values (bitsandbytes pages
state buffers of 1e5 values and more on a GPU).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import batchfit
from batchfit import presets
from batchfit.cli import main
from batchfit.errors import ConfigError, MissingExtraError
from batchfit.memory.allocator.caching import round_size
from batchfit.memory.measure import measure_cpu_peak
from batchfit.memory.states import state_bytes
from batchfit.sources import load
from batchfit.sources.optim import NamedOptimizer, names, optimizer_factory, spec
from batchfit.third_party import quiet_third_party

pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")
pytest.importorskip("transformers")

ALIASES = {"lion": "lion_32bit", "adamw_bnb_8bit": "adamw_8bit"}
DISTINCT = [n for n in names() if n not in ALIASES]
BIG = 131072  # values of the paged weight: 512 x 256
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: exact CPU steps, quicker on a busy machine


def _small() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))  # 8192, 128, 1280, 10 values


def _big() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))  # 131072 (paged on a GPU), ...


def _batch(b: int, features: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, features), torch.randint(0, 10, (b,))


def _workload(optimizer: object, model: object = _small, features: int = 64) -> batchfit.Workload:
    return batchfit.Workload(
        model=model,
        batch=lambda b: _batch(b, features),
        loss=lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
        optimizer=optimizer,  # type: ignore[arg-type]
    )


def _stepped(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The real optimizer ``name`` builds, after one real step on zero gradients."""
    torch.manual_seed(0)
    model = _small()
    optimizer = optimizer_factory(name)(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with quiet_third_party():  # torchao's compile warns about its subclasses' cache hashes
        optimizer.step()
    return model, optimizer


def _flat(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor, or the tensors a torchao state subclass is made of."""
    return [getattr(t, a) for a in t.tensor_attrs] if hasattr(t, "tensor_attrs") else [t]


def _storages(tensors: object) -> dict[int, int]:
    flat = [c for t in tensors for c in _flat(t)]  # type: ignore[union-attr]
    return {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in flat}


@pytest.mark.parametrize("name", DISTINCT)
def test_cpu_estimates_are_the_allocator_peak(name: str) -> None:
    """The real class runs on the CPU (a paged one as its non-paged self); the trace of it is exact."""
    wl = _workload(optimizer_factory(name))
    for b in (2, 48):
        est = batchfit.estimate(wl, b, device="cpu")
        assert est.peak_allocated_bytes == measure_cpu_peak(wl, b), (name, b)
        assert est.paged_optimizer_bytes == 0


@pytest.mark.parametrize("name", DISTINCT)
def test_states_per_tensor_are_the_real_optimizers_to_the_byte(name: str) -> None:
    """Each parameter's own state storages (a step count and tables shared by all aside) equal the name's
    closed form, and the traced optimizer (the stand-in, for torchao) holds the real one's bytes."""
    model, optimizer = _stepped(name)
    tables = _storages(t for v in vars(optimizer).values() if isinstance(v, dict)
                       for t in v.values() if isinstance(t, torch.Tensor))  # bitsandbytes' name2qmap  # fmt: skip
    for p in model.parameters():
        mine = _storages(v for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor) and k != "step")
        own = sum(n for ptr, n in mine.items() if ptr not in tables)
        rows = p.shape[0] if p.dim() else None
        assert own == spec(name).states(p.numel(), rows, p.element_size()), (name, tuple(p.shape))
    held = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    traced = state_bytes(_workload(optimizer_factory(name)), None).optimizer_states
    assert traced == sum(_storages(held).values())


def test_the_names_build_the_classes_they_stand_for() -> None:
    import bitsandbytes as bnb
    import torchao.optim
    from transformers.optimization import Adafactor

    params = list(_small().parameters())
    built = {name: optimizer_factory(name)(params) for name in names()}
    assert type(built["adamw"]) is torch.optim.AdamW and built["adamw"].defaults["weight_decay"] == 0.01
    assert type(built["sgd"]) is torch.optim.SGD and built["sgd"].defaults["momentum"] == 0.9
    assert built["adamw_torch_fused"].defaults["fused"] is True
    bnb_names = [("adamw_8bit", bnb.optim.AdamW, 8, False), ("adamw_bnb_8bit", bnb.optim.AdamW, 8, False),
                 ("paged_adamw_8bit", bnb.optim.AdamW, 8, True), ("paged_adamw_32bit", bnb.optim.AdamW, 32, True),
                 ("lion", bnb.optim.Lion, 32, False), ("lion_32bit", bnb.optim.Lion, 32, False),
                 ("lion_8bit", bnb.optim.Lion, 8, False), ("paged_lion_8bit", bnb.optim.Lion, 8, True),
                 ("paged_lion_32bit", bnb.optim.Lion, 32, True)]  # fmt: skip
    for name, cls, bits, paged in bnb_names:
        assert type(built[name]) is cls and (built[name].args.optim_bits, built[name].is_paged) == (bits, paged)
    assert type(built["adafactor"]) is Adafactor
    assert not built["adafactor"].defaults["relative_step"] and not built["adafactor"].defaults["scale_parameter"]
    assert type(built["adamw_torch_8bit"]) is torchao.optim.AdamW8bit and built["adamw_torch_8bit"].block_size == 256
    assert type(built["adamw_torch_4bit"]) is torchao.optim.AdamW4bit and built["adamw_torch_4bit"].block_size == 256
    assert optimizer_factory("lion", lr=0.5)(params).defaults["lr"] == 0.5
    from batchfit.advice.lr import resolve_rule

    assert resolve_rule("auto", presets.get("mlp", optimizer="paged_adamw_8bit").optimizer) == "sqrt"
    assert resolve_rule("auto", optimizer_factory("lion_8bit")) == "linear"


def test_presets_hub_models_and_files_take_the_names(tmp_path: object) -> None:
    wl = presets.get("mlp", optimizer="paged_adamw_8bit")
    assert wl.optimizer == NamedOptimizer("paged_adamw_8bit", 1e-3) and wl.config["optimizer"] == "paged_adamw_8bit"
    assert load("mlp", optimizer="adafactor", lr=0.01).optimizer == NamedOptimizer("adafactor", 0.01)
    import transformers

    d = tmp_path / "tiny-llama"  # type: ignore[operator]
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             vocab_size=128, architectures=["LlamaForCausalLM"]).save_pretrained(d)  # fmt: skip
    hub = load(str(d), optimizer="lion_8bit", seq_len=8)
    assert hub.optimizer == NamedOptimizer("lion_8bit", 1e-4)
    assert batchfit.estimate(hub, 1, device="A100-40GB").analytic["optimizer"] == "lion_8bit"


def test_an_unknown_name_is_one_line_naming_the_valid_ones(capsys: pytest.CaptureFixture) -> None:
    for make in (lambda: optimizer_factory("adamw_4bit"), lambda: load("mlp", optimizer="adamw_4bit")):
        with pytest.raises(ConfigError, match=r"unknown optimizer 'adamw_4bit'; did you mean .*'adamw_torch_4bit'"):
            make()
    code = main(["estimate", "mlp", "-b", "2", "--optimizer", "lamb"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "unknown optimizer 'lamb'" in err and "paged_adamw_8bit" in err
    with pytest.raises(ConfigError, match="learning rate must be a positive number"):
        optimizer_factory("adamw", lr=-1.0)


@pytest.mark.parametrize(
    ("name", "package", "extra"),
    [("paged_adamw_8bit", "bitsandbytes", "qlora"), ("adamw_torch_4bit", "torchao", "lowbit"),
     ("adafactor", "transformers", "hf")],
)  # fmt: skip
def test_a_missing_package_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, name: str, package: str, extra: str
) -> None:
    module = spec(name).target.split(":")[0]
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like to an import
    fix = rf"optimizer '{name}' needs {package}.*pip install 'batchfit\[{extra}\]'"
    with pytest.raises(MissingExtraError, match=fix):
        presets.get("mlp", optimizer=name)


def test_paged_states_are_unified_memory_on_a_gpu_and_ordinary_on_the_cpu() -> None:
    import bitsandbytes as bnb

    cases = [  # (paged, its non-paged twin, bytes of one paged state buffer, buffers)
        ("paged_adamw_8bit", optimizer_factory("adamw_8bit"), BIG, 2),  # state1 + state2, uint8
        ("paged_adamw_32bit", lambda p: bnb.optim.AdamW(p, optim_bits=32), 4 * BIG, 2),  # fp32
        ("paged_lion_8bit", optimizer_factory("lion_8bit"), BIG, 1),  # state1 only
    ]
    for name, plain_optimizer, buffer, count in cases:
        expected = buffer * count
        paged_wl = _workload(optimizer_factory(name), _big, 512)
        plain_wl = _workload(plain_optimizer, _big, 512)
        paged, plain = (batchfit.estimate(w, 4, device="A100-40GB") for w in (paged_wl, plain_wl))
        assert paged.paged_optimizer_bytes == expected and plain.paged_optimizer_bytes == 0
        # the 1e5-value weight's state buffers left the allocator; the other tensors' stayed (under 1e5 values)
        assert paged.breakdown["optimizer_states"] == plain.breakdown["optimizer_states"] - round_size(buffer) * count
        assert paged.device_total_bytes == paged.peak_reserved_bytes + paged.context_bytes + expected
        assert paged.peak_reserved_bytes <= plain.peak_reserved_bytes
        on_cpu = batchfit.estimate(paged_wl, 4, device="cpu")
        assert on_cpu.paged_optimizer_bytes == 0
        assert on_cpu.peak_allocated_bytes == batchfit.estimate(plain_wl, 4, device="cpu").peak_allocated_bytes


def test_the_estimate_says_what_paged_means(capsys: pytest.CaptureFixture) -> None:
    tiny = ["--set", "n_layer=1", "--set", "n_embd=128", "--set", "n_head=2", "--set", "vocab_size=1024"]
    code = main(["estimate", "gpt", "-b", "1", "--seq-len", "16", "-d", "A100-40GB", "--optimizer", "paged_adamw_8bit",
                 *tiny])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "paged optimizer states (unified memory)" in out and "host RAM" in out
    code = main(["estimate", "gpt", "-b", "1", "--seq-len", "16", "-d", "A100-40GB", "--optimizer", "paged_adamw_8bit",
                 "--json", *tiny])  # fmt: skip
    out, err = capsys.readouterr()
    est = json.loads(out)
    assert est["paged_optimizer_bytes"] == 2 * 2 * 1024 * 128  # the token and position embeddings' uint8 states
    assert est["device_total_bytes"] == est["peak_reserved_bytes"] + est["context_bytes"] + est["paged_optimizer_bytes"]


def test_a_torchao_optimizer_of_ones_own_is_traced_through_its_stand_in() -> None:
    import torchao.optim

    own = _workload(lambda params: torchao.optim.AdamW4bit(params, block_size=128))
    named = _workload(optimizer_factory("adamw_torch_4bit"))  # the Trainer's block size, 256
    expected = {  # per moment: 4-bit codes (two a byte) + an fp32 scale a block + a 16-entry map; fp32 under 4096
        128: 8192 // 2 + 4 * 8192 // 128 + 64,
        256: 8192 // 2 + 4 * 8192 // 256 + 64,
    }
    small = 4 * (128 + 1280 + 10)  # the tensors that keep fp32 moments
    steps = 4 * 4  # a 0-d fp32 step per parameter
    for wl, block in ((own, 128), (named, 256)):
        assert state_bytes(wl, None).optimizer_states == 2 * (expected[block] + small) + steps


def test_analytic_counts_trainable_tensors_and_knows_the_states() -> None:
    """The closed form per trainable tensor: frozen ones get neither gradients nor states."""

    def half_frozen() -> nn.Module:
        model = _small()
        model[0].requires_grad_(False)
        return model

    trainable = [(1280, 10), (10, None)]  # (values, rows) of the head's weight and bias
    for name in ("adamw", "adamw_8bit", "adafactor", "adamw_torch_4bit"):
        est = batchfit.estimate(_workload(optimizer_factory(name), half_frozen), 2, device="A100-40GB")
        assert est.analytic["gradients"] == 4 * (1280 + 10)
        assert est.analytic["trainable_parameters_approx"] == 1290
        assert est.analytic["optimizer_states"] == sum(spec(name).states(n, rows or n, 4) for n, rows in trainable)
    assert spec("adamw_8bit").states(8192, 128, 4) == 2 * (8192 + 4 * 32)  # 2.03 B a value
    assert spec("adafactor").states(8192, 128, 4) == 4 * (128 + 64) + 4  # a row, a column and the RMS
    unknown = batchfit.estimate(_workload(lambda p: torch.optim.Adamax(p), half_frozen), 2, device="A100-40GB")
    assert unknown.analytic["optimizer_states"] == 2 * 4 * 1290  # assumed AdamW's two moments


def test_building_and_tracing_prints_nothing_of_the_libraries() -> None:
    code = (
        "import torch, batchfit\n"
        "from batchfit.sources.optim import optimizer_factory\n"
        "net = lambda: torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 4))\n"
        "for name in ('paged_adamw_8bit', 'adamw_torch_8bit', 'adafactor'):\n"
        "    make = optimizer_factory(name)\n"
        "    wl = batchfit.Workload(model=net, batch=lambda b: (torch.randn(b, 512), torch.zeros(b).long()),\n"
        "        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), optimizer=make)\n"
        "    batchfit.estimate(wl, 2, device='A100-40GB')\n"
        "model = torch.nn.Linear(64, 128, bias=False)  # a real step on the CPU\n"
        "opt = optimizer_factory('paged_adamw_8bit')(model.parameters())\n"
        "model(torch.randn(2, 64)).sum().backward()\n"
        "opt.step()\n"
        "print('done')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "BATCHFIT_CACHE": "0"})  # fmt: skip
    assert run.returncode == 0 and run.stdout == "done\n", run.stderr
    assert run.stderr == ""
