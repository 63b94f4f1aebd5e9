"""The last live figures are never lost to the rate limit (``Reporter.flush``).

A run shorter than the interval used to leave its first report (``step 1``) as what the
manager kept: the thread waits out the interval after each send, and the process ended
first. Each test holds the interval far longer than the test, so only ``flush`` can
deliver the last figures, and asserts the exact last step the fake manager received.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from clusterflow.rpc import Credentials, Request, RpcServer
from clusterflow.train import TrainingSession
from clusterflow.train.report import METHOD, Reporter

report_module = sys.modules["clusterflow.train.report"]

pytestmark = pytest.mark.timeout(30)

FOREVER_S = 3600.0
"""An interval no test outlives: a second send can only come from ``flush``."""


class Manager:
    """An RpcServer standing in for the manager: records every report, in order."""

    def __init__(self) -> None:
        self.credentials = Credentials.generate()
        self.server = RpcServer(self.credentials, name="fake-manager")
        self.steps: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        self.server.register(METHOD, self._on_report)
        self.server.start()

    def _on_report(self, request: Request) -> dict[str, Any]:
        with self.arrived:
            self.bodies.append(request.body)
            self.steps.append(request.body["step"])
            self.arrived.notify_all()
        return {}

    def wait_for(self, count: int) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.steps) >= count, 10.0), self.steps

    def reporter(self) -> Reporter:
        return Reporter(self.server.address, self.credentials, "worker:0", interval_s=FOREVER_S)


@pytest.fixture
def manager() -> Iterator[Manager]:
    fake = Manager()
    yield fake
    fake.server.stop()


def test_flush_sends_the_newest_figures_the_interval_held_back(manager: Manager) -> None:
    """Pins ``Reporter.flush``: the last of 120 steps arrives, with its loss and rate,
    although the interval would hold it back for an hour; a second flush sends nothing."""
    reporter = manager.reporter()
    try:
        reporter.offer(1, 2.329, 10.0)
        manager.wait_for(1)  # the first report goes at once; the thread then waits
        for step in range(2, 121):
            reporter.offer(step, 1.0 / step, float(step))
        reporter.flush()
        assert manager.steps == [1, 120]
        assert manager.bodies[-1] == {
            "task": "worker:0",
            "step": 120,
            "loss": 1.0 / 120,
            "samples_per_s": 120.0,
        }
        reporter.flush()
        assert manager.steps == [1, 120]
    finally:
        reporter.close()
    reporter.flush()  # after close: nothing, and no error
    assert manager.steps == [1, 120]


def test_a_session_sends_its_last_step_when_it_ends(
    manager: Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pins the ``flush_report()`` in ``TrainingSession._close`` (``fit`` ends through
    it): after 120 steps the manager holds step 120, not the first report's step 1."""
    reporter = manager.reporter()
    monkeypatch.setattr(report_module._Process, "resolved", True)
    monkeypatch.setattr(report_module._Process, "reporter", reporter)
    monkeypatch.setattr(report_module._Process, "pid", report_module.os.getpid())
    try:
        with TrainingSession() as session:
            session.step_done(loss=2.329, samples=8)
            manager.wait_for(1)
            for step in range(2, 121):
                session.step_done(loss=1.0 / step, samples=8)
        assert manager.steps == [1, 120]
        assert manager.bodies[-1]["loss"] == pytest.approx(1.0 / 120)
    finally:
        reporter.close()


def test_flush_in_a_forked_child_sends_nothing(
    manager: Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's ``flush`` (also run at exit) uses the reporter only in the process
    that made it: a forked child shares no socket with its parent."""
    reporter = manager.reporter()
    monkeypatch.setattr(report_module._Process, "resolved", True)
    monkeypatch.setattr(report_module._Process, "reporter", reporter)
    monkeypatch.setattr(report_module._Process, "pid", report_module.os.getpid() + 1)
    try:
        reporter.offer(1, None, None)
        manager.wait_for(1)
        reporter.offer(2, None, None)
        report_module.flush()
        assert manager.steps == [1]
    finally:
        reporter.close()
