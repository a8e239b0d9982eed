"""On the CPU, ``batchfit.estimate`` is the allocator's peak to the byte: the estimator's definition of done.

Ground truth is ``measure_cpu_peak``: the same two training steps run for real under the CPU profiler,
whose allocator events are summed (``memory/measure.py``). Everything goes through the public API, on
small shapes; the peak still moves between the backward pass and the optimizer step across the batch
sizes used, so both are checked.

Each gap found on the way (module hooks, checkpoint RNG states, Python numbers saved for backward, the
probe's default dtype) has a case here; they were found by diffing the trace's events (``trace.op``) against
the profiler's ``[memory]`` events attributed to ops, phase by phase.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import batchfit
from batchfit import presets
from batchfit.memory.measure import measure_cpu_peak
from batchfit.models import hf

needs_hf = pytest.mark.skipif(not hf.available(), reason="transformers is not installed")

SHAPES: dict[str, dict] = {
    "mlp": {},
    "cnn": dict(image_size=16, width=4, stages=2, blocks=1),
    "gpt": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32),
    "hf-bert-large": dict(layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=256,
                          seq_len=32),
    "hf-llama-7b": dict(layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256,
                        seq_len=32),
    "hf-gpt2": dict(layers=2, n_embd=64, n_head=2, vocab_size=256, seq_len=32),
}  # fmt: skip
MATRIX = ("mlp", "cnn", "gpt", "hf-bert-large", "hf-llama-7b")
BATCHES = (1, 3, 8)
PRECISIONS = ("fp32", "bf16")



def _cases() -> list:
    cases = []
    for name in MATRIX:
        for precision in PRECISIONS:
            for b in BATCHES:
                marks = [needs_hf] if name.startswith("hf-") else []
                cases.append(pytest.param(name, precision, b, marks=marks, id=f"{name}-{precision}-b{b}"))
    return cases


DEFAULT_THREADS = max(2, torch.get_num_threads())
"""torch's intra-op thread count as the test session found it (the cores, or a worker's share of them:
``conftest.py``), and at least two: the kernels' per-thread scratch shows with several threads."""


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Run this file's cases on one intra-op thread, restoring the count afterwards.

    Exactness does not depend on the thread count (the probe measures each signature at the count in
    force), but on a busy machine two OpenMP threads per process spin against other processes and make
    every real step several times slower. ``test_exact_with_intra_op_threads`` covers the default count,
    where kernels keep per-thread scratch (layer norm backward, flash attention).
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def workloads() -> dict[str, batchfit.Workload]:
    return {}


def _workload(cache: dict, name: str) -> batchfit.Workload:
    if name not in cache:
        cache[name] = presets.get(name, **SHAPES[name])
    return cache[name]


@pytest.mark.parametrize("name, precision, b", _cases())
def test_estimate_is_the_measured_peak(workloads: dict, name: str, precision: str, b: int) -> None:
    wl = _workload(workloads, name)
    est = batchfit.estimate(wl, b, device="cpu", precision=precision)
    # The breakdown and the per-module attribution are two partitions of the same live bytes.
    assert sum(est.breakdown.values()) == est.peak_allocated_bytes
    assert sum(est.per_module.values()) == est.peak_allocated_bytes
    assert est.peak_reserved_bytes == est.device_total_bytes == est.peak_allocated_bytes  # no cache on the CPU
    assert est.peak_allocated_bytes - measure_cpu_peak(wl, b, precision=precision) == 0


@pytest.mark.parametrize(
    "name, precision, b",
    [("gpt", "fp32", 8), ("cnn", "bf16", 3), pytest.param("hf-bert-large", "bf16", 8, marks=needs_hf),
     pytest.param("hf-llama-7b", "fp32", 8, marks=needs_hf)],
)  # fmt: skip
def test_exact_with_intra_op_threads(workloads: dict, name: str, precision: str, b: int) -> None:
    wl = _workload(workloads, name)
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        est = batchfit.estimate(wl, b, device="cpu", precision=precision)
        assert est.peak_allocated_bytes == measure_cpu_peak(wl, b, precision=precision)
    finally:
        torch.set_num_threads(1)


@needs_hf
def test_saved_python_numbers_are_counted(workloads: dict) -> None:
    # GPT-2's gelu_new multiplies by three Python floats per layer; at batch 3 the peak is in backward.
    wl = _workload(workloads, "hf-gpt2")
    assert batchfit.estimate(wl, 3, device="cpu").peak_allocated_bytes == measure_cpu_peak(wl, 3)


GPT_ACTIVATION_BOUND = 16
"""A batch at which activations are the largest category of the gpt shape above (checked below)."""


def test_checkpointing_blocks_lowers_activations(workloads: dict) -> None:
    wl = _workload(workloads, "gpt")
    plain = batchfit.estimate(wl, GPT_ACTIVATION_BOUND, device="cpu")
    ckpt = batchfit.estimate(wl, GPT_ACTIVATION_BOUND, device="cpu", checkpointing="blocks")
    assert max(plain.breakdown, key=plain.breakdown.__getitem__) == "activations"
    assert ckpt.checkpointing and not plain.checkpointing
    # Only the two blocks' inputs stay saved across the blocks; everything inside is recomputed.
    assert ckpt.breakdown["activations"] * 10 < plain.breakdown["activations"]
    assert ckpt.peak_allocated_bytes < plain.peak_allocated_bytes
    assert sum(ckpt.breakdown.values()) == ckpt.peak_allocated_bytes


def test_checkpointing_blocks_is_exact(workloads: dict) -> None:
    wl = _workload(workloads, "gpt")
    est = batchfit.estimate(wl, GPT_ACTIVATION_BOUND, device="cpu", checkpointing="blocks")
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, GPT_ACTIVATION_BOUND, checkpointing="blocks")


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_bf16_true_halves_parameter_bytes(workloads: dict, name: str) -> None:
    # Both have only floating-point parameters and no buffers, so every parameter byte halves.
    wl = _workload(workloads, name)
    fp32 = batchfit.estimate(wl, 3, device="cpu", precision="fp32")
    bf16 = batchfit.estimate(wl, 3, device="cpu", precision="bf16-true")
    n_params = sum(p.numel() for p in wl.build_model().parameters())
    assert fp32.breakdown["parameters"] == 4 * n_params
    assert bf16.breakdown["parameters"] * 2 == fp32.breakdown["parameters"]
    assert bf16.precision == "bf16-true"


@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn"])
def test_bf16_true_is_exact(workloads: dict, name: str) -> None:
    # mlp's and cnn's batches come from torch.randn in the default dtype (bf16 here); gpt's are token ids.
    wl = _workload(workloads, name)
    est = batchfit.estimate(wl, 3, device="cpu", precision="bf16-true")
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, 3, precision="bf16-true")


def test_shapes_reach_both_peak_phases(workloads: dict) -> None:
    # The file would prove little if every case peaked in the same place: the gpt shape peaks in the
    # optimizer step at batch 1 (parameters + grads + states) and in backward at batch 8 (logits' grads).
    wl = _workload(workloads, "gpt")
    assert batchfit.estimate(wl, 1, device="cpu").peak_phase == "optimizer"
    assert batchfit.estimate(wl, 8, device="cpu").peak_phase == "backward"


def test_measurement_does_not_depend_on_values(workloads: dict) -> None:
    # The ground truth must not depend on the data (another seed, other values), or "0 bytes" means little.
    wl = _workload(workloads, "cnn")
    assert measure_cpu_peak(wl, 3) == measure_cpu_peak(wl, 3, seed=1)


@pytest.mark.parametrize(
    "name, precision",
    [("mlp", "fp32"), ("gpt", "fp32"), ("cnn", "bf16"), pytest.param("hf-llama-7b", "fp32", marks=needs_hf)],
)
def test_accumulation_is_exact_and_never_below_a_plain_step(workloads: dict, name: str, precision: str) -> None:
    """Micro-batches 2..k run with the earlier gradients alive: traced as such, to the byte."""
    wl = _workload(workloads, name)
    est = batchfit.estimate(wl, 3, device="cpu", precision=precision, accumulation_steps=4)
    accumulating = dataclasses.replace(wl, accumulation_steps=4)
    assert est.accumulation_steps == 4
    assert est.peak_allocated_bytes == measure_cpu_peak(accumulating, 3, precision=precision)
    plain = batchfit.estimate(wl, 3, device="cpu", precision=precision)
    assert est.peak_allocated_bytes >= plain.peak_allocated_bytes


def test_accumulation_keeps_the_gradients_alive_through_the_next_forward(workloads: dict) -> None:
    """A step whose peak is in the forward (activations) gains about one set of gradients."""
    wl = _workload(workloads, "gpt")
    b = GPT_ACTIVATION_BOUND
    plain = batchfit.estimate(wl, b, device="cpu")
    est = batchfit.estimate(wl, b, device="cpu", accumulation_steps=2)
    assert est.peak_phase in ("forward", "backward")
    assert est.breakdown["gradients"] > plain.breakdown["gradients"]
    assert est.peak_allocated_bytes > plain.peak_allocated_bytes


@pytest.mark.parametrize("name", ["Adagrad", "NAdam", "RMSprop", "Rprop", "ASGD"])
def test_optimizers_with_state_from_their_constructor_are_exact(name: str) -> None:
    """Adagrad makes its sums in its constructor: live before the first step, counted by both sides."""
    wl = batchfit.Workload(
        model=lambda: torch.nn.Linear(64, 64),
        batch=lambda b: (torch.randn(b, 64), torch.randint(0, 64, (b,))),
        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        optimizer=lambda params: getattr(torch.optim, name)(params, lr=1e-2),
    )
    assert batchfit.estimate(wl, 2, device="cpu").peak_allocated_bytes == measure_cpu_peak(wl, 2)


class _CountingRouter(torch.nn.Module):
    """Tokens sorted by a learned router's choice, counted per expert (``bincount(..., minlength)``) and
    split by the counts: sizes from activations, which a trace cannot know. This router's weights send
    item ``i`` to expert ``i % 4``, the even spread the trace assumes, so the real step is the traced one."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 4, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.eye(4, 8))
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        counts = torch.bincount(choice, minlength=4).tolist()
        order = torch.argsort(choice, stable=True)
        parts = x[order].split(counts)
        return self.head(torch.cat([expert(part) for expert, part in zip(self.experts, parts)]))


@pytest.mark.parametrize("b", [4, 8, 11])
def test_counts_of_a_learned_router_are_assumed_even_and_exact_when_they_are(b: int) -> None:
    wl = batchfit.Workload(
        model=_CountingRouter,
        batch=lambda n: (torch.eye(4, 8).repeat(n // 4 + 1, 1)[:n] * 3.0, torch.randint(0, 2, (n,))),
        loss=lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1]),
    )
    est = batchfit.estimate(wl, b, device="cpu")
    assert any("spread evenly over 4 bins" in n for n in est.notes)
    assert est.peak_allocated_bytes == measure_cpu_peak(wl, b)


def test_a_block_an_earlier_profile_left_behind_is_not_this_steps_free() -> None:
    """The CPU allocator's reporter remembers blocks allocated under any earlier profile; dropping one
    (a cache a previous model filled) during a measurement is not memory the measured step freed."""
    from batchfit.memory.measure import cpu_memory_profile, profile_peak

    kept = [torch.empty(1000)]  # 4000 B, made before any profile: its free is never reported
    with cpu_memory_profile():
        kept.append(torch.empty(2000))  # 8000 B made under an earlier profile, kept past it
    with cpu_memory_profile() as prof:
        kept.clear()
        x = torch.empty(250)  # 1000 B
        y = torch.empty(500)  # 2000 B
        del x, y
    assert profile_peak(prof, 0) == 3000


def test_a_garbage_collection_during_a_kernels_replay_is_not_its_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cyclic garbage holding a CPU tensor made under the probe's profile, collected while a replay is measured,
    is not that kernel's scratch (NOTE [ No garbage collection inside a measured replay ]): the trace, every
    storage's bytes included, does not depend on when the collector runs."""
    import gc

    from trace_compare import canonical

    from batchfit.gpu.catalog import get_device
    from batchfit.memory.estimate import _trace_for_device
    from batchfit.memory.kernels import cpu_probe
    from batchfit.precision import policy_for

    wl = presets.get("gpt", **SHAPES["gpt"])
    cpu = get_device("cpu")
    policy = policy_for("fp32", bf16_supported=True, device_name=cpu.name)
    clean = canonical(_trace_for_device(wl, 2, cpu, policy, ()))
    marked = cpu_probe.record_function

    class Cycle:
        def __init__(self) -> None:
            self.me, self.tensor = self, torch.zeros(1000)

    def garbage_then_mark(name: str) -> object:
        for _ in range(3):
            Cycle()  # unreachable at once; the collector frees its 4,000 bytes when it next runs
        return marked(name)

    monkeypatch.setattr(cpu_probe, "record_function", garbage_then_mark)
    thresholds = gc.get_threshold()
    gc.set_threshold(2, 1, 1)  # the collector runs on (almost) every allocation of Python objects
    try:
        dirty = canonical(_trace_for_device(wl, 2, cpu, policy, ()))
    finally:
        gc.set_threshold(*thresholds)
    assert dirty == clean
