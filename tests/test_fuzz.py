"""Generated Trainer runs on simulated GPUs: each finishes exactly (every item once) or refuses in one line.

See ``fuzz_cases.py`` for the cases and the invariant; ``benchmarks/fuzz_trainer.py`` runs 500 of them
and prints the outcome table.
"""

from __future__ import annotations

import logging

import pytest
from fuzz_cases import Case, case_from, run_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("one_thread")

# Runs that ended in a raw ``torch.OutOfMemoryError`` from ``Trainer.step`` while the simulated GPU
# counted the caller's host-side global batch: slicing it (``batching.slice_batch``, outside the guarded
# region) put its whole storage on the device. Now only micro-batches count: 18 of them finish, and 6
# refuse in one line because even one item does not fit beside the model (the allocator's 20 MiB
# segments for the 4 MiB weight and the cuBLAS workspaces leave no room). All with the mean loss, on a
# device the caller entered: (global batch, micro-batch, steps, optimizer, clipping, dtype, capacity
# in MiB, scheduler, seed).
Shape = tuple[int, int, int, str, "float | None", str, int, bool, int]
HOST_BATCH_FITS: list[Shape] = [
    (28, 14, 2, "sgd-momentum", None, "float64", 50, False, 97),
    (65, 39, 3, "adamw", 0.5, "float32", 44, False, 112),
    (70, 55, 2, "adamw", 0.5, "float32", 46, False, 130),
    (75, 50, 2, "sgd-momentum", 0.5, "float32", 55, False, 171),
    (72, 14, 2, "sgd-momentum", None, "float32", 50, False, 241),
    (63, 2, 3, "adamw", None, "float64", 87, True, 317),
    (78, 39, 3, "sgd-momentum", None, "float32", 24, True, 341),
    (46, 10, 3, "sgd-momentum", None, "float32", 50, True, 374),
    (65, 61, 3, "sgd-momentum", None, "float32", 43, False, 381),
    (44, 5, 3, "adamw", None, "float32", 50, False, 461),
    (71, 67, 2, "sgd-momentum", 0.5, "float32", 52, False, 580),
    (73, 45, 3, "sgd-momentum", 0.5, "float32", 40, False, 611),
    (54, 6, 3, "sgd-momentum", 0.5, "float64", 87, True, 628),
    (74, 50, 3, "adamw", None, "float32", 47, False, 643),
    (71, 46, 2, "adamw", None, "float32", 60, False, 673),
    (56, 2, 3, "sgd-momentum", None, "float64", 80, True, 836),
    (78, 25, 3, "sgd-momentum", 0.5, "float32", 59, False, 916),
    (59, 22, 3, "sgd-momentum", None, "float64", 77, True, 945),
]
HOST_BATCH_REFUSED: list[Shape] = [
    (68, 59, 2, "adamw", 0.5, "float64", 35, False, 81),
    (74, 49, 3, "sgd-momentum", 0.5, "float64", 38, False, 591),
    (24, 15, 3, "sgd-momentum", None, "float32", 36, True, 716),
    (66, 3, 1, "adamw", 0.5, "float64", 32, False, 775),
    (77, 67, 2, "sgd-momentum", 0.5, "float64", 26, False, 792),
    (65, 59, 1, "adamw", None, "float64", 37, False, 804),
]


def _host_case(shape: Shape) -> Case:
    g, m, steps, optimizer, clip, dtype, capacity, scheduled, seed = shape
    return Case(g, m, steps, optimizer, clip, "mean", dtype, capacity, True, scheduled, seed)


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="batchfit")  # re-plans are expected here; their warnings are noise


@pytest.mark.parametrize("shape", HOST_BATCH_FITS + HOST_BATCH_REFUSED, ids=lambda shape: f"seed{shape[-1]}")
def test_a_host_global_batch_is_not_device_memory(shape: Shape) -> None:
    case = _host_case(shape)
    outcome = run_case(case)
    if shape in HOST_BATCH_FITS:
        assert outcome.kind in ("exact", "re-split"), (case, outcome)
    else:
        assert outcome.kind == "refused", (case, outcome)
        assert outcome.detail.startswith("one item does not fit on a simulated")


@st.composite
def cases(draw: st.DrawFn) -> Case:
    return case_from(lambda low, high: draw(st.integers(low, high)), draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_generated_run_is_exact_or_refused_in_one_line(case: Case) -> None:
    outcome = run_case(case)
    assert outcome.kind in ("exact", "re-split", "refused"), (case, outcome)


@pytest.mark.parametrize("mutation", ["weight", "shift"])
def test_the_invariant_catches_a_wrong_split(monkeypatch: pytest.MonkeyPatch, mutation: str) -> None:
    """The check is not vacuous: a first micro-batch weighted 1.5 times, or one item used twice and
    another never (a slice shifted by one item), is classified ``other``."""
    import batchfit.train.micro_step as micro_step_module
    import batchfit.train.oom_resplit as oom_module

    case = Case(24, 8, 1, "adamw", None, "mean", "float64", 1024, True, False, seed=5)
    assert run_case(case).kind == "exact"
    calls = [0]
    if mutation == "weight":
        real = micro_step_module.MicroStep.backward_weighted

        def heavier(self: micro_step_module.MicroStep, out: object) -> object:
            calls[0] += 1
            return real(self, out * 1.5 if calls[0] == 1 else out)  # type: ignore[operator]

        monkeypatch.setattr(micro_step_module.MicroStep, "backward_weighted", heavier)
    else:
        real_slice = oom_module.slice_batch

        def shifted(batch: object, start: int, stop: int) -> object:
            calls[0] += 1
            return real_slice(batch, start + 1, stop + 1) if calls[0] == 1 else real_slice(batch, start, stop)

        monkeypatch.setattr(oom_module, "slice_batch", shifted)
    outcome = run_case(case)
    assert outcome.kind == "other" and calls[0] > 0
    assert outcome.detail.startswith("finished but differs from the full batch by")
