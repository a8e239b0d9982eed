"""The package's import graph: one-way, and torch only where tensors are made.

Every ``import`` of a batchfit module counts, the lazy ones inside functions too: a cycle that only a
function-level import keeps from failing at start-up is still two modules that cannot be understood
(or split) apart.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in (SRC / "batchfit").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _targets(node: ast.AST, package: str) -> set[str]:
    """The batchfit modules one import statement loads (``from . import x`` a module, ``from .x import y`` x)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1] if node.level else []
    module = ".".join([*base, *([node.module] if node.module else [])])
    return {f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names}


def _imports(name: str) -> set[str]:
    """The batchfit modules ``name`` imports anywhere in its source (``TYPE_CHECKING`` blocks aside)."""
    path, is_package = MODULES[name]
    package = name if is_package else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
    }
    found = set().union(*(_targets(n, package) for n in ast.walk(tree) if id(n) not in typing_only))
    return {m for m in found if m in MODULES and m != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Every module's imports of batchfit modules: parsed when a test first asks (every worker collects
    this file; only the one running these tests parses the package)."""
    return {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_sources() -> None:
    assert "batchfit.memory.allocator.caching" in graph()["batchfit.memory.estimate"]
    assert "batchfit.cli.options" in graph()["batchfit.cli.main"]  # `from . import options as opts`
    assert len(MODULES) > 50 and sum(map(len, graph().values())) > 200


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_in_a_circle() -> None:
    assert _cycles(graph()) == []


# Bottom to top: a package imports only the packages before it. ``<core>`` is the package root's own
# modules (errors, units, workload, precision, ...); the root's ``__init__`` (the lazy public facade)
# and ``__main__`` are above everything.
LAYERS = ["<core>", "gpu", "memory", "models", "sources", "runtime", "advice", "planning", "train", "report",
          "integrations", "cli"]  # fmt: skip

# The imports that go up anyway, each with its reason (none today); the test fails when one is gone, so
# that the list only shrinks.
UPWARD: set[tuple[str, str]] = set()


def _layer(module: str) -> int | None:
    """The layer of a module (None: the facade, ``batchfit`` itself or ``batchfit.__main__``)."""
    parts = module.split(".")
    if module in ("batchfit", "batchfit.__main__"):
        return None
    if len(parts) == 2 and not MODULES[module][1]:
        return LAYERS.index("<core>")
    return LAYERS.index(parts[1])


def _upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every import of a module from a later layer than the importer's, or from another package of the same."""
    found = set()
    for name, imports in graph.items():
        mine = _layer(name)
        if mine is None:
            continue
        for target in imports:
            theirs = _layer(target)
            same_package = name.split(".")[:2] == target.split(".")[:2]
            if theirs is None or (theirs >= mine and not same_package and theirs != LAYERS.index("<core>")):
                found.add((name, target))
    return found


def test_every_package_is_in_a_layer() -> None:
    packages = {name.split(".")[1] for name, (_, is_package) in MODULES.items() if is_package and name.count(".") == 1}
    assert packages == set(LAYERS) - {"<core>"}


def test_the_layer_check_finds_an_import_that_goes_up() -> None:
    graph = {"batchfit.gpu.catalog": {"batchfit.memory.estimate", "batchfit.errors"}, "batchfit.errors": {"batchfit"}}
    assert _upward(graph) == {("batchfit.gpu.catalog", "batchfit.memory.estimate"), ("batchfit.errors", "batchfit")}


def test_imports_only_go_down_the_layers() -> None:
    upward = _upward(graph())
    assert upward - UPWARD == set(), "a package imports one above it: move the code down, or pass it in"
    assert UPWARD - upward == set(), "an upward import is gone: take it off UPWARD"


def test_the_library_never_imports_the_command_line_or_the_adapters() -> None:
    outer = ("batchfit.cli", "batchfit.integrations")
    offenders = {
        name: sorted(m for m in imports if m.startswith(outer))
        for name, imports in graph().items()
        if not name.startswith((*outer, "batchfit.__main__")) and any(m.startswith(outer) for m in imports)
    }
    assert offenders == {}


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["gpus"], ["presets"], ["estimate", "--help"]])
def test_commands_that_make_no_tensor_import_no_torch(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from batchfit.cli import main\n"
        f"rc = main({argv!r})\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'transformers', 'matplotlib') if m in sys.modules)\n"
        "print('IMPORTED', heavy, rc, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "IMPORTED [] 0", done.stderr


def test_the_package_root_holds_only_the_entry_points_and_the_core_types() -> None:
    root = sorted(p.stem for p in (SRC / "batchfit").glob("*.py"))
    assert len(root) <= 10, root
    assert not {"plan", "fit", "devices", "simulated", "profiles"} & set(root)
