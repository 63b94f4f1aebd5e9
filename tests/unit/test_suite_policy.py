"""The suite's own rules: it cannot run without timeouts, and it never skips quietly.

A skipped test counts as a pass in CI, so a skip must print a reason a reviewer can
accept (``-ra``), and the project's own modules are never skipped: a broken import of
clusterflow is a failure, not a reason to skip every test that needs it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
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


# No timing threshold, no sleep as a wait (docs/testing.md) --------------------------------

CLOCKS = frozenset({"monotonic", "time", "perf_counter", "monotonic_ns", "perf_counter_ns"})
TIMING_WORDS = ("elapsed", "took", "duration", "stall", "rtt", "seconds", "latency")
"""Names (or attributes, or a subscript's string key) that hold a measured time,
whatever clock measured it (``took_s``, ``result["seconds_after_loss"]``)."""
RATE_WORDS = ("rate", "per_s")
"""Names that hold a rate measured over time (steps per second, bits per second). A
rate may be bounded from above (a shaped link's ceiling: only the shaper missing fails
it, never a slow machine), not from below, which a busy machine fails."""


def _is_clock_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CLOCKS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "time"
    )


def _measures_time(node: ast.AST) -> bool:
    """A difference of clock readings (``time.monotonic() - started``): a duration. A
    clock compared with a deadline (``time.monotonic() < deadline``) is a safety net."""
    return any(
        isinstance(sub, ast.BinOp)
        and isinstance(sub.op, ast.Sub)
        and any(_is_clock_call(part) for part in ast.walk(sub))
        for sub in ast.walk(node)
    )


def _name_of(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    return node.attr if isinstance(node, ast.Attribute) else ""


def timing_thresholds(source: str) -> list[int]:
    """Lines of ``assert``s that bound a measured duration: the clock difference itself,
    a name assigned one, or a name that says it is one (``elapsed``, ``took_s``)."""
    tree = ast.parse(source)
    durations = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _measures_time(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in ast.walk(node.test):
            if not isinstance(compare, ast.Compare) or not all(
                isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in compare.ops
            ):
                continue
            operands = [compare.left, *compare.comparators]
            names = {_name_of(sub) for operand in operands for sub in ast.walk(operand)}
            if (
                any(_measures_time(operand) for operand in operands)
                or names & durations
                or any(word in name for name in names for word in TIMING_WORDS)
                or _rate_floor(compare)
            ):
                found.append(node.lineno)
                break
    return found


def _rate_floor(compare: ast.Compare) -> bool:
    """Whether ``compare`` bounds a rate from below (``rate > x``, ``x < rate``)."""
    operands = [compare.left, *compare.comparators]
    for op, left, right in zip(compare.ops, operands[:-1], operands[1:], strict=True):
        larger = right if isinstance(op, ast.Lt | ast.LtE) else left  # the side said larger
        if any(
            word in _name_of(sub) or (isinstance(sub, ast.Call) and word in _name_of(sub.func))
            for sub in ast.walk(larger)
            for word in RATE_WORDS
        ):
            return True
    return False


def sleeps_outside_a_poll(source: str) -> list[int]:
    """Lines of ``time.sleep`` calls that are not in a ``while`` loop's body: a sleep
    that is not a poll of a condition waits for time itself to make something true."""
    tree = ast.parse(source)
    polled: set[int] = set()
    for loop in ast.walk(tree):
        if isinstance(loop, ast.While):
            polled |= {id(node) for stmt in loop.body for node in ast.walk(stmt)}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "sleep"
        and id(node) not in polled
    ]


def _test_modules() -> list[Path]:
    """The tests and their fixtures; the jobs they launch (``*_job.py``) may sleep as the
    behaviour under test (a straggler's slow step)."""
    return sorted(
        p for p in TESTS.rglob("*.py") if p.name.startswith("test_") or p.name == "conftest.py"
    )


def test_no_test_asserts_a_timing_threshold() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _test_modules()
        for line in timing_thresholds(path.read_text())
    ]
    assert not found, f"timing thresholds (assert what happened, not how fast): {found}"


def test_no_test_sleeps_except_to_poll_a_condition() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _test_modules()
        for line in sleeps_outside_a_poll(path.read_text())
    ]
    assert not found, f"sleeps used as waits (wait on the condition): {found}"


def test_the_checks_find_the_common_forms_and_leave_safety_nets_alone() -> None:
    # The forms this suite once held (issue 31), each a finding...
    assert timing_thresholds(
        "started = time.monotonic()\n"
        "assert time.monotonic() - started < 5\n"
        "assert time.monotonic() - started >= 0.2  # held back\n"
        "elapsed = time.perf_counter() - t0\n"
        "assert elapsed < 60\n"
        "assert 0 < outcome.elapsed_s <= bound\n"
        "took = time.time() - t\n"
        "assert x and took < 1\n"
        "assert outcome.stall_s <= outcome.stall_bound_s\n"
        'assert result["seconds_after_loss"] < within\n'
        "assert _rate(out, a, b) > _rate(out, c, d)\n"
        "assert 100 <= steps_per_s\n"
    ) == [2, 3, 5, 6, 8, 9, 10, 11, 12]
    assert sleeps_outside_a_poll(
        "time.sleep(0.4)\nassert len(bodies) == 2\nfor _ in range(3):\n    time.sleep(1)\n"
    ) == [1, 4]
    # ...and what is not one: a deadline as a safety net, a poll of a condition.
    assert (
        timing_thresholds(
            "deadline = time.monotonic() + 30\n"
            "while busy():\n"
            "    assert time.monotonic() < deadline, 'never'\n"
            "    time.sleep(0.01)\n"
            "assert deadline_s > 0 and count < 5\n"
            "assert rate < 1.1 * 40e6\n"  # a ceiling: only a missing shaper fails it
        )
        == []
    )
    assert sleeps_outside_a_poll("while not flag.exists():\n    time.sleep(0.05)\n") == []


def test_no_two_test_modules_share_a_name() -> None:
    """The test folders are no packages, so pytest imports each module by its file name
    alone: a second ``test_x.py`` in another folder is a collection error that stops the
    whole run (it did once: a unit and an integration ``test_ray_growth.py``)."""
    by_name: dict[str, list[str]] = {}
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts and path.name not in {"conftest.py", "__init__.py"}:
            by_name.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert not {name: paths for name, paths in by_name.items() if len(paths) > 1}


_HARNESS = {"clusterflow.testing.netns", "clusterflow.testing.ray_nodes"}
_HARNESS |= {"clusterflow.testing.hosts_backend", "clusterflow.testing.tc"}
_HARNESS_NAMES = {"available", "EmulatedHosts", "sweep_stale", "RayNodes"}


def _leading_words(argv: ast.List | ast.Tuple) -> str:
    """An argv literal's first two constants, joined (``"ip netns"``)."""
    return " ".join(str(e.value) for e in argv.elts[:2] if isinstance(e, ast.Constant))


def uses_the_machine(source: str) -> bool:
    """Whether a test module makes network namespaces: it imports the emulated-host
    harness (``clusterflow.testing``) or runs ``ip netns`` itself."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {alias.name for alias in node.names}
            if node.module in _HARNESS or (
                node.module == "clusterflow.testing" and names & _HARNESS_NAMES
            ):
                return True
        if isinstance(node, ast.List | ast.Tuple) and _leading_words(node) == "ip netns":
            return True
    return False


def _machine_modules() -> set[str]:
    """The keys of tests/conftest.py's ``MACHINE_MODULES``, read without importing it
    (a test module importing ``conftest`` may get another folder's)."""
    tree = ast.parse((TESTS / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MACHINE_MODULES":
            return set(ast.literal_eval(node.value))
    raise AssertionError("tests/conftest.py has no MACHINE_MODULES")


def test_every_module_that_makes_namespaces_runs_in_the_machine_group() -> None:
    """Two workers (``-n 2``) run the suite; a module on the emulated hosts beside
    another would share Ray's /tmp/ray and ~/.ray, caches' /dev/shm folders and a
    timing scenario's idle machine: all of them run on one worker, one after another."""
    modules = {
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("test_*.py")
        if "__pycache__" not in path.parts
    }
    using = {m for m in modules if uses_the_machine((TESTS / m).read_text())}
    listed = _machine_modules()
    outside = using - listed
    assert not outside, f"modules on emulated hosts outside MACHINE_MODULES: {outside}"
    assert listed <= modules, f"MACHINE_MODULES names no module: {listed - modules}"
    assert "-n" in str(_pytest_settings()["addopts"]).split()


def test_the_machine_check_finds_the_harness_and_leaves_mentions_alone() -> None:
    assert uses_the_machine("from clusterflow.testing import available\n")
    assert uses_the_machine("from clusterflow.testing.ray_nodes import RayNodes\n")
    assert uses_the_machine("run(['ip', 'netns', 'exec', name, 'true'])\n")
    assert not uses_the_machine("from clusterflow.testing.waiting import wait_for\n")
    assert not uses_the_machine("x = 'clusterflow.testing.hosts_backend HostsLauncher'\n")


def test_the_scheduler_keeps_the_machine_and_a_modules_wide_fixture_on_one_worker() -> None:
    """xdist's controller asks ``group_of`` for each test's unit of work: the machine
    modules share one, a module with a module-scoped fixture is one (its cluster starts
    once), every other test is alone (the two workers share a module's tests)."""
    spec = importlib.util.spec_from_file_location("suite_root_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    ray = "tests/integration/test_ray.py::test_digits_ddp_gives_the_local_backends_result"
    lossy = "tests/integration/test_hostile_lossy.py::test_x"
    dashboard = "tests/integration/test_dashboard.py::test_the_list_page_shows_the_cluster"
    chaos = "tests/integration/test_chaos.py::test_x[seed101]"
    assert conftest.group_of(ray, ROOT) == conftest.group_of(lossy, ROOT) == "machine"
    assert conftest.group_of(dashboard, ROOT) == "tests/integration/test_dashboard.py"
    assert conftest.group_of(chaos, ROOT) == chaos


def test_a_real_xdist_run_keeps_a_modules_wide_fixture_on_one_worker() -> None:
    """The scheduler is in use, not only defined: test_cache_source.py's three tests
    share a module-scoped fixture, so ``-n 2`` runs them all on one worker (scheduled
    alone, xdist would give the first to one worker and the second to the other)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2"]
    done = subprocess.run(
        [*argv, "tests/unit/test_cache_source.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    ran = [line.split()[0] for line in done.stdout.splitlines() if " PASSED " in line]
    assert len(ran) == 3 and len(set(ran)) == 1, done.stdout[-3000:]
