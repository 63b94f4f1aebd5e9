"""Elastic clusters: grow and shrink the worker job of a running cluster (issue 32).

``clusterflow scale ID --workers N`` calls ``manager.scale`` (``ScaleRequest``). Its
handler judges the request on a frozen view of the cluster (``check_scale``, pure, so
every refusal is unit-tested without processes) and hands it to the controller's loop,
which alone changes the task table; the handler answers once the change took effect
(every new task registered), so the CLI's answer names the spec version that holds it.

- **Growth** adds worker tasks at new indexes (above the highest one) and launches
  them; each registers while the others run and its registration publishes a spec
  version that holds it (``Arrival.JOINED``). The tasks that stay are not touched.
- **Shrinking** stops the highest-indexed workers (SIGTERM, SIGKILL after the grace
  period), and only once each is gone returns its data-service leases to the
  dispatcher, which lends them again: a split it had pushed but not acked is a
  duplicate at every ps that applied it, so no record is lost or applied twice
  (docs/failure-semantics.md, "Elastic clusters"). The spec drops it at a new version.
- **Loss above MIN**: a worker that dies with no restart left, while the cluster holds
  more than MIN workers, leaves the same way (``Decision.SHRINK``); the others go on.

Only jobs whose workers said so at their first step resize (``manager.declare``'s
``resizable``: the workers of a parameter-server strategy, which hold nothing the
others need (sync ones without embedding tables: their steps follow the membership
``ps_membership.py`` sends the ps tasks), and all-reduce workers trained through ``fit`` on the data
service or a ``TrainingSession``, which re-form their group at a step boundary:
``strategies/resizing.py``); a cluster whose workers did not (pipeline stages, sync
ps with tables) keeps its size, and ``scale`` on it is refused with one line.
``Controller`` mixes ``Elastic`` in; the state it acts on is the controller's.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import ManagerMethod, ScaleRequest
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.manager import ps_membership
from clusterflow.manager.registry import TERMINAL, ClusterDir, effective_status
from clusterflow.manager.state import MembershipChange
from clusterflow.rpc import Credentials, Request, RpcClient
from clusterflow.rpc.errors import CodedError

if TYPE_CHECKING:
    from clusterflow.backends.api import Backend
    from clusterflow.data.dispatcher import DispatcherService
    from clusterflow.manager.config import RunConfig
    from clusterflow.manager.output import OutputRouter
    from clusterflow.manager.policy import Verdict
    from clusterflow.manager.rendezvous import Rendezvous
    from clusterflow.manager.tasks import TaskRecord, TaskTable

log = logging.getLogger(__name__)

SCALE_DEADLINE_S = 300.0
"""How long ``clusterflow scale`` waits for the manager's answer: the new tasks'
registration (bounded by the registration timeout) or the leaving ones' grace period."""


class ScaleRefused(CodedError):
    """A scale request the manager will not carry out; the cluster is untouched."""

    wire_code = "scale_refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleView:
    """What ``check_scale`` judges a request by: the cluster now."""

    cluster_id: str
    status: str
    workers: int
    """Worker tasks now."""
    workers_range: tuple[int, int] | None
    """MIN and MAX (``--workers MIN:MAX``); None: a fixed size."""
    resizable: bool | None
    """Whether the workers' job resizes live: True once a worker declared it and none
    declared otherwise; None before any worker declared (before their first step)."""


def check_scale(view: ScaleView, workers: int) -> None:
    """Refuses a request to run ``workers`` worker tasks that the cluster cannot take.

    Raises:
        ScaleRefused: not running, a fixed size, outside MIN:MAX, or a job that does
            not resize live; the message is one line naming the value.
    """
    name = f"cluster {view.cluster_id}"
    if view.status != "running":
        raise ScaleRefused(f"{name} is {view.status}: it can be resized only while it runs")
    if view.workers_range is None:
        raise ScaleRefused(
            f"{name} has a fixed size of {view.workers} worker(s): start it with "
            "--workers MIN:MAX to resize it"
        )
    low, high = view.workers_range
    if not low <= workers <= high:
        raise ScaleRefused(
            f"--workers {workers} is outside the range {low}:{high} of {name} "
            f"(it runs {view.workers} now)"
        )
    if view.resizable is not True:
        raise ScaleRefused(
            f"the workers of {name} have not declared that they resize live: only "
            "parameter-server workers (sync ones without embedding tables), and all-reduce "
            "workers trained through fit on the data service or a TrainingSession, do (at "
            "their first step); pipeline clusters and sync ps clusters with embedding "
            "tables keep their size"
        )


class Elastic:
    """``manager.scale`` and the membership changes, on the controller's state."""

    cluster: ClusterDir
    config: RunConfig
    backend: Backend
    tasks: TaskTable
    output: OutputRouter
    rendezvous: Rendezvous
    data: DispatcherService
    _status: str
    _grace_s: float
    _wake: threading.Event
    _stop_requested: bool

    if TYPE_CHECKING:

        def _launch(self, task: TaskRecord, restore: str | None) -> None: ...

        def _choose_checkpoint(self, *, restore_data: bool) -> str | None: ...

        def _write_state(self, state: Any = None) -> None: ...

    def _init_elastic(self) -> None:
        self._workers_min = self.config.workers
        """MIN of an elastic cluster (``config.workers`` follows the size it runs at)."""
        self._scale_lock = threading.Lock()  # one change at a time
        self._scale_cond = threading.Condition()
        self._scale_pending: int | None = None
        self._scale_result: tuple[list[TaskId], list[TaskId]] | None = None
        self._membership: list[MembershipChange] = []
        self._departed: dict[TaskId, int] = {}
        """Restarts of each task that left, carried by a later task of its name: the
        fences raised for the old one must not refuse the new one."""

    # The view and the history ------------------------------------------------------

    def workers_range(self) -> tuple[int, int] | None:
        high = self.config.workers_max
        return None if high is None else (self._workers_min, high)

    def membership(self) -> tuple[MembershipChange, ...]:
        return tuple(self._membership)

    def _scale_view(self) -> ScaleView:
        declared = [r.resizable for r in self.tasks.values() if r.id.job == "worker"]
        known = [d for d in declared if d is not None]
        return ScaleView(
            cluster_id=self.cluster.id,
            status=self._status,
            workers=len(declared),
            workers_range=self.workers_range(),
            resizable=(all(known) if known else None),
        )

    def _record_membership(self, task: TaskId, change: str, version: int) -> None:
        steps = [r.figures.get("step") for r in self.tasks.values()]
        numbers = [s for s in steps if isinstance(s, int)]
        entry = MembershipChange(
            time=time.time(),
            task=str(task),
            change=change,
            spec_version=version,
            step=max(numbers) if numbers else None,
            workers=self.rendezvous.size("worker"),
        )
        self._membership.append(entry)
        self.tasks.changed()
        self.cluster.append_event(
            f"worker_{change}",
            task=entry.task,
            spec_version=version,
            step=entry.step,
            workers=entry.workers,
        )
        log.info("%s %s at spec version %d (%d workers)", task, change, version, entry.workers)

    # The request -------------------------------------------------------------------

    def _on_scale(self, request: Request) -> dict[str, Any]:
        """``manager.scale``: checks, hands the change to the loop, answers once it took
        effect: ``{"workers", "spec_version", "joined", "left"}``."""
        try:
            wanted = ScaleRequest.from_body(request.body).workers
        except ConfigError as exc:
            raise ScaleRefused(str(exc)) from None
        with self._scale_lock:
            check_scale(self._scale_view(), wanted)
            joined: list[TaskId] = []
            left: list[TaskId] = []
            if wanted != len(self.tasks.workers()):
                try:  # the newcomers' room, placed per change before anything changes (Ray)
                    self.backend.reserve(_newcomers(self.tasks.workers(), wanted))
                except ConfigError as exc:
                    raise ScaleRefused(str(exc)) from None
                with self._scale_cond:
                    self._scale_pending, self._scale_result = wanted, None
                self._wake.set()
                joined, left = self._await_scale()
            return {
                "workers": len(self.tasks.workers()),
                "spec_version": self.rendezvous.version,
                "joined": [str(t) for t in joined],
                "left": [str(t) for t in left],
            }

    def _await_scale(self) -> tuple[list[TaskId], list[TaskId]]:
        """Waits for the loop to apply the change and for every new task to register.

        Raises:
            ClusterflowError: the cluster stopped first, or a new task did not register
                within the registration timeout (the failure policy then acts on it).
        """
        deadline = time.monotonic() + self.config.register_timeout_s + self._grace_s + 10.0

        def done() -> bool:
            result = self._scale_result
            if result is None:
                return False
            joiners = [self.tasks.get(t) for t in result[0]]
            return all(r is None or r.status != "joining" for r in joiners)

        with self._scale_cond:
            while not done():
                if self._stop_requested or self._status in TERMINAL:
                    raise ClusterflowError(f"cluster {self.cluster.id} stopped while resizing")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClusterflowError(
                        f"cluster {self.cluster.id}: the new workers did not register in time"
                    )
                self._scale_cond.wait(min(left, 0.2))
            assert self._scale_result is not None
            return self._scale_result

    def _joined(self) -> None:
        """A new task registered (called by the registration handler)."""
        with self._scale_cond:
            self._scale_cond.notify_all()

    # The loop's side ---------------------------------------------------------------

    def _apply_scale(self) -> None:
        """Carries out a pending ``scale`` (the loop calls it once per poll)."""
        with self._scale_cond:
            wanted, self._scale_pending = self._scale_pending, None
        if wanted is None:
            return
        workers = self.tasks.workers()
        joined: list[TaskId] = []
        left: list[TaskId] = []
        if wanted > len(workers):
            top = (workers[-1].index + 1) if workers else 0
            restore = self._choose_checkpoint(restore_data=False)
            added = range(top, top + wanted - len(workers))
            ps_membership.joining(self, [TaskId("worker", i) for i in added])  # before launch
            for index in added:
                task = TaskId("worker", index)
                record = self.tasks.add(
                    task, tracked=self.config.is_tracked(task), restarts=self._departed.get(task, 0)
                )
                self.rendezvous.admit(task)
                self._resized()
                self._launch(record, restore)
                joined.append(task)
            self.output.line(f"clusterflow: adding {', '.join(map(str, joined))}")
        else:
            for task in reversed(workers[wanted:]):
                self._leave(self.tasks[task], "left")
                left.append(task)
        self._write_state()
        with self._scale_cond:
            self._scale_result = (joined, left)
            self._scale_cond.notify_all()

    def _lose(self, verdict: Verdict) -> None:
        """A dead worker above MIN with no restart left leaves the cluster; the others
        go on (``Decision.SHRINK``)."""
        record = self.tasks[TaskId.parse(str(verdict.failed_task))]
        log.info("%s", verdict.reason)
        self.cluster.append_event("task_lost", task=str(record.id), reason=verdict.reason)
        self._leave(record, "lost")
        self._write_state()

    def _leave(self, record: TaskRecord, change: str) -> None:
        """``record``'s task leaves the cluster: stopped if it runs, its leases returned,
        out of the table and of the spec (a new version)."""
        self.output.line(f"clusterflow: {record.id} leaves the cluster ({change})")
        process = record.process
        if process is not None and record.exit_code is None:
            record.status = "stopping"
            process.signal(signal.SIGTERM)
            code = process.wait(self._grace_s)
            if code is None:
                process.signal(signal.SIGKILL)
                code = process.wait(5.0)
            process.signal(signal.SIGKILL)  # what its job left in its process group
            self.tasks.exited(record, -signal.SIGKILL if code is None else code, stopped=True)
        # Only now that it is gone: a split it pushed but did not ack is lent again and
        # is a duplicate at every ps that applied it (exactly once, per split).
        returned = self.data.release_worker(str(record.id))
        if returned:
            self.cluster.append_event("leases_returned", task=str(record.id), leases=returned)
        self.tasks.remove(record.id)
        self.backend.release(record.id)  # what the backend held for it (Ray: its group)
        ps_membership.leaving(self, record.id)  # gone: no sync step waits for it
        self._departed[record.id] = record.restarts
        self._resized()
        self._record_membership(record.id, change, self.rendezvous.dismiss(record.id))

    def _resized(self) -> None:
        """``config.workers`` follows the size the cluster runs at (the ranks of a new
        task's environment count the workers); MIN stays in ``_workers_min``."""
        self.config = replace(self.config, workers=len(self.tasks.workers()))


def _newcomers(workers: list[TaskId], wanted: int) -> list[TaskId]:
    """The tasks a grow to ``wanted`` adds: the next indexes above the highest one (as
    ``_apply_scale`` names them); none for a shrink."""
    top = (workers[-1].index + 1) if workers else 0
    return [TaskId("worker", i) for i in range(top, top + wanted - len(workers))]


# The CLI's side ------------------------------------------------------------------------


def scale_cluster(cluster: ClusterDir, workers: int) -> dict[str, Any]:
    """``clusterflow scale``: asks the cluster's manager for ``workers`` worker tasks
    (a Ray cluster's mirror refreshed first by the caller: its manager's address).

    Returns the manager's answer (``workers``, ``spec_version``, ``joined``, ``left``).

    Raises:
        ConfigError: bad input, the cluster untouched: ``workers`` below 1, a cluster
            that is not running or on a backend that does not resize (``kinds``), or
            one the manager refused
            (``check_scale``).
        RpcError: the manager did not answer in time.
    """
    from clusterflow.backends import kinds

    request = ScaleRequest(workers=workers)
    backend = cluster.read_config().get("backend") or kinds.LOCAL.name
    kind = kinds.find(backend)
    if kind is None or not kind.resizable:
        raise ConfigError(
            f"cluster {cluster.id} runs on {backend!r}, whose clusters keep their size"
        )
    state = cluster.read_state()
    status = effective_status(state)
    if status in TERMINAL or status == "stale" or state.manager is None:
        raise ConfigError(f"cluster {cluster.id} is not running ({status}): nothing to scale")
    if not state.manager.address:
        raise ConfigError(f"cluster {cluster.id} is {status}: it can be resized once it runs")
    credentials = Credentials.from_file(cluster.secret_file)
    with RpcClient(state.manager.address, credentials, deadline=SCALE_DEADLINE_S) as client:
        try:
            reply = client.call(ManagerMethod.SCALE, request.to_body()).body
        except ScaleRefused as exc:
            raise ConfigError(str(exc)) from None
    return dict(reply) if isinstance(reply, dict) else {}
