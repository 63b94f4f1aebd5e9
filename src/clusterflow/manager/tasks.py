"""The manager's record of its tasks: what each is doing and what its job reported.

RPC handler threads (heartbeats, reports, declarations) write here while the
controller's loop reads; one lock guards it all, and ``take_changed`` tells the loop
whether ``state.json`` needs rewriting.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterflow.backends.api import TaskProcess
from clusterflow.cluster import TaskId
from clusterflow.errors import ClusterflowError
from clusterflow.manager.config import RunConfig
from clusterflow.manager.policy import TaskStatus
from clusterflow.manager.rendezvous import RegistrationError
from clusterflow.manager.state import FIGURES, TaskState


@dataclass(slots=True)
class TaskRecord:
    id: TaskId
    tracked: bool
    process: TaskProcess | None = None
    address: str | None = None
    exit_code: int | None = None
    exited_at: float | None = None
    """When its exit was recorded (monotonic clock)."""
    last_heartbeat: float | None = None
    """When the supervisor last reported; set once its command is released to run."""
    status: str = "starting"
    error: str | None = None
    """Why the supervisor could not run the command (from ``manager.exited``)."""
    declared: bool = False
    """Its job called ``manager.declare`` (it trains through clusterflow's strategies);
    an unmodified script (plain DDP, FSDP) never does (``elastic.ScaleView``)."""
    respawnable: bool = False
    """Its job declared it can be relaunched alone (``manager.declare``)."""
    resizable: bool | None = None
    """Its job declared whether the cluster may resize around it (``manager.declare``;
    the workers of an asynchronous parameter-server strategy); None: not said."""
    restarts: int = 0
    """Times this task was relaunched (alone or with every task)."""
    restore: str | None = None
    """The checkpoint its job restores from, chosen when it was launched."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Live figures its job reported (``task.report``): step, loss, samples/s."""
    step_changed: float | None = None
    """When the reported step last advanced (stall detection)."""


class TaskTable(Mapping[TaskId, TaskRecord]):
    """Every task of the cluster, in canonical order (a read-only mapping by id)."""

    def __init__(self, config: RunConfig) -> None:
        self.lock = threading.Condition()
        self._records = {t: TaskRecord(t, config.is_tracked(t)) for t in config.tasks()}
        self._by_name = {str(t): r for t, r in self._records.items()}
        """Records by canonical name (``"worker:3"``): what supervisors send, found
        without parsing (a heartbeat is the manager's most frequent call)."""
        self._changed = False

    def __getitem__(self, task: TaskId) -> TaskRecord:
        return self._records[task]

    def __iter__(self) -> Iterator[TaskId]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def find(self, name: Any) -> TaskRecord:
        """The record of the task a request names.

        Raises:
            RegistrationError: not a task name, or not a task of this cluster.
        """
        record = self._by_name.get(name) if isinstance(name, str) else None
        if record is not None:
            return record
        try:
            record = self._records.get(TaskId.parse(str(name)))
        except ClusterflowError as exc:
            raise RegistrationError(f"bad task {name!r}: {exc}") from exc
        if record is None:
            raise RegistrationError(f"task {name!r} is not part of this cluster")
        return record

    def add(self, task: TaskId, *, tracked: bool, restarts: int = 0) -> TaskRecord:
        """A task joins a running cluster (``clusterflow scale``): status ``joining``
        until it registers. ``restarts`` carries the count of an earlier task of the
        same name, so the fences raised for that one do not refuse this one."""
        record = TaskRecord(task, tracked, status="joining", restarts=restarts)
        with self.lock:
            self._records = dict(sorted({**self._records, task: record}.items()))
            self._by_name[str(task)] = record
            self._changed = True
        return record

    def remove(self, task: TaskId) -> TaskRecord:
        """A task left the cluster (it was stopped): it is no longer waited for, watched
        or shown. Call from the controller's loop, which alone iterates the table."""
        with self.lock:
            records = dict(self._records)
            record = records.pop(task)
            self._records = records
            self._by_name.pop(str(task), None)
            self._changed = True
        return record

    def workers(self) -> list[TaskId]:
        """The worker tasks, by index."""
        return [t for t in self._records if t.job == "worker"]

    def changed(self) -> None:
        with self.lock:
            self._changed = True

    def take_changed(self) -> bool:
        """Whether anything changed since the last call."""
        with self.lock:
            changed, self._changed = self._changed, False
            return changed

    # What handlers record ----------------------------------------------------------

    def heartbeat(self, name: Any) -> None:
        """A supervisor is alive; an unknown name is ignored (a stale supervisor)."""
        with contextlib.suppress(RegistrationError):
            self.find(name).last_heartbeat = time.monotonic()

    def declare(
        self, record: TaskRecord, *, respawnable: bool, resizable: bool | None = None
    ) -> None:
        with self.lock:
            record.declared = True
            record.respawnable = respawnable
            if resizable is not None:
                record.resizable = resizable
            self._changed = True

    def report(self, record: TaskRecord, body: Mapping[str, Any]) -> None:
        """Live figures from a job; what is not a number is left out."""
        figures = {
            k: body[k]
            for k in FIGURES
            if isinstance(body.get(k), int | float) and not isinstance(body.get(k), bool)
        }
        with self.lock:
            step = figures.get("step")
            if step is not None and step != record.figures.get("step"):
                record.step_changed = time.monotonic()
            record.figures.update(figures)
            self._changed = True

    def failed_to_run(self, name: Any, error: str) -> None:
        """Why a supervisor could not run its command (one line, at most 500 chars)."""
        with contextlib.suppress(ClusterflowError):
            record = self._records.get(TaskId.parse(str(name)))
            if record is not None:
                with self.lock:
                    record.error = error[:500]

    # What the controller records ---------------------------------------------------

    def registered(self, record: TaskRecord, address: str, *, running: bool) -> None:
        """At the barrier (``running`` False) or back from a respawn while others run."""
        with self.lock:
            record.address = address
            record.status = "running" if running else "registered"
            if running:
                record.last_heartbeat = time.monotonic()
            self._changed = True

    def all_running(self) -> None:
        """The barrier completed: heartbeats are due from now on (waiting at the barrier
        is bounded by the registration timeout instead)."""
        now = time.monotonic()
        with self.lock:
            for record in self._records.values():
                record.status = "running"
                record.last_heartbeat = now
            self._changed = True

    def exited(self, record: TaskRecord, code: int, *, stopped: bool) -> bool:
        """Records an exit; False if one was recorded already."""
        with self.lock:
            if record.exit_code is not None:
                return False
            record.exit_code = code
            record.exited_at = time.monotonic()
            record.status = "stopped" if stopped else ("succeeded" if code == 0 else "failed")
            self._changed = True
            return True

    def relaunching(self, record: TaskRecord) -> None:
        """Forgets what the last incarnation reported; counts the restart."""
        with self.lock:
            record.exit_code = None
            record.exited_at = None
            record.error = None
            record.last_heartbeat = None
            record.step_changed = None
            record.figures = {}
            record.status = "restarting"
            record.restarts += 1
            self._changed = True

    # What the loop reads -----------------------------------------------------------

    def statuses(self) -> tuple[TaskStatus, ...]:
        """Frozen snapshots for ``policy.decide``."""
        now = time.monotonic()
        with self.lock:
            return tuple(
                TaskStatus(
                    task=str(t.id),
                    tracked=t.tracked,
                    exit_code=t.exit_code,
                    exit_age_s=None if t.exited_at is None else now - t.exited_at,
                    trailing=t.id.job == "evaluator",
                    heartbeat_age_s=None if t.last_heartbeat is None else now - t.last_heartbeat,
                    error=t.error,
                    respawnable=t.respawnable,
                    step_age_s=None if t.step_changed is None else now - t.step_changed,
                    memory_kill=t.exit_code is not None
                    and t.process is not None
                    and t.process.memory_kill,
                    resizable=t.resizable is True,
                )
                for t in self._records.values()
            )

    def states(self) -> tuple[TaskState, ...]:
        """What ``state.json`` shows of each task."""
        with self.lock:
            return tuple(
                TaskState(
                    task=str(t.id),
                    tracked=t.tracked,
                    status=t.status,
                    address=t.address,
                    pid=t.process.pid if t.process else None,
                    exit_code=t.exit_code,
                    restarts=t.restarts,
                    **{k: t.figures[k] for k in FIGURES if k in t.figures},
                )
                for t in self._records.values()
            )
