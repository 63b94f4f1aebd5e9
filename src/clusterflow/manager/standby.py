"""The standby pool: warm supervisors waiting to replace a task that may die alone, or
to become the newcomers of an elastic cluster's next grow.

A standby (``backends/supervisor.py``, ``CLUSTERFLOW_STANDBY=1``) starts a zygote with
torch imported and one tiny step taken, then waits here in ``manager.standby`` (bounded
rounds). When a respawnable task dies, or ``clusterflow scale`` adds a worker, the
controller hands the task to a standby: it registers as that task and its zygote runs
the job in-process, about 0.2 s instead of about 5 s for a cold start
(docs/architecture.md section 3). The controller says how many to keep
(``Recovery._keep_standby``); the pool starts the missing ones and ends the surplus.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from clusterflow.backends.api import Backend, TaskLaunch, TaskProcess
from clusterflow.cluster import TaskId
from clusterflow.manager.output import Label, OutputRouter
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.state import StandbyState
from clusterflow.server.manager_messages import StandbyReply

log = logging.getLogger(__name__)

DEFAULT_WAIT_S = 20.0
"""A standby's round at the manager when it names none."""
MAX_WAIT_S = 60.0
"""The longest round: a standby must learn within a minute that its manager is gone."""


@dataclass(slots=True)
class _Standby:
    process: TaskProcess
    label: Label | None
    waiting: bool = False
    """Its ``manager.standby`` call is held here: it can take a task at once."""
    task: str | None = None
    """The task it was given; None while it waits."""


class StandbyPool:
    """Keeps a number of standby supervisors, and hands them tasks (thread-safe).

    Args:
        backend: where the standby runs.
        output: follows its output (first as ``standby``, then as its task's).
        cluster: the cluster's folder (task logs, events).
        stopping: true once the cluster stops: waiting standbys are told to exit.
        on_change: told when what ``state()`` returns changed.
    """

    def __init__(
        self,
        backend: Backend,
        output: OutputRouter,
        cluster: ClusterDir,
        *,
        stopping: Callable[[], bool],
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._backend = backend
        self._output = output
        self._cluster = cluster
        self._stopping = stopping
        self._on_change = on_change
        self._cond = threading.Condition()
        self._standbys: list[_Standby] = []
        """Oldest first: the oldest is the warmest, so it is handed out first."""
        self._handed: dict[int, str] = {}
        """Standbys (by pid) given a task before they asked for one."""
        self._closed = False

    def keep(self, launch: Callable[[], TaskLaunch] | None, count: int = 1) -> None:
        """Keeps ``count`` standbys alive while ``launch`` is given (a respawn or a grow
        may come); ends the idle ones above ``count``.

        ``launch`` builds a standby's launch (its environment names the manager);
        None says no standby is needed now (nothing respawnable, no restarts left, no
        room to grow).
        """
        wanted = count if launch is not None else 0
        with self._cond:
            # One that died (killed by a user?) is replaced.
            self._standbys = [s for s in self._standbys if s.process.poll() is None]
            surplus = self._standbys[wanted:]
            self._standbys = self._standbys[:wanted]
            missing = 0 if self._closed else wanted - len(self._standbys)
            if surplus:
                self._cond.notify_all()  # a held call of one ended here answers ``exit``
        for standby in surplus:
            standby.process.signal(signal.SIGKILL)  # idle: it holds nothing to lose
            standby.process.wait(5.0)
        if surplus:
            self._on_change()
        for _ in range(missing):
            assert launch is not None
            self._start(launch())

    def _start(self, launch: TaskLaunch) -> None:
        process = self._backend.launch(launch)
        label = None
        if process.output is not None:
            label = self._output.follow(
                "standby", process.output, self._cluster.task_log("standby")
            )
        with self._cond:
            self._standbys.append(_Standby(process, label))
        log.info("standby supervisor started (pid %d)", process.pid)
        self._on_change()

    def count(self) -> int:
        """The standbys kept now (warming or waiting)."""
        with self._cond:
            return len(self._standbys)

    def hand(self, task: str, assign: Callable[[TaskProcess], None]) -> TaskProcess | None:
        """Gives ``task`` to the standby, if one runs; returns its process, or None.

        ``assign`` makes the process the task's before the standby is woken: the standby
        registers at once, and the manager refuses a registration from a pid that is not
        the task's current process (on Ray, ``adopt`` below took long enough for the
        standby to be refused).
        """
        with self._cond:
            live = [s for s in self._standbys if s.process.poll() is None]
            if not live:
                return None
            # The oldest: even one still warming up beats a cold start (a head start).
            standby = live[0]
            assign(standby.process)
            standby.task = task
            standby.waiting = False
            self._standbys.remove(standby)
            self._handed[standby.process.pid] = task
            self._cond.notify_all()
        self._backend.adopt(standby.process, TaskId.parse(task))
        if standby.label is not None:
            standby.label.rename(task, self._cluster.task_log(task))
        self._cluster.append_event("standby_took_over", task=task, pid=standby.process.pid)
        self._on_change()
        return standby.process

    def wait(self, pid: int, wait_s: float | None) -> StandbyReply:
        """A standby's ``manager.standby`` call: held until it is given a task.

        Returns the task, no task (the round ended: ask again) or word to exit (not the
        standby kept here, or the cluster stops).
        """
        seconds = float(wait_s) if wait_s else DEFAULT_WAIT_S
        deadline = time.monotonic() + min(max(seconds, 0.1), MAX_WAIT_S)
        changed = False
        try:
            with self._cond:
                handed = self._handed.pop(pid, None)
                if handed is not None:
                    return StandbyReply(task=handed)  # given a task while it was still warming up
                standby = self._find(pid)
                if standby is None:
                    return StandbyReply(exit=True)  # not (or no longer) a standby kept here
                if not standby.waiting:
                    standby.waiting = changed = True
                while standby.task is None and not (self._closed or self._stopping()):
                    if standby not in self._standbys:
                        return StandbyReply(exit=True)  # a surplus one, ended by ``keep``
                    if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                        break
                if standby.task is not None:
                    self._handed.pop(standby.process.pid, None)
                    return StandbyReply(task=standby.task)
                if self._closed or self._stopping():
                    return StandbyReply(exit=True)
                return StandbyReply()
        finally:
            if changed:
                self._on_change()

    def _find(self, pid: int) -> _Standby | None:
        return next((s for s in self._standbys if s.process.pid == pid), None)

    def state(self) -> StandbyState | None:
        """The oldest standby's (the one a respawn takes first), with how many are kept
        and warm; None when none is kept."""
        with self._cond:
            if not self._standbys:
                return None
            standby = self._standbys[0]
            return StandbyState(
                pid=standby.process.pid,
                ready=standby.waiting,
                kept=len(self._standbys),
                ready_count=sum(s.waiting for s in self._standbys),
            )

    def close(self) -> None:
        """Releases waiting standbys and kills the idle ones (they hold nothing to lose)."""
        with self._cond:
            self._closed = True
            standbys, self._standbys = self._standbys, []
            self._cond.notify_all()
        for standby in standbys:
            standby.process.signal(signal.SIGKILL)
        for standby in standbys:
            standby.process.wait(5.0)
