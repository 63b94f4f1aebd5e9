"""Fixtures that test modules of both tests/unit and tests/integration share.

A fixture lives here once two modules would otherwise copy it; one used by a single
module stays in that module. tests/integration/conftest.py adds the ones that start
clusters (``cf``).
"""

from __future__ import annotations

import signal
from pathlib import Path

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
