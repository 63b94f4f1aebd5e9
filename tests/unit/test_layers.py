"""Imports point one way (docs/architecture.md section 2): from cli down to errors."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "clusterflow"

# For each layer, the layers it must never import.
FORBIDDEN: dict[str, set[str]] = {
    "errors": {"*"},
    "_lazy": {"*"},  # the lazy-export helper of packages' __init__ (no layer of its own)
    "_files": {"*"},  # the one atomic JSON write (no layer of its own)
    "_sizes": {"*"},  # the one reader of a size such as 4G (no layer of its own)
    "_checks": {"*"},  # the checks of a setting's number (no layer of its own)
    "cluster": {"*"},  # only clusterflow.errors
    "rpc": {
        "server",
        "ps",
        "collective",
        "strategies",
        "data",
        "checkpoint",
        "train",
        "backends",
        "manager",
        "tune",
        "cache",
        "ui",
        "cli",
    },
    "server": {
        "ps",
        "collective",
        "strategies",
        "data",
        "checkpoint",
        "train",
        "backends",
        "manager",
        "tune",
        "cache",
        "ui",
        "cli",
    },
    # checkpoint is storage and format only (manifest, safetensors parts, fsspec): ps
    # tasks restore their own shard from it, and the manager reads the cursor with it.
    "checkpoint": {
        "rpc",
        "server",
        "ps",
        "collective",
        "strategies",
        "data",
        "train",
        "backends",
        "manager",
        "tune",
        "cache",
        "ui",
        "cli",
    },
    "ps": {"strategies", "train", "backends", "manager", "tune", "cache", "ui", "cli"},
    "collective": {"strategies", "train", "backends", "manager", "tune", "cache", "ui", "cli"},
    "data": {"strategies", "train", "backends", "manager", "tune", "cache", "ui", "cli"},
    "strategies": {"train", "backends", "manager", "tune", "cache", "ui", "cli"},
    "train": {"backends", "manager", "tune", "cache", "ui", "cli"},
    "backends": {"manager", "tune", "cache", "ui", "cli"},
    # in-memory caches and their servers: above data (whose cache:// source reads the
    # partition map), beside ps and manager; the CLI and the dashboard (ui) use them
    "cache": {
        "ps",
        "collective",
        "strategies",
        "train",
        "manager",
        "tune",
        "ui",
        "cli",
    },
    "manager": {"tune", "cache", "ui", "cli"},
    # studies of trial clusters: above the manager, beside train (a job reports to its
    # trial through clusterflow.cluster.trial, so train never imports tune)
    "tune": {"ui", "cli"},
    # the dashboard: reads the manager's state (and tune's studies) for the browser; above
    # manager and tune, below cli (docs/architecture.md section 2)
    "ui": {"cli"},
    "cli": set(),
    # the emulated-hosts harness of tests and benchmarks: beside everything; only its
    # placement of a cluster's tasks (testing/hosts_backend.py) uses a backend
    "testing": {
        "rpc",
        "server",
        "ps",
        "collective",
        "strategies",
        "data",
        "checkpoint",
        "train",
        "manager",
        "tune",
        "cache",
        "ui",
        "cli",
    },
}
ALWAYS_ALLOWED = {"errors", "_lazy", "_files", "_sizes", "_checks"}


def _layer_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _imported_layers(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    layers = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "clusterflow" and len(parts) > 1:
                layers.add(parts[1])
    return layers


def _modules() -> list[Path]:
    return [p for p in SRC.rglob("*.py") if p.parent != SRC or p.name != "__init__.py"]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_one_way(path: Path) -> None:
    layer = _layer_of(path)
    assert layer in FORBIDDEN, f"new layer {layer!r}: add it to FORBIDDEN with its rules"
    imported = _imported_layers(path) - {layer} - ALWAYS_ALLOWED
    forbidden = FORBIDDEN[layer]
    bad = imported if "*" in forbidden else imported & forbidden
    assert not bad, f"{path.relative_to(SRC)} ({layer}) imports {sorted(bad)}"


def test_package_root_never_imports_manager_or_cli() -> None:
    imported = _imported_layers(SRC / "__init__.py")
    assert not imported & {"manager", "cli", "backends", "tune"}


@pytest.mark.parametrize(
    "module",
    [
        "clusterflow",
        "clusterflow.cluster",
        "clusterflow.rpc",
        "clusterflow.manager",
        "clusterflow.checkpoint",
        "clusterflow.cli.main",
        "clusterflow.tune",
        "clusterflow.ui.app",
    ],
)
def test_control_plane_starts_without_torch(module: str) -> None:
    """The manager, CLI and supervisors must not pay torch's ~2.5 s import."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _imported_modules(path: Path) -> set[str]:
    """Every ``clusterflow...`` module ``path`` imports, TYPE_CHECKING blocks included."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("clusterflow."))
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("clusterflow.")
        ):
            found.add(str(node.module))
    return found


def test_train_has_no_import_circle() -> None:
    """Hooks see the session through ``train.api.Session`` (a protocol), so the session
    imports its hooks and nothing in train imports back, not even for type checking."""
    train = SRC / "train"
    graph = {
        f"clusterflow.train.{p.stem}": {
            m for m in _imported_modules(p) if m.startswith("clusterflow.train.")
        }
        for p in train.glob("*.py")
        if p.name != "__init__.py"
    }

    def circle_from(node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return [*path[path.index(nxt) :], nxt]
            found = circle_from(nxt, [*path, nxt])
            if found:
                return found
        return None

    for module in sorted(graph):
        circle = circle_from(module, [module])
        assert circle is None, " -> ".join(circle or [])


def test_the_consistent_cut_lives_in_train_and_knows_no_strategy_by_type() -> None:
    """Strategies take part in a checkpoint through their CheckpointParticipant methods;
    the cut (``train/cut.py``) imports no concrete strategy, and strategies write no
    checkpoint storage themselves."""
    assert not (SRC / "strategies" / "checkpointer.py").exists()
    cut = _imported_modules(SRC / "train" / "cut.py")
    concrete = {
        "clusterflow.strategies.mirrored",
        "clusterflow.strategies.parameter_server",
        "clusterflow.strategies.parameter_server.strategy",
    }
    assert not cut & concrete, sorted(cut & concrete)
    for path in (SRC / "strategies").rglob("*.py"):
        text = path.read_text()
        assert "CheckpointStorage" not in text, f"{path.relative_to(SRC)} writes checkpoints"
    assert not (SRC / "train" / "replicas.py").exists()


def test_no_module_hides_an_import_behind_importlib() -> None:
    """``importlib.import_module("clusterflow...")`` hides an edge from the rules above."""
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("clusterflow")
            ):
                raise AssertionError(f"{path.relative_to(SRC)}:{node.lineno} imports by name")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _file_imports(path: Path, files: set[str]) -> set[str]:
    """The files of src/ that ``path`` imports when it runs: at module level or inside a
    function (a local import is still an edge; it only hides the circle until called).
    ``if TYPE_CHECKING:`` blocks never run, so they are left out. ``from pkg import x``
    is an edge to ``pkg/x.py`` when x is a module, else to ``pkg/__init__.py``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in files)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in files else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found - {_module_name(path)}


def _import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(circles)


def test_import_circles_are_found() -> None:
    """The finder itself: a two-file circle and a longer one, and no false one."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _import_circles(graph) == [["a", "b"], ["c", "d", "e"]]
    assert _import_circles({"a": {"b"}, "b": set()}) == []


def test_no_two_files_of_src_import_each_other() -> None:
    """No circle of imports among the files of src/, directly or through others.

    A circle means neither file can be read (or loaded) without the other; the shared
    piece belongs in a module both import (issue 29 broke four such pairs that way).
    """
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {name: _file_imports(path, set(paths)) for name, path in paths.items()}
    circles = _import_circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)
