"""How the manager recovers a cluster: respawn one task, or restart them all.

The actions behind ``policy.decide``'s ``RESPAWN`` and ``RESTART`` verdicts, apart from
the loop that decides them (``controller.py``): launching a task's supervisor (through
a warm standby when it may be respawned alone), killing the tasks being replaced,
fencing the dead incarnation at the dispatcher and every ps before its replacement
starts, and choosing the checkpoint every relaunched task restores, with the data
cursor of the same cut on a whole restart (docs/failure-semantics.md).
``Controller`` mixes it in; the state it acts on is the controller's (declared below).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from clusterflow.backends import forkserver, kinds
from clusterflow.backends.api import Backend, TaskLaunch, TaskProcess
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import ENV_STANDBY
from clusterflow.manager.fences import fence_ps_tasks

if TYPE_CHECKING:
    from clusterflow.data.dispatcher import DispatcherService
    from clusterflow.manager.config import RunConfig
    from clusterflow.manager.output import OutputRouter
    from clusterflow.manager.policy import Verdict
    from clusterflow.manager.registry import ClusterDir
    from clusterflow.manager.rendezvous import Rendezvous
    from clusterflow.manager.restore import RestorePoints
    from clusterflow.manager.standby import StandbyPool
    from clusterflow.manager.state import ClusterState
    from clusterflow.manager.store_host import StoreHost
    from clusterflow.manager.tasks import TaskRecord, TaskTable

log = logging.getLogger(__name__)

DRAIN_S = 5.0
"""How long a whole restart waits, for all its tasks together, for the killed
incarnations' data requests being served (handlers take a lock and return: in practice
none is, or it ends in microseconds)."""


class Recovery:
    """Respawns and whole restarts, on the controller's state."""

    cluster: ClusterDir
    config: RunConfig
    backend: Backend
    tasks: TaskTable
    output: OutputRouter
    rendezvous: Rendezvous
    standby: StandbyPool
    restore_points: RestorePoints
    data: DispatcherService
    _restarts: int
    _memory_restarts: int
    _attempt: int
    _status: str
    _store: StoreHost | None
    _spare_store: StoreHost | None
    _new_store: Callable[[bool], StoreHost]

    if TYPE_CHECKING:

        def _task_env(self, task: TaskId) -> dict[str, str]: ...

        def _record_exit(self, task: TaskRecord, code: int, *, stopped: bool = False) -> None: ...

        def _write_state(self, state: ClusterState | None = None) -> None: ...

        def _growth_standbys(self) -> int: ...

    def _launch(self, task: TaskRecord, restore: str | None, *, warm: bool = False) -> None:
        """Starts ``task``'s supervisor (again), following its output into its log.

        A warm standby takes it when one is kept and the task may be respawned alone, or
        ``warm`` says it may (a grow's newcomer, ``Elastic._apply_scale``; every task
        of a whole restart under ``--warm-restarts``)."""
        task.restore = restore
        if task.respawnable or warm:

            def assign(process: TaskProcess) -> None:
                task.process = process

            if self.standby.hand(str(task.id), assign) is not None:
                return
        task.process = self.backend.launch(TaskLaunch(task=task.id, env=self._task_env(task.id)))
        if task.process.output is not None:
            self.output.follow(
                str(task.id), task.process.output, self.cluster.task_log(str(task.id))
            )

    def _keep_standby(self) -> None:
        """Keeps warm standby supervisors: one while a respawn may still be needed, one
        per task while a whole restart may (``--warm-restarts``), and those an elastic
        cluster's next grow may take (``Elastic._growth_standbys``); and, while any of
        them may come, has the warm fork server import what their jobs will
        (``forkserver.preload_later``).

        A respawn's only once a job declared a task respawnable (so runs that restart
        everything pay nothing) and only while restarts remain; a restart's once the
        attempt's spec is assembled (its jobs run), while restarts remain. They are
        started while training runs: their torch import then costs the running tasks
        CPU once, instead of costing a replacement or a newcomer its start-up (on a
        machine with no core to spare, the jobs' own start pays it under
        ``--warm-restarts``: docs/benchmarks.md, "Recovery by phase").
        """
        first = next((t for t in self.tasks.values() if t.respawnable), None)
        restarts_left = (
            self.rendezvous.spec is not None and self._restarts < self.config.max_restarts
        )
        respawn = first is not None and restarts_left
        restart = len(self.tasks) if restarts_left and self._warm_restarts() else 0
        count = max(int(respawn), restart) + self._growth_standbys()
        grows = self.rendezvous.spec is not None and self.config.workers_max is not None
        if restarts_left or grows or count:
            # A restart's, respawn's or grow's forks may come: the warm server imports
            # what their jobs will (seconds of CPU), now that the launch is done.
            forkserver.preload_later()
        # a standby registers as a task of the job it may replace (its command, its env)
        task = first.id if first is not None else next(iter(self.tasks.workers()), None)
        task = task if task is not None else next(iter(self.tasks), None)
        if not count or task is None:
            self.standby.keep(None)
            return
        self.standby.keep(
            lambda: TaskLaunch(task=task, env={**self._task_env(task), ENV_STANDBY: "1"}),
            count,
        )
        store = self._store
        if restart and store is not None and store.started and self._spare_store is None:
            # The next attempt's store, up before it is needed (torch imported).
            self._spare_store = self._new_store(True)

    def _warm_restarts(self) -> bool:
        """``--warm-restarts``, where the tasks are not placed by Ray (a restart there is
        placed anew, and a standby would run outside that placement)."""
        return self.config.warm_restarts and not kinds.named(self.config.backend).placed_by_ray

    def _kill(self, tasks: list[TaskRecord]) -> None:
        """SIGKILL at once: every committed checkpoint is a consistent cut, so nothing is
        gained by waiting for a task being replaced (and a hung one would not listen)."""
        for task in tasks:
            if task.process is not None and task.exit_code is None:
                task.process.signal(signal.SIGKILL)
        for task in tasks:
            if task.process is not None and task.exit_code is None:
                code = task.process.wait(10.0)
                self._record_exit(task, -signal.SIGKILL if code is None else code, stopped=True)

    def _respawn(self, verdict: Verdict) -> None:
        """Relaunches the dead task alone; it rejoins at the next spec version."""
        task = self.tasks[TaskId.parse(str(verdict.failed_task))]
        self._restarts += 1
        self._kill([task])  # it may be hung rather than gone
        self.data.release_worker(str(task.id))
        log.info("%s; respawning it (restart %d)", verdict.reason, self._restarts)
        self.output.line(f"clusterflow: {verdict.reason}; respawning it")
        self.cluster.append_event(
            "task_respawned", task=str(task.id), reason=verdict.reason, restarts=self._restarts
        )
        self.tasks.relaunching(task)
        self.data.fences.raise_to(str(task.id), task.restarts)  # the old one is a zombie now
        fence_ps_tasks(self.cluster, self.config, self.rendezvous.current()[0], task)
        self._launch(task, self._choose_checkpoint(restore_data=False))
        self._write_state()

    def _restart_all(self, verdict: Verdict) -> None:
        """Stops every task and relaunches them all from the last committed checkpoint
        (after a kill for memory: with more memory, not counted in ``restarts``)."""
        if verdict.memory:
            self._memory_restarts += 1
        else:
            self._restarts += 1
        log.info("%s; restarting every task (restart %d)", verdict.reason, self._restarts)
        more = " with more memory" if verdict.memory else ""
        self._relaunch_all(
            f"{verdict.reason}; restarting every task{more}",
            task=verdict.failed_task,
            reason=verdict.reason,
            restarts=self._restarts,
            memory=verdict.memory,
        )

    def _relaunch_all(
        self, said: str, *, between: Callable[[], None] | None = None, **event: Any
    ) -> None:
        """A whole restart: kills every task, then (``between``, while none runs) lets
        the caller change who the tasks are, and launches them all again at a new
        attempt, each one's restart count one higher (``TORCHELASTIC_RESTART_COUNT``),
        from the newest checkpoint with the data cursor of the same cut. ``said`` goes
        to the output, ``event`` into the ``cluster_restarted`` event.

        The one path for a failure's restart and for resizing a job that cannot resize
        live (``Elastic._restart_resized``): the new barrier, the fresh store, the
        checkpoint and the new incarnations are the same for both.
        """
        self._attempt += 1
        live = [t for t in self.tasks.values() if t.exit_code is None]
        self._kill(live)
        self._fence_data(list(self.tasks.values()))
        self.output.line(f"clusterflow: {said}")
        # A new barrier: the restarted supervisors register anew (new addresses), and
        # the registration timeout counts afresh.
        self.rendezvous.reopen()
        self._status = "restarting"
        if between is not None:
            between()
        for task in self.tasks.values():
            task.address = None
        if self._store is not None:
            # A fresh store: the old one holds the dead incarnation's rendezvous keys.
            # Started at once when the old one was used: the ranks will connect again.
            used = self._store.started
            self._store.close()
            spare, self._spare_store = self._spare_store, None  # --warm-restarts: up already
            self._store = spare if spare is not None else self._new_store(used)
        restore = self._choose_checkpoint(restore_data=True)
        self.cluster.append_event("cluster_restarted", **event, checkpoint=restore)
        for task in self.tasks.values():
            self.tasks.relaunching(task)
            self._launch(task, restore, warm=self._warm_restarts())
        self._write_state()

    def _fence_data(self, tasks: list[TaskRecord]) -> None:
        """Refuses, at the dispatcher, every request of ``tasks``' killed incarnations.

        A request a task sent just before it was killed can still wait in the manager's
        queue. A task's new incarnation raises the bar itself with its first request,
        but until then nothing would refuse the old one's: served against the restored
        cursor, a lease would lend splits to a process that no longer runs (held until
        the new incarnation's first lease hands them back, or until the lease deadline
        if it never asks), and an ack or a release would act on a cursor it never saw.
        So each task's bar goes to the incarnation its relaunch will carry
        (``relaunching`` adds one) before the cursor is touched, as a respawn's does;
        the call returns once no request of an older incarnation is being served, or
        after ``DRAIN_S`` for all of them together.
        """
        end = time.monotonic() + DRAIN_S
        for task in tasks:
            left = max(0.0, end - time.monotonic())
            busy = self.data.fences.raise_to(str(task.id), task.restarts + 1, left)
            if busy:
                log.warning("%s: %d requests of its killed incarnation still served", task.id, busy)

    def _choose_checkpoint(self, *, restore_data: bool) -> str | None:
        """The step every (re)launched task restores; with ``restore_data`` the data
        service's cursor is reset to that checkpoint's (or to nothing, without one), so
        the data position and the parameters come from the same cut."""
        point = self.restore_points.newest(with_cursor=restore_data)
        if point.problem is not None:
            self.output.line(f"clusterflow: {point.problem}")
        if restore_data:
            self.data.reset(point.cursor)
        return point.step
