"""Live figures: ``report`` reaches the manager's ``task.report``, rate-limited, never raising."""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from clusterflow.rpc import Credentials, Request, RpcServer
from clusterflow.train.report import METHOD, Reporter, report

# The package exports the function under the module's name: reach the module itself.
report_module = sys.modules["clusterflow.train.report"]

pytestmark = pytest.mark.timeout(30)


class Manager:
    """An RpcServer standing in for the manager: records every report."""

    def __init__(self, *, serve: bool = True) -> None:
        self.credentials = Credentials.generate()
        self.server = RpcServer(self.credentials, name="fake-manager")
        self.bodies: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        if serve:
            self.server.register(METHOD, self._on_report)
        self.server.start()

    def _on_report(self, request: Request) -> dict[str, Any]:
        with self.arrived:
            self.bodies.append(request.body)
            self.arrived.notify_all()
        return {}

    def wait_for(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.bodies) >= count, timeout), self.bodies
            return list(self.bodies)

    def env(self) -> dict[str, str]:
        return {
            "CLUSTERFLOW_MANAGER": self.server.address,
            "CLUSTERFLOW_SECRET": self.credentials.to_hex(),
            "CLUSTERFLOW_TASK": "worker:1",
        }


@pytest.fixture
def manager() -> Iterator[Manager]:
    fake = Manager()
    yield fake
    fake.server.stop()


class Interval(threading.Event):
    """The reporter's stop event, whose timed wait (the pause of ``interval_s`` after a
    send) is held until the test opens it: what a pause lets through is then decided by
    the test, not by how fast either thread runs. ``close()`` (``set``) still ends it."""

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()
        self.pauses: list[float] = []
        self.opened = 0

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return super().wait()
        with self.cond:
            self.pauses.append(timeout)
            self.cond.notify_all()
            n = len(self.pauses)
            self.cond.wait_for(lambda: self.opened >= n or self.is_set(), 10)
        return self.is_set()

    def set(self) -> None:
        super().set()
        with self.cond:
            self.cond.notify_all()

    def wait_paused(self, count: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.pauses) >= count, 10), self.pauses

    def open(self) -> None:
        with self.cond:
            self.opened += 1
            self.cond.notify_all()


class Wake(threading.Event):
    """The reporter's wake event, counting the times its thread went back to wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        with self.cond:
            self.waits += 1
            self.cond.notify_all()
        return super().wait(timeout)


def test_the_newest_figures_arrive_at_most_once_per_interval(manager: Manager) -> None:
    reporter = Reporter.from_env(manager.env())
    assert reporter is not None
    # Swapped before the first offer, while the thread has nothing to send.
    interval, wake, parked_on = Interval(), Wake(), reporter._wake
    reporter._stop, reporter._wake = interval, wake
    parked_on.set()  # wake it from the old event: it waits on the new one from then on
    reporter._interval = 0.3
    try:
        reporter.offer(1, torch.tensor(2.5), 100.0)
        first = manager.wait_for(1)[0]
        assert first == {"task": "worker:1", "step": 1, "loss": 2.5, "samples_per_s": 100.0}
        interval.wait_paused(1)  # the pause after the first send holds the thread now
        for step in range(2, 50):
            reporter.offer(step, None, None)
        assert len(manager.bodies) == 1  # held back by the interval: nothing sent in it
        interval.open()
        bodies = manager.wait_for(2)
        # The 48 offers of one interval collapsed into one send, of the newest figures.
        assert bodies[1] == {"task": "worker:1", "step": 49, "loss": None, "samples_per_s": None}
        interval.wait_paused(2)
        assert interval.pauses == [0.3, 0.3]  # each pause is the interval
        with wake.cond:
            waits = wake.waits
        interval.open()
        with wake.cond:  # back to waiting for an offer; a spurious wake sends nothing
            assert wake.cond.wait_for(lambda: wake.waits > waits, 10)
            waits = wake.waits
        wake.set()
        with wake.cond:
            assert wake.cond.wait_for(lambda: wake.waits > waits, 10)
        assert len(manager.bodies) == 2 and len(interval.pauses) == 2  # nothing new offered
    finally:
        reporter.close()


def test_outside_a_cluster_report_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Reporter.from_env({}) is None
    monkeypatch.delenv("CLUSTERFLOW_MANAGER", raising=False)
    monkeypatch.setattr(report_module._Process, "resolved", False)
    monkeypatch.setattr(report_module._Process, "reporter", None)
    threads = threading.active_count()
    report(step=1, loss=0.5, samples_per_s=10.0)
    assert report_module._Process.reporter is None
    assert threading.active_count() == threads


def test_report_uses_the_process_reporter_from_the_environment(
    manager: Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in manager.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(report_module._Process, "resolved", False)
    monkeypatch.setattr(report_module._Process, "reporter", None)
    try:
        report(step=7, loss=1.25, samples_per_s=3.0)
        assert manager.wait_for(1)[0]["step"] == 7
    finally:
        reporter = report_module._Process.reporter
        if reporter is not None:
            reporter.close()


def test_a_manager_without_the_method_is_logged_once_and_left_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = Manager(serve=False)
    reporter = Reporter.from_env(old.env())
    assert reporter is not None
    try:
        with caplog.at_level(logging.INFO, logger="clusterflow.train.report"):
            reporter.offer(1, 0.5, 1.0)
            reporter._thread.join(5)
            reporter.offer(2, 0.4, 1.0)  # left alone: not sent, nothing logged again
        assert not reporter._thread.is_alive()  # it stopped asking
        assert caplog.text.count("takes no live figures") == 1, caplog.text
    finally:
        reporter.close()
        old.server.stop()


def test_an_unreachable_manager_never_raises_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A socket bound but not listening: held for the whole test, so nobody else can
    # listen there, and every send runs into its deadline.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{held.getsockname()[1]}"
        reporter = Reporter(
            address, Credentials.generate(), "worker:0", interval_s=0.01, deadline_s=0.3
        )
        release = threading.Event()
        finished = threading.Condition()
        attempts: list[BaseException | None] = []
        send = reporter._link.report

        def counted(**figures: Any) -> None:
            release.wait(10)  # the first send is held until the offers below returned
            try:
                send(**figures)
            except BaseException as exc:
                with finished:
                    attempts.append(exc)
                    finished.notify_all()
                raise
            with finished:
                attempts.append(None)
                finished.notify_all()

        reporter._link.report = counted  # type: ignore[method-assign]
        try:
            with caplog.at_level(logging.WARNING, logger="clusterflow.train.report"):
                for step in range(3):
                    reporter.offer(step, float("nan"), None)
                # offer() returned three times while the send was held: it never waits.
                assert attempts == []
                release.set()
                with finished:
                    assert finished.wait_for(lambda: len(attempts) == 1, 10)
                reporter.offer(9, 1.0, None)
                with finished:  # the second send ran into its deadline too
                    assert finished.wait_for(lambda: len(attempts) == 2, 10)
            assert all(isinstance(exc, Exception) for exc in attempts), attempts
            assert caplog.text.count("could not report live figures") == 1
        finally:
            release.set()
            reporter.close()
