"""Generated command lines (``cli_fuzz.py``): exit 0, or exactly one ``batchfit: error:`` line, never a traceback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from cli_fuzz import check_argv, random_argv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_generated_command_line_ends_in_exit_0_or_one_error_line(data: st.DataObject) -> None:
    def randint(low: int, high: int) -> int:
        return data.draw(st.integers(low, high))

    def choice(options: Sequence[Any]) -> Any:
        return data.draw(st.sampled_from(list(options)))

    argv = random_argv(randint, choice)
    verdict = check_argv(argv)
    assert verdict.kind in ("ok", "error"), (argv, verdict)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["estimate", "mlp", "-b", "2", "--device", "T4", "--context-mib", "-1"], "context size must be >= 0"),
        (["plan", "mlp", "-g", "", "--device", "1GiB"], "'--global-batch-size' / '-g'"),
        (["train", "mlp", "-g", "4", "-m", "", "--steps", "1"], "--micro-batch-size takes a whole number or 'auto'"),
        (["estimate", "", "-b", "2"], "no model given; name a preset"),
        (["train", "mlp", "-g", "4", "--steps", "1", "--device", "simulated:"], "simulated: needs a GPU name"),
    ],
)
def test_odd_values_found_by_the_fuzz_are_one_line(argv: list[str], fragment: str) -> None:
    verdict = check_argv(argv)
    assert verdict.kind == "error" and not verdict.unexpected, verdict
    assert fragment in verdict.detail


def test_no_arguments_shows_the_help_and_succeeds() -> None:
    assert check_argv([]).kind == "ok"
