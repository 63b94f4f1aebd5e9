"""Elastic clusters: grow and shrink the worker job of a running cluster (issue 32).

``clusterflow scale ID --workers N`` calls ``manager.scale`` (``ScaleRequest``, ``ScaleReply``). Its
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

What a resize does depends on what the workers' job declared (``manager.declare``,
``ScaleView.resizable``); the manager knows nothing else of a job:

- **Declared resizable** (``resizable: true``): the workers of a parameter-server
  strategy, which hold nothing the others need (sync ones without embedding tables:
  their steps follow the membership ``ps_membership.py`` sends the ps tasks), a
  ``ClusterCoordinator``'s workers, and all-reduce workers trained through ``fit`` on
  the data service or a ``TrainingSession``, which re-form their group at a step
  boundary (``strategies/resizing.py``). They resize live, as above.
- **Declared nothing**: a worker that never called ``manager.declare`` runs no
  clusterflow strategy, an unmodified torchrun script (plain DDP, FSDP) that cannot
  re-form its group. The resize restarts every task at the new size, as torchrun's
  elastic mode does: every task is killed, the workers are added or removed while none
  runs, and all are launched again through the whole-restart path of a failure
  (``Recovery._relaunch_all``) with ``WORLD_SIZE``/``RANK`` of the new size,
  ``TORCHELASTIC_RESTART_COUNT`` one higher, and the newest checkpoint (the script's
  own, which it reloads; clusterflow's, with the data cursor, when it wrote one). It
  does not count against ``--max-restarts``: nothing failed (torchrun does not count
  a membership change either).
- **Declared, but not resizable** (``resizable`` false or not said): a pipeline, whose
  stage count is the model's cut (its strategy declares at once, when it is built), a
  sync ps with embedding tables (each table shard decides its own steps), or
  all-reduce outside ``fit`` on the data service and a ``TrainingSession``.
  ``scale`` is refused with one line and the cluster runs on untouched.

Until a worker declares (before its job's first step), a job is one that declared
nothing: a ``scale`` that early restarts it, which any job survives.
``Controller`` mixes ``Elastic`` in; the state it acts on is the controller's.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from clusterflow.backends import kinds
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import ManagerMethod
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.manager import ps_membership
from clusterflow.manager.registry import TERMINAL, ClusterDir, effective_status
from clusterflow.manager.state import MembershipChange
from clusterflow.rpc import Credentials, Request, RpcClient
from clusterflow.rpc.errors import CodedError
from clusterflow.server.manager_messages import ScaleReply, ScaleRequest

if TYPE_CHECKING:
    from clusterflow.backends.api import Backend
    from clusterflow.data.dispatcher import DispatcherService
    from clusterflow.manager.config import RunConfig
    from clusterflow.manager.output import OutputRouter
    from clusterflow.manager.policy import Verdict
    from clusterflow.manager.rendezvous import Rendezvous
    from clusterflow.manager.tasks import TaskRecord, TaskTable

log = logging.getLogger(__name__)

GROWTH_STANDBYS_MAX = 4
"""The most warm standbys kept for the next grow (each idles at a few hundred MB: a
zygote with torch imported); a grow beyond them starts its other newcomers cold."""

SCALE_DEADLINE_S = 300.0
"""How long ``clusterflow scale`` waits for the manager's answer: the new tasks'
registration (bounded by the registration timeout) or the leaving ones' grace period."""


class ScaleRefused(CodedError):
    """A scale request the manager will not carry out; the cluster is untouched."""

    wire_code = "scale_refused"


class GrowFailed(CodedError):
    """A grow whose newcomer could not be launched: it left again (``lost``), the
    newcomers after it were never added, and the cluster runs on at the size it
    reached (the message says which)."""

    wire_code = "grow_failed"


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
    """Whether the workers' job resizes live: True when every worker that called
    ``manager.declare`` said ``resizable``; False when one declared and did not say so;
    None when none declared (an unmodified script, or before the first step): a resize
    then restarts every task at the new size."""


def check_scale(view: ScaleView, workers: int) -> None:
    """Refuses a request to run ``workers`` worker tasks that the cluster cannot take.

    A job that declared nothing (``view.resizable`` None) is taken: it will be
    restarted at the new size rather than resized live.

    Raises:
        ScaleRefused: not running, a fixed size, outside MIN:MAX, or a job whose workers
            declared that they do not resize; the message is one line naming the value.
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
    if view.resizable is False:
        raise ScaleRefused(
            f"the workers of {name} have not declared that they resize live: their job "
            "keeps its size (a pipeline's stage count is the model's cut; a sync ps with "
            "embedding tables keeps it; all-reduce resizes only through fit on the data "
            "service or a TrainingSession)"
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
    _restarts: int
    _grace_s: float
    _wake: threading.Event
    _stop_requested: bool

    if TYPE_CHECKING:

        def _launch(self, task: TaskRecord, restore: str | None, *, warm: bool = False) -> None: ...

        def _choose_checkpoint(self, *, restore_data: bool) -> str | None: ...

        def _relaunch_all(
            self, said: str, *, between: Callable[[], None] | None = None, **event: Any
        ) -> None: ...

        def _write_state(self, state: Any = None) -> None: ...

    def _init_elastic(self) -> None:
        self._workers_min = self.config.workers
        """MIN of an elastic cluster (``config.workers`` follows the size it runs at)."""
        self.scale_ceiling: int | None = None
        """The size a user's ``clusterflow scale`` last asked for: the most the growth
        watcher (Ray) grows to from then on, so a shrink by hand is not undone by the
        next free node; None: MAX."""
        self._scale_lock = threading.Lock()  # one change at a time
        self._scale_cond = threading.Condition()
        self._scale_pending: tuple[int, bool] | None = None
        """The size asked for, and whether to restart every task to reach it."""
        self._scale_result: tuple[list[TaskId], list[TaskId]] | None = None
        self._scale_failure: str | None = None
        """Why the last grow stopped short (a newcomer's launch failed), for its reply."""
        self._restart_changes: list[tuple[TaskId, str, int | None]] = []
        """Who joined or left in a resizing restart, and the step then: recorded in
        the history once the new barrier assembles (the first spec that holds them)."""
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

    def growth_size(self) -> tuple[int, int]:
        """The worker tasks now and the most the growth watcher (Ray) may grow to: MAX,
        or the size a user's ``clusterflow scale`` last asked for, so a shrink by hand
        stays until the user asks again (``scale_ceiling``)."""
        high = self.config.workers_max or len(self.tasks.workers())
        ceiling = self.scale_ceiling
        return len(self.tasks.workers()), min(high, ceiling) if ceiling else high

    def _scale_view(self) -> ScaleView:
        workers = [r for r in self.tasks.values() if r.id.job == "worker"]
        declared = [r.resizable is True for r in workers if r.declared]
        return ScaleView(
            cluster_id=self.cluster.id,
            status=self._status,
            workers=len(workers),
            workers_range=self.workers_range(),
            resizable=(all(declared) if declared else None),
        )

    def _grows_warm(self) -> bool:
        """Whether a grow's newcomers may come from warm standbys: only where the tasks
        are this machine's processes. Ray places a grow's tasks itself, all or none per
        change (``Backend.reserve``); a standby started ahead of it would hold a node's
        resources the grow did not place, and run where the grow did not put it."""
        kind = kinds.find(self.config.backend)
        return kind is not None and kind.tasks_here and not kind.placed_by_ray

    def _growth_standbys(self) -> int:
        """Warm standbys to keep for the next grow: one per worker it may still add (to
        MAX, or the size a user's ``scale`` last asked for), at most
        ``GROWTH_STANDBYS_MAX``. Only once the workers declared that they resize live
        (a job that restarts to resize starts every task anyway, and a run that never
        grows pays nothing before its first step) and while the cluster runs."""
        if self.config.workers_max is None or self._status != "running":
            return 0
        if not self._grows_warm() or self._scale_view().resizable is not True:
            return 0
        now, most = self.growth_size()
        return max(0, min(most - now, GROWTH_STANDBYS_MAX))

    def _step(self) -> int | None:
        """The furthest training step any task reported."""
        steps = [r.figures.get("step") for r in self.tasks.values()]
        numbers = [s for s in steps if isinstance(s, int)]
        return max(numbers) if numbers else None

    def _record_membership(
        self, task: TaskId, change: str, version: int, *, step: int | None = None
    ) -> None:
        entry = MembershipChange(
            time=time.time(),
            task=str(task),
            change=change,
            spec_version=version,
            step=self._step() if step is None else step,
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
        effect (``ScaleReply``; ``restarted``: every task was restarted at the new size,
        a job that declared nothing). A body of another shape is ``MalformedBody``."""
        try:
            asked = ScaleRequest.from_wire(request.body)
        except ConfigError as exc:  # a shape error is MalformedBody, raised as it is
            raise ScaleRefused(str(exc)) from None
        wanted = asked.workers
        with self._scale_lock:
            view = self._scale_view()
            check_scale(view, wanted)
            joined: list[TaskId] = []
            left: list[TaskId] = []
            restart = view.resizable is None
            changes = wanted != len(self.tasks.workers())
            if changes:
                try:  # the newcomers' room, placed per change before anything changes (Ray)
                    self.backend.reserve(_newcomers(self.tasks.workers(), wanted))
                except ConfigError as exc:
                    raise ScaleRefused(str(exc)) from None
            if not asked.automatic:  # granted: the user's size caps the watcher from now on
                self.scale_ceiling = wanted
            if changes:
                with self._scale_cond:
                    self._scale_pending, self._scale_result = (wanted, restart), None
                self._wake.set()
                joined, left = self._await_scale()
                failure, self._scale_failure = self._scale_failure, None
                if failure is not None:
                    raise GrowFailed(failure)
            return ScaleReply(
                workers=len(self.tasks.workers()),
                spec_version=self.rendezvous.version,
                joined=tuple(str(t) for t in joined),
                left=tuple(str(t) for t in left),
                restarted=restart and bool(joined or left),
            ).to_wire()

    def _await_scale(self) -> tuple[list[TaskId], list[TaskId]]:
        """Waits for the loop to apply the change and for every new task to register
        (after a resizing restart: for the new barrier to assemble).

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
            assembled = self.rendezvous.spec is not None
            return assembled and all(r is None or r.status != "joining" for r in joiners)

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
            pending, self._scale_pending = self._scale_pending, None
        if pending is None:
            return
        wanted, restart = pending
        if restart:
            self._restart_resized(wanted)
            return
        workers = self.tasks.workers()
        joined: list[TaskId] = []
        left: list[TaskId] = []
        if wanted > len(workers):
            top = (workers[-1].index + 1) if workers else 0
            restore = self._choose_checkpoint(restore_data=False)
            added = range(top, top + wanted - len(workers))
            ps_membership.joining(self, [TaskId("worker", i) for i in added])  # before launch
            failure: str | None = None
            for index in added:
                task = TaskId("worker", index)
                if failure is not None:  # announced to the ps and reserved, never added
                    ps_membership.leaving(self, task)
                    self.backend.release(task)
                    continue
                record = self.tasks.add(
                    task, tracked=self.config.is_tracked(task), restarts=self._departed.get(task, 0)
                )
                self.rendezvous.admit(task)
                self._resized()
                try:
                    self._launch(record, restore, warm=self._grows_warm())
                except Exception as exc:  # the grow stops here; the running tasks go on
                    log.warning("%s could not be launched: %s", task, exc)
                    self.cluster.append_event("launch_failed", task=str(task), reason=str(exc))
                    self._leave(record, "lost")
                    failure = f"{task} could not be launched ({exc})"
                    continue
                joined.append(task)
            if joined:
                self.output.line(f"clusterflow: adding {', '.join(map(str, joined))}")
            if failure is not None:
                self._scale_failure = (
                    f"cluster {self.cluster.id}: {failure}; it runs "
                    f"{len(self.tasks.workers())} workers"
                    + (f" (added {', '.join(map(str, joined))})" if joined else "")
                )
        else:
            for task in reversed(workers[wanted:]):
                self._leave(self.tasks[task], "left")
                left.append(task)
        self._write_state()
        with self._scale_cond:
            self._scale_result = (joined, left)
            self._scale_cond.notify_all()

    def _restart_resized(self, wanted: int) -> None:
        """Resizes a job whose workers declared nothing (an unmodified torchrun script:
        it cannot re-form its group): every task restarts at ``wanted`` workers from the
        newest checkpoint, through the whole-restart path of a failure. Not counted in
        ``restarts`` (the ``--max-restarts`` budget): nothing failed."""
        before = len(self.tasks.workers())
        joined: list[TaskId] = []
        left: list[TaskId] = []
        step = self._step()

        def change_members() -> None:
            # Every task is dead here and the barrier reopened: no spec to publish.
            workers = self.tasks.workers()
            if wanted > len(workers):
                top = (workers[-1].index + 1) if workers else 0
                # The group's restart count, so every rank sees the same one (each
                # relaunch below adds one); never below a departed namesake's (fences).
                count = max((r.restarts for r in self.tasks.values()), default=0)
                for index in range(top, top + wanted - len(workers)):
                    task = TaskId("worker", index)
                    restarts = max(count, self._departed.get(task, 0))
                    self.tasks.add(task, tracked=self.config.is_tracked(task), restarts=restarts)
                    self.rendezvous.admit(task)
                    joined.append(task)
            for task in reversed(workers[wanted:]):
                # Its killed launch was fenced at the dispatcher one above its count
                # (``_fence_data``): a namesake must start at that bar, not under it.
                fenced = self.data.fences.highest(str(task)) or 0
                self._departed[task] = max(self.tasks.remove(task).restarts, fenced)
                self.rendezvous.dismiss(task)
                left.append(task)
            self._resized()
            self._restart_changes = [
                *((t, "joined", step) for t in joined),
                *((t, "left", step) for t in left),
            ]

        reason = (
            f"clusterflow scale: {before} -> {wanted} workers, and the workers' job did not "
            "declare that it resizes live"
        )
        log.info("%s: restarting every task at the new size", reason)
        self._relaunch_all(
            f"{reason}; restarting every task at {wanted} workers from the newest checkpoint",
            between=change_members,
            reason=reason,
            restarts=self._restarts,
            workers=wanted,
        )
        with self._scale_cond:
            self._scale_result = (joined, left)
            self._scale_cond.notify_all()

    def _restart_assembled(self) -> None:
        """The barrier of a resizing restart assembled: its joins and departures enter
        the history at this spec version, the first that holds them."""
        changes, self._restart_changes = self._restart_changes, []
        for task, change, step in changes:
            self._record_membership(task, change, self.rendezvous.version, step=step)
        self._joined()

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
        """``config.workers`` follows the size the cluster runs at; MIN stays in
        ``_workers_min``. (The ranks of a task's environment come from the spec it is
        answered with, ``job_env.rank_of``: dense over the members whatever their
        indexes.)"""
        self.config = replace(self.config, workers=len(self.tasks.workers()))


def _newcomers(workers: list[TaskId], wanted: int) -> list[TaskId]:
    """The tasks a grow to ``wanted`` adds: the next indexes above the highest one (as
    ``_apply_scale`` names them); none for a shrink."""
    top = (workers[-1].index + 1) if workers else 0
    return [TaskId("worker", i) for i in range(top, top + wanted - len(workers))]


# The CLI's side ------------------------------------------------------------------------


def scale_cluster(cluster: ClusterDir, workers: int) -> ScaleReply:
    """``clusterflow scale``: asks the cluster's manager for ``workers`` worker tasks
    (a Ray cluster's mirror refreshed first by the caller: its manager's address).

    Returns the manager's answer, once the change took effect.

    Raises:
        ConfigError: bad input, the cluster untouched: ``workers`` below 1, a cluster
            that is not running or on a backend that does not resize (``kinds``), or
            one the manager refused
            (``check_scale``).
        RpcError: the manager did not answer in time; ``MalformedBody``: its answer
            broke the contract.
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
            reply = client.call(ManagerMethod.SCALE, request.to_wire()).body
        except ScaleRefused as exc:
            raise ConfigError(str(exc)) from None
        except GrowFailed as exc:  # not bad input: the cluster changed, and says how
            raise ClusterflowError(str(exc)) from None
    return ScaleReply.from_wire(reply)
