"""What the framework adapters share: equal splits, batches of any size from one real batch, missing extras."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batchfit.cli import main
from batchfit.errors import ConfigError, MissingExtraError
from batchfit.integrations._common import RepeatedItems, largest_divisor_at_most, per_rank_share


@given(st.integers(1, 720), st.integers(1, 800))
def test_largest_divisor_at_most(n: int, limit: int) -> None:
    d = largest_divisor_at_most(n, limit)
    assert n % d == 0 and 1 <= d <= min(n, limit)
    assert not any(n % e == 0 for e in range(d + 1, min(n, limit) + 1))


def test_per_rank_share() -> None:
    assert per_rank_share(64, 8, "X") == 8
    with pytest.raises(ConfigError, match="cannot give each of 4 processes an item; use a global batch >= 4"):
        per_rank_share(3, 4, "X")
    with pytest.raises(ConfigError, match="X gives every one of its 4 processes the same batch size.*use 8 or 12"):
        per_rank_share(10, 4, "X")
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ConfigError, match="whole number >= 1"):
            per_rank_share(bad, 1, "X")


def test_repeated_items_cycle_through_the_real_batch() -> None:
    batch = {"ids": torch.arange(6).view(3, 2), "mask": torch.ones(3, 2), "text": ["a", "b", "c"]}
    make = RepeatedItems(batch)
    out = make(7)
    assert make.n_items == 3
    assert torch.equal(out["ids"], torch.arange(6).view(3, 2)[torch.tensor([0, 1, 2, 0, 1, 2, 0])])
    assert out["mask"].shape == (7, 2) and out["text"] == ["a", "b", "c"]
    assert torch.equal(RepeatedItems((torch.arange(4),))(2)[0], torch.tensor([0, 1]))


@pytest.mark.parametrize("integration", ["transformers", "lightning", "accelerate"])
def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch, integration: str) -> None:
    monkeypatch.setitem(sys.modules, integration, None)  # `import integration` now raises ImportError
    monkeypatch.delitem(sys.modules, f"batchfit.integrations.{integration}", raising=False)
    with pytest.raises(MissingExtraError) as info:
        importlib.import_module(f"batchfit.integrations.{integration}")
    text = str(info.value)
    assert text.endswith(f"install it with: pip install 'batchfit[{integration}]'") and "\n" not in text
    assert isinstance(info.value, ImportError) and isinstance(info.value, ConfigError)


def test_the_cli_without_transformers_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                  tmp_path: object) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "batchfit.integrations.transformers", raising=False)
    code = main(["plan", "mlp", "--global-batch-size", "64", "--device", "1GiB", "--hf-args", f"{tmp_path}/a.json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("batchfit: error:") and "batchfit[transformers]" in err


def test_planning_takes_none_of_an_active_simulated_gpus_memory() -> None:
    """A framework's fit start runs inside the GPU it trains on; the traced steps are not on it."""
    from batchfit import SimulatedDevice, presets
    from batchfit.integrations._common import equal_plan

    gpu = SimulatedDevice("64MiB")
    with gpu:
        plan = equal_plan(presets.get("mlp"), 12, device="1GiB", world_size=2, rungs=[("fp32", False)], framework="X")
    assert gpu.stats().peak_reserved_bytes == 0
    assert plan.micro_batch_size * plan.accumulation_steps * 2 == 12 and plan.gpus == 2
