"""Fixtures that test modules of both tests/unit and tests/integration share.

A fixture lives here once two modules would otherwise copy it; one used by a single
module stays in that module. tests/integration/conftest.py adds the ones that start
clusters (``cf``).

It also says how the suite runs in parallel (pytest-xdist, ``-n 2 --dist loadgroup`` in
``pyproject.toml``; docs/testing.md "In parallel"): ``MACHINE_MODULES`` are the modules
that cannot run beside one another, kept on one worker one after the other, and a module
with a module-scoped fixture keeps its tests on one worker so the fixture runs once
(``group_of``).
"""

from __future__ import annotations

import ast
import functools
import signal
from pathlib import Path
from typing import Any

import pytest

from clusterflow.cluster import contract

# What a cluster gives its tasks (or a user sets to reach one): a test process started
# inside a task, or in a shell that ran one, must not find its way to that cluster. Left
# alone: CLUSTERFLOW_HOME (the ``home`` fixture's), and the variables that say how this
# machine runs processes rather than which cluster they belong to.
_NOT_CLUSTER = {
    contract.ENV_HOME,
    contract.ENV_UI_TOKEN,
    contract.ENV_HOSTS,
    contract.ENV_RAY_JOIN_TIMEOUT,
    contract.CUDA_VISIBLE_DEVICES,
    contract.PYTHONUNBUFFERED,
    contract.GLOO_IFNAME,
}
CLUSTER_VARIABLES = tuple(sorted(set(contract.TASK_ENVIRONMENT) - _NOT_CLUSTER))
"""Every variable of ``contract.TASK_ENVIRONMENT`` that ties a process to a cluster."""


MACHINE = "machine"
"""The unit of work of ``MACHINE_MODULES``: one worker runs them all, one after another."""

MACHINE_MODULES = {
    # Each makes network namespaces, veths and a bridge with tc on them (root), and most
    # run Ray inside them. Their names carry the creating pid, so two would not collide,
    # but they share what is not named: Ray's session folder (/tmp/ray) and its
    # ~/.ray, the caches' /dev/shm folders named by cache, and links shaped for a timing
    # scenario on a machine that must not be busy with another harness's relays.
    "integration/test_emulated_hosts.py": "the harness itself (sweeps stale namespaces)",
    "integration/test_hostile_fencing.py": "partitions cut and healed on emulated hosts",
    "integration/test_hostile_lossy.py": "lossy, delayed links through userspace relays",
    "integration/test_hostile_partition_start.py": "a partition scenario on emulated hosts",
    "integration/test_ray.py": "a Ray cluster of emulated hosts at 10.77.0.1:6379",
    "integration/test_ray_agents.py": "a Ray cluster of emulated hosts at 10.77.0.1:6379",
    "integration/test_ray_elastic.py": "a Ray cluster of emulated hosts",
    "integration/test_ray_growth.py": "a Ray cluster of emulated hosts that grows",
    "integration/test_cache_ray.py": "Ray on emulated hosts, caches in /dev/shm by name",
    "integration/test_tune_ray.py": "a Ray head in a namespace of its own on a fixed port",
    # Not a harness: Ray's `auto` takes any GCS process it finds on the machine before
    # the stale file the test plants (ray._private.services, its legacy lookup), so a
    # Ray test on the other worker changes what `start --address auto` joins.
    "integration/test_hangs.py": "`--address auto` finds any Ray running on the machine",
}
"""Test modules (relative to tests/) of the ``MACHINE`` group, each with why it is there;
tests/unit/test_suite_policy.py fails when a module using the harness is missing."""


_WIDE = frozenset({"module", "package", "session", "class"})


@functools.cache
def _has_wide_fixture(module: Path) -> bool:
    """Whether a test module defines a fixture wider than a test (a module's cluster, its
    browser): read from its source, as xdist's controller collects nothing itself."""
    if not module.is_file():
        return False
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.fixture":
            for keyword in node.keywords:
                if keyword.arg == "scope" and getattr(keyword.value, "value", None) in _WIDE:
                    return True
    return False


def group_of(nodeid: str, root: Path) -> str:
    """The unit of work a test belongs to, on one worker: ``MACHINE`` for the
    ``MACHINE_MODULES``, the module for one with a wider fixture (split across two
    workers, each would start its cluster or browser again, and test_dashboard.py's last
    test stops the cluster its others share), else the test alone."""
    path = nodeid.split("::", 1)[0]
    tests = Path(__file__).resolve().parent
    absolute = (root / path).resolve()
    module = absolute.relative_to(tests).as_posix() if absolute.is_relative_to(tests) else path
    if module in MACHINE_MODULES:
        return MACHINE
    if _has_wide_fixture(absolute):
        return path
    return nodeid


class _Groups:
    """Makes xdist's scheduler: its ``loadscope`` with ``group_of`` as the scope.

    Not xdist's own ``loadgroup`` with ``xdist_group`` markers: it tags a test by
    rewriting ``item._nodeid``, which pytest 9.2 no longer reads (``nodeid`` comes from
    ``_id``), so every marked test was scheduled alone. Registered only where xdist is
    (``-p no:xdist`` leaves the hook unknown).
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid, config.rootpath)

        return GroupScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT is delivered, whoever started the suite.

    A shell without job control starts a background command (``pytest &`` in a script)
    with SIGINT ignored, Python then keeps it ignored, and every process the tests start
    inherits that: the tests that press Ctrl-C on the CLI (test_hangs.py,
    test_cli_interrupts.py) would fail for the runner's sake, not the code's. The
    interpreter's own handler is put back, so the CLI children start with SIGINT's
    default, as they do under a terminal or CI.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Groups(), "clusterflow-groups")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty ``CLUSTERFLOW_HOME`` for this test: its registry of clusters, its
    studies. Modules whose every test needs one mark ``usefixtures("home")``."""
    root = tmp_path / "cfhome"
    monkeypatch.setenv(contract.ENV_HOME, str(root))
    return root


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment of a process outside any cluster: no ``TF_CONFIG``, no torchrun
    variables, no manager, no checkpoint folder to restore. Returns the monkeypatch, so
    a test sets the few it means to (``bare_env.setenv("RANK", "0")``)."""
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
