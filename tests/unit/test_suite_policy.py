"""The suite's own rules: it cannot run without timeouts, and it never skips quietly.

A skipped test counts as a pass in CI, so a skip must print a reason a reviewer can
accept (``-ra``), and the project's own modules are never skipped: a broken import of
clusterflow is a failure, not a reason to skip every test that needs it.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _pytest_settings() -> dict[str, object]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    settings: dict[str, object] = data["tool"]["pytest"]["ini_options"]
    return settings


def test_pytest_refuses_to_run_without_pytest_timeout() -> None:
    settings = _pytest_settings()
    assert any(str(p).startswith("pytest-timeout") for p in settings["required_plugins"])  # type: ignore[attr-defined]
    assert int(settings["timeout"]) > 0  # type: ignore[call-overload]


def test_skip_reasons_are_printed() -> None:
    assert "-ra" in str(_pytest_settings()["addopts"]).split()


def _skip_calls() -> list[tuple[Path, ast.Call]]:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("skip", "skipif", "importorskip", "xfail"):
                found.append((path, node))
    return found


def test_no_test_skips_on_the_projects_own_modules() -> None:
    own = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path, call in _skip_calls()
        if call.args
        and isinstance(call.args[0], ast.Constant)
        and str(call.args[0].value).startswith("clusterflow")
    ]
    assert not own, f"skips on clusterflow's own modules: {own}"


def test_every_skip_gives_a_reason() -> None:
    silent = []
    for path, call in _skip_calls():
        name = call.func.attr if isinstance(call.func, ast.Attribute) else ""
        keywords = {k.arg for k in call.keywords}
        # skip("why") and xfail("why") take the reason positionally; the others by name.
        positional_reason = name in ("skip", "xfail") and call.args
        if "reason" not in keywords and not positional_reason:
            silent.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert not silent, f"skips without a reason: {silent}"


def test_every_thread_a_test_starts_is_a_daemon() -> None:
    # A hung replica thread that is not a daemon keeps the interpreter from exiting:
    # pytest-timeout fails the test, then the run itself hangs at exit.
    plain = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "Thread"
            ):
                daemon = [k for k in node.keywords if k.arg == "daemon"]
                if not daemon or not (
                    isinstance(daemon[0].value, ast.Constant) and daemon[0].value.value is True
                ):
                    plain.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not plain, f"threads that are not daemons: {plain}"
