"""Models built and stepped on fake tensors, whatever their code does: constructors that move or copy
weights, compiled and lazy modules, value reads during the step, and failures that become one line."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchfit
from batchfit import Workload
from batchfit.memory.measure import measure_cpu_peak


def _classify(model: object, batch_dim: int = 16) -> Workload:
    return Workload(
        model=model,
        batch=lambda b: (torch.randn(b, batch_dim), torch.randint(0, 4, (b,))),
        loss=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    return None


def test_a_factory_that_casts_and_moves_to_cuda_estimates_as_built_on_the_target() -> None:
    def factory() -> nn.Module:
        return _mlp().to(torch.bfloat16).cuda().to("cuda:0", dtype=torch.float32)

    moved = batchfit.estimate(_classify(factory), 8, device="A100-40GB")
    plain = batchfit.estimate(_classify(_mlp), 8, device="A100-40GB")
    assert moved.breakdown == plain.breakdown


def test_deep_copies_and_tied_weights_are_counted_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = copy.deepcopy(self.a)  # a copy: its own weights
            self.c = nn.Linear(16, 16)
            self.c.weight = self.a.weight  # a tie: one weight
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.c(self.b(self.a(x))))

    est = batchfit.estimate(_classify(Tied), 8, device="cpu")
    unique = 2 * 16 * 16 + 3 * 16 + 16 * 4 + 4  # a's and b's weights, three biases, the head
    assert est.breakdown["parameters"] == 4 * unique
    assert est.peak_allocated_bytes == measure_cpu_peak(_classify(Tied), 8)


def test_a_compiled_model_is_estimated_as_eager_and_says_so() -> None:
    compiled = batchfit.estimate(_classify(lambda: torch.compile(_mlp())), 8, device="cpu")
    eager = batchfit.estimate(_classify(_mlp), 8, device="cpu")
    assert compiled.peak_allocated_bytes == eager.peak_allocated_bytes
    assert any("torch.compile" in n for n in compiled.notes)
    assert not eager.notes


def test_frozen_parameters_get_no_gradient_and_no_optimizer_state() -> None:
    def half_frozen() -> nn.Module:
        model = _mlp()
        model[0].requires_grad_(False)
        return model

    from batchfit.gpu.catalog import get_device
    from batchfit.memory.categories import Category
    from batchfit.memory.estimate import trace_for_device
    from batchfit.precision import policy_for

    trace = trace_for_device(_classify(half_frozen), 8, get_device("cpu"), policy_for("fp32"), ())
    by_role: dict[Category, int] = {}
    for sid, role in trace.role.items():
        by_role[role] = by_role.get(role, 0) + trace.nbytes[sid]
    trainable = 32 * 4 + 4  # the second layer only
    assert by_role[Category.GRADIENTS] == 2 * 4 * trainable  # two steps' gradients, freed between them
    assert by_role[Category.OPTIMIZER_STATES] == 2 * 4 * trainable + 2 * 4  # exp_avg, exp_avg_sq, 2 steps


class _ReadsValues(nn.Module):
    """Reads a value of its input (known to the trace) and one of its activations (not known)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        keep = int(lengths.max())  # a small input: its value is computed beside the fake
        out = self.body(x[:, :keep].repeat(1, 16 // keep))
        if torch.isnan(out).any():  # an activation: unknown, read as False (no NaN), and noted
            raise FloatingPointError("nan")
        return out


def _value_reads_figures() -> tuple[int, int, list[str]]:
    """The estimate's peak, the measured peak and the estimate's notes for ``_ReadsValues`` at batch 8."""
    wl = Workload(
        model=_ReadsValues,
        batch=lambda b: (torch.randn(b, 16), torch.full((b,), 8), torch.randint(0, 4, (b,))),
        loss=lambda m, batch: F.cross_entropy(m(batch[0], batch[1]), batch[2]),
    )
    est = batchfit.estimate(wl, 8, device="cpu")
    return est.peak_allocated_bytes, measure_cpu_peak(wl, 8), list(est.notes)


def test_value_reads_follow_known_values_and_note_assumed_ones() -> None:
    # In a fresh process: after some other tests in the same process (seen once under pytest-xdist,
    # not reproduced in isolation) this estimate came out 16 bytes above the measurement.
    code = (
        "import json, torch; torch.set_num_threads(1); import test_construct as t; "
        "print(json.dumps(t._value_reads_figures()))"
    )
    env = dict(os.environ, BATCHFIT_CACHE="0", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                         timeout=300, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    estimated, measured, notes = json.loads(run.stdout.strip().splitlines()[-1])
    assert estimated == measured
    assert len(notes) == 1 and "_ReadsValues" in notes[0] and "assumed False" in notes[0]


def test_data_dependent_shapes_on_unknown_values_assume_every_element() -> None:
    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(16, 1)
            self.expert = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            chosen = self.gate(x).squeeze(1) > 0  # which rows go to the expert: unknown
            out = torch.zeros(x.shape[0], 4)
            return out.index_add(0, chosen.nonzero().squeeze(1), self.expert(x[chosen]))

    est = batchfit.estimate(_classify(Router), 64, device="cpu")
    assert any("all 64 elements nonzero" in n for n in est.notes)
    assert any("boolean mask of 64 selected" in n for n in est.notes)


class _SavedCopy(nn.Module):
    """What peft's ``modules_to_save`` does: a trainable deep copy beside the frozen original."""

    def __init__(self) -> None:
        super().__init__()
        self.original = nn.Linear(16, 4)
        self.original.requires_grad_(False)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.copy = copy.deepcopy(self.original).requires_grad_(True)
        self.copy.register_buffer("scale", copy.deepcopy(self.scale))
        self.same_mode = getattr(self.copy.weight, "fake_mode", 0) is getattr(self.original.weight, "fake_mode", 0)
        self.same_storage = self.copy.weight.untyped_storage() is self.original.weight.untyped_storage()
        self.copied_value = self.copy.scale.tolist()  # a known value stays known in the copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.copy(x) * self.copy.scale


def test_a_deep_copy_while_building_is_a_new_fake_of_the_same_mode() -> None:
    from batchfit.memory.trace.fake_step import fake_model

    model = fake_model(_classify(_SavedCopy))
    # A fake's deep copy used to clone its whole FakeTensorMode (the process later died freeing both).
    assert model.same_mode and not model.same_storage and model.copied_value == [2.0] * 4
    assert isinstance(model.copy.weight, nn.Parameter) and model.copy.weight.requires_grad
    assert not model.original.weight.requires_grad
    est = batchfit.estimate(_classify(_SavedCopy), 8, device="cpu")
    assert est.peak_allocated_bytes == measure_cpu_peak(_classify(_SavedCopy), 8)


def test_the_session_is_one_python_mode_that_still_reads_values() -> None:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from batchfit.memory.trace.construct import fake_session
    from batchfit.memory.trace.values import FakeValueMode, active_value_mode

    with fake_session() as values:
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        assert isinstance(mode, FakeValueMode) and active_value_mode() is values is mode.values
        assert [m for m in _get_current_dispatch_mode_stack() if m is not mode] == []  # no layer above it
        x = torch.arange(6).reshape(2, 3)
        assert isinstance(x, FakeTensor) and x.device == torch.device("cpu")
        assert int(x.sum()) == 15 and x[x > 2].shape == (3,)  # a read and a data-dependent shape, known
        y = torch.randn(2048, 1024)  # above the shadows' size limit: its values are unknown
        assert bool(y.isnan().any()) is False  # one branch taken, and noted
    assert values.notes and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None


class _ReadsAValue(nn.Module):
    """A constructor that reads a value of a tensor it made: meta tensors have none."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.scale = float(self.linear.weight.abs().sum().item())


def test_the_structure_is_read_from_a_meta_build_or_a_fake_one_when_meta_refuses() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    from batchfit.memory.trace.fake_step import model_structure

    meta = model_structure(_classify(_mlp))
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert [tuple(p.shape) for p in meta.parameters()] == [(32, 16), (32,), (4, 32), (4,)]
    fake = model_structure(_classify(_ReadsAValue))
    assert all(isinstance(p, FakeTensor) for p in fake.parameters())
    instance = _mlp()
    assert model_structure(_classify(instance)) is instance
