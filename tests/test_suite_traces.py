"""``benchmarks/suite_traces.py``: the suite's time by test file, from the calls its plugin logs."""

from __future__ import annotations

from benchmark_modules import load_benchmark


def _module():
    return load_benchmark("suite_traces")


def test_a_step_whose_key_was_traced_before_counts_as_traced_again_where_it_is_traced_again() -> None:
    m = _module()
    rows = [
        {"test": "tests/a.py::t1", "kind": "step", "seconds": 2.0, "key": "k1"},
        {"test": "tests/a.py::t1", "kind": "trace", "seconds": 1.5, "key": None},
        {"test": "tests/b.py::t2", "kind": "step", "seconds": 3.0, "key": "k1"},
        {"test": "tests/b.py::t2", "kind": "trace", "seconds": 2.5, "key": None},
        {"test": "tests/b.py::t2", "kind": "step", "seconds": 4.0, "key": None},  # no key: never "again"
        {"test": "tests/b.py::t3", "kind": "measure", "seconds": 0.5, "key": None},
    ]
    output = "7.00s call     tests/b.py::t2\n1.00s setup    tests/b.py::t3\n2.50s call     tests/a.py::t1\n"
    durations = m._durations(output)
    assert m.summarise(rows, durations) == [
        ("total", 10.5, 4.0, 0.5, 3.0),
        ("tests/b.py", 8.0, 2.5, 0.5, 3.0),
        ("tests/a.py", 2.5, 1.5, 0.0, 0.0),
    ]
