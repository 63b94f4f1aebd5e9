"""One spelling per name: the task environment and the manager's methods (cluster/contract.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from clusterflow.cluster import contract

SRC = Path(__file__).resolve().parents[2] / "src" / "clusterflow"
HOME = SRC / "cluster" / "contract.py"
_ENV_NAME = re.compile(r"CLUSTERFLOW_[A-Z0-9_]+")


def _literals(path: Path) -> list[tuple[int, str]]:
    """String constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(SRC.rglob("*.py")) if p != HOME],
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_names_of_the_contract_are_spelled_only_in_its_module(path: Path) -> None:
    spelled = [
        f"{path.relative_to(SRC)}:{line}: {value!r}"
        for line, value in _literals(path)
        if _ENV_NAME.fullmatch(value)
        or value in contract.MANAGER_METHODS
        or value in contract.FOREIGN_NAMES
    ]
    assert not spelled, "take these names from clusterflow.cluster.contract:\n" + "\n".join(spelled)


def test_every_environment_name_of_the_module_is_in_the_table() -> None:
    names = {
        value
        for key, value in vars(contract).items()
        if key.startswith("ENV_") and isinstance(value, str)
    }
    assert names <= set(contract.TASK_ENVIRONMENT)
    assert all(_ENV_NAME.fullmatch(n) for n in names)


def test_other_projects_names_are_in_the_table() -> None:
    """TF_CONFIG, torchrun's and CUDA's variables: one constant each, each in the table."""
    assert set(contract.TASK_ENVIRONMENT) >= contract.FOREIGN_NAMES
    assert {"TF_CONFIG", "RANK", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"} <= contract.FOREIGN_NAMES


def test_the_manager_serves_every_method_of_the_table() -> None:
    text = (SRC / "manager" / "controller.py").read_text()
    served = set(re.findall(r"ManagerMethod\.([A-Z_]+)", text))
    assert {getattr(contract.ManagerMethod, name) for name in served} == contract.MANAGER_METHODS
