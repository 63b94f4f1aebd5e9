"""Live figures: each task tells the manager its step, loss and samples/s.

``clusterflow ps`` and ``describe`` show what tasks report here. Reporting must never
cost training anything: ``report`` only stores the newest figures (an assignment), and a
daemon thread sends the newest ones at most once a second, each call with a short
deadline. A manager that is down, slow or too old to know ``task.report`` is logged
once and otherwise ignored. Outside a cluster (no ``CLUSTERFLOW_MANAGER``) nothing
happens at all: no thread, no socket.

The rate limit must not cost the last figures: a run shorter than the interval would
otherwise leave its first report as what ``ps``, ``describe`` and the dashboard show
for good. ``flush`` sends the newest figures at once; ``fit`` and ``TrainingSession``
call it when they end, and the process calls it at exit (for loops of one's own).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, Final

from clusterflow.cluster.contract import ENV_MANAGER, ManagerMethod
from clusterflow.data.env import default_worker_name
from clusterflow.rpc import Credentials, RemoteError
from clusterflow.server.manager_link import ManagerLink

__all__ = ["METHOD", "Reporter", "flush", "report"]

_log = logging.getLogger(__name__)

METHOD: Final = ManagerMethod.REPORT
"""The manager's method that takes a task's figures."""
INTERVAL_S: Final = 1.0
"""At most one report a second: the display refreshes about that often."""
DEADLINE_S: Final = 2.0
"""A report not answered by then is dropped; the next one carries newer figures anyway."""


class Reporter:
    """Sends the newest figures of one task to the manager, from a daemon thread.

    The sending goes through the task's ``ManagerLink``, the one client of the manager's
    job-facing methods; this class adds the rate limit and the rule that nothing of it
    ever reaches the training loop.

    Args:
        address: the manager's ``host:port``.
        credentials: the cluster's secret.
        task: this task's name, e.g. ``worker:0``.
        interval_s: the least time between two sends.
        deadline_s: how long one send may wait for the manager's answer.
    """

    def __init__(
        self,
        address: str,
        credentials: Credentials,
        task: str,
        *,
        interval_s: float = INTERVAL_S,
        deadline_s: float = DEADLINE_S,
    ) -> None:
        self.address = address
        self.task = task
        self._link = ManagerLink(address, credentials, task, deadline_s=deadline_s)
        self._interval = interval_s
        self._deadline = deadline_s
        self._latest: tuple[int, Any, Any] | None = None
        self._sent: tuple[int, Any, Any] | None = None
        # One send at a time, by the thread or by flush: the manager then takes them in
        # order, and the newest one sent is the one it keeps.
        self._sending = threading.Lock()
        self._gone = False  # the manager takes no reports: nothing is sent any more
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="clusterflow-report", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Reporter | None:
        """The reporter of a task started by ``clusterflow start``; None outside a cluster."""
        address = environ.get(ENV_MANAGER)
        if not address:
            return None
        try:
            credentials = Credentials.from_env(dict(environ))
        except Exception as exc:  # a bad secret must not stop training over a display
            _log.warning("live figures off: cannot read the cluster's credentials: %s", exc)
            return None
        if credentials is None:
            _log.warning("live figures off: %s is set but no cluster secret is", ENV_MANAGER)
            return None
        return cls(address, credentials, default_worker_name(environ))

    def offer(self, step: int, loss: Any, samples_per_s: Any) -> None:
        """Keeps these figures as the newest; the thread sends them within ``interval_s``.

        ``loss`` may be a tensor: it is converted on the sending thread, so the training
        loop never waits for a device to read it.
        """
        self._latest = (step, loss, samples_per_s)
        self._wake.set()

    def flush(self) -> None:
        """Sends the newest figures now, unless they were sent already.

        Blocks for one answer of the manager (at most ``deadline_s``, after a send
        already under way). Call once the figures will not change again: at the end
        of training, where the rate limit would hold the last ones back past the exit.
        Never raises; after ``close`` it does nothing.
        """
        self._send_newest()

    def close(self) -> None:
        """Stops the thread (it sends nothing more)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(self._deadline + 1.0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait()
                self._wake.clear()
                if self._send_newest():
                    self._stop.wait(self._interval)
                if self._gone:
                    return
        finally:
            with self._sending:
                self._link.close()

    def _send_newest(self) -> bool:
        """Sends the newest figures if they are new; whether something was sent."""
        with self._sending:
            latest = self._latest
            if self._stop.is_set() or self._gone or latest is None or latest is self._sent:
                return False
            self._sent = latest
            self._gone = not self._send(latest)
            return True

    def _send(self, figures: tuple[int, Any, Any]) -> bool:
        """Sends one report; False when the manager cannot take reports at all."""
        step, loss, rate = figures
        try:
            self._link.report(
                step=int(step),
                loss=None if loss is None else float(loss),
                samples_per_s=None if rate is None else float(rate),
            )
        except RemoteError as exc:
            if exc.code == "not_found":  # a manager without the method: stop asking
                _log.info("the manager at %s takes no live figures (%s)", self.address, exc)
                return False
            self._log_once(exc)
        except Exception as exc:
            self._log_once(exc)
        return True

    def _log_once(self, exc: Exception) -> None:
        if not self._failed:
            self._failed = True
            _log.warning(
                "could not report live figures to the manager at %s (%s); training goes on",
                self.address,
                exc,
            )


def report(*, step: int, loss: Any = None, samples_per_s: float | None = None) -> None:
    """Tells the manager this task's step, loss and samples/s, for ``clusterflow ps``.

    Never raises and never blocks: the figures are sent in the background, at most once
    a second (the newest win). A no-op outside a cluster. ``fit`` and
    ``TrainingSession`` call it after every step; call it from a loop of your own.

    Args:
        step: the global step just finished.
        loss: the step's loss (a float or a one-element tensor), if known.
        samples_per_s: this task's throughput, if known.
    """
    reporter = _current()
    if reporter is not None:
        reporter.offer(step, loss, samples_per_s)


def flush() -> None:
    """Sends this process's newest figures now (see ``Reporter.flush``); never raises.

    ``fit`` and ``TrainingSession`` call it when they end, and it runs at the exit of
    a process that reported, so the last figures are what the manager keeps however
    short the run. A no-op where nothing was reported.
    """
    reporter = _Process.reporter
    if reporter is not None and _Process.pid == os.getpid():  # a fork shares no socket
        try:
            reporter.flush()
        except Exception as exc:  # never into training
            _log.warning("could not send the last live figures: %s", exc)


class _Process:
    """The process's one reporter, made on first use from the environment."""

    lock = threading.Lock()
    reporter: Reporter | None = None
    resolved = False
    pid: int | None = None


def _current() -> Reporter | None:
    if _Process.resolved:
        return _Process.reporter
    with _Process.lock:
        if not _Process.resolved:
            try:
                _Process.reporter = Reporter.from_env(os.environ)
            except Exception as exc:  # never into training
                _log.warning("live figures off: %s", exc)
            if _Process.reporter is not None:
                _Process.pid = os.getpid()
                atexit.register(flush)  # a loop of one's own: its last step too
            _Process.resolved = True
    return _Process.reporter
