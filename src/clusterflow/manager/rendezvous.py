"""The registration barrier and the versions of the cluster spec.

Each supervisor's ``manager.register`` call is held here (on a blocking handler) until
every task has registered, and is then answered with the assembled spec, so every task
starts its job with the same spec version. A whole restart opens a new barrier. A task
respawned alone registers while the others run: if it came back on another address, the
spec gets a new version (``ClusterSpec.with_address``); whatever connects to that
task reads the new spec through ``manager.spec`` once the task stops answering at its
old address (docs/architecture.md section 3).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.errors import ClusterflowError


class RegistrationError(ClusterflowError):
    """A supervisor's registration was refused (unknown task, cluster stopping, too late)."""


class Arrival(enum.Enum):
    """What a registration did."""

    WAITING = "waiting"
    """It joined the barrier; others are still missing."""
    ASSEMBLED = "assembled"
    """It was the last one: the spec is assembled (a new version)."""
    REJOINED = "rejoined"
    """A respawned task came back on its old address: the spec stands."""
    MOVED = "moved"
    """A respawned task came back on a new address: a new spec version."""
    JOINED = "joined"
    """A task added to a running cluster (``clusterflow scale``) registered: a new spec
    version holds it."""


class Rendezvous:
    """The barrier of one cluster's tasks and its spec versions (thread-safe).

    Args:
        tasks: every task of the cluster.
        timeout_s: how long a barrier may wait for the last registration.
        clock: a monotonic clock (tests pass their own).
    """

    def __init__(
        self,
        tasks: Sequence[TaskId],
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tasks = sorted(tasks)
        self._members = frozenset(self._tasks)
        self._timeout_s = timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._addresses: dict[TaskId, str] = {}
        self._spec: ClusterSpec | None = None
        self._version = 0
        self._opened = clock()
        self._closed = False

    @property
    def spec(self) -> ClusterSpec | None:
        """The current spec; None while a barrier is open."""
        with self._cond:
            return self._spec

    @property
    def version(self) -> int:
        """Grows by one at every assembly and every move; never goes back."""
        with self._cond:
            return self._version

    def current(self) -> tuple[ClusterSpec | None, int]:
        with self._cond:
            return self._spec, self._version

    def size(self, job: str) -> int:
        """Tasks of ``job`` in the current spec: the membership as the tasks see it, so a
        task admitted but not registered yet is not counted (two newcomers of one grow
        make the job 3, then 4). While a barrier is open: its members."""
        with self._cond:
            if self._spec is None:
                return sum(1 for t in self._tasks if t.job == job)
            return self._spec.num_tasks(job) if job in self._spec.jobs else 0

    def overdue(self) -> bool:
        """Whether the open barrier has waited longer than the registration timeout."""
        with self._cond:
            return self._spec is None and self._clock() - self._opened > self._timeout_s

    def reopen(self) -> None:
        """A new barrier, for a whole restart: every task registers anew."""
        with self._cond:
            self._spec = None
            self._addresses.clear()
            self._opened = self._clock()

    def admit(self, task: TaskId) -> None:
        """``task`` joins the cluster (an elastic cluster grows): it may register now,
        and its registration publishes a spec that holds it (``Arrival.JOINED``)."""
        with self._cond:
            if task not in self._members:
                self._tasks = sorted([*self._tasks, task])
                self._members = frozenset(self._tasks)

    def dismiss(self, task: TaskId) -> int:
        """``task`` left the cluster (it was stopped): the spec drops it, at a new version
        when it was in the current one. Returns the version that no longer holds it."""
        with self._cond:
            self._tasks = [t for t in self._tasks if t != task]
            self._members = frozenset(self._tasks)
            self._addresses.pop(task, None)
            if self._spec is not None and task in self._spec:
                self._publish(self._spec.without(task))
            return self._version

    def close(self) -> None:
        """Releases every registration still held: the cluster is stopping."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def register(self, task: TaskId, address: str, *, respawned: bool) -> Arrival:
        """Records where ``task`` listens.

        Args:
            respawned: the task was relaunched alone, or added (``admit``), while the
                others run.

        Raises:
            RegistrationError: ``task`` is not part of the cluster, or the cluster stops.
        """
        if task not in self._members:
            raise RegistrationError(f"task {task} is not part of this cluster")
        with self._cond:
            if self._closed:
                raise RegistrationError("the cluster is stopping")
            if self._spec is None:
                self._addresses[task] = address
                # only members get here: counting them is the O(1) "all arrived?"
                if len(self._addresses) < len(self._members):
                    return Arrival.WAITING
                # by index: a job that lost a task above its MIN has a hole (sparse)
                jobs: dict[str, dict[int, str]] = {}
                for t in self._tasks:
                    jobs.setdefault(t.job, {})[t.index] = self._addresses[t]
                self._publish(ClusterSpec(jobs))
                return Arrival.ASSEMBLED
            if respawned and task not in self._spec:
                self._addresses[task] = address
                self._publish(self._spec.with_task(task, address))
                return Arrival.JOINED
            if not respawned or self._addresses.get(task) == address:
                return Arrival.REJOINED
            self._addresses[task] = address
            self._publish(self._spec.with_address(task, address))
            return Arrival.MOVED

    def wait(self, stopping: Callable[[], bool]) -> tuple[ClusterSpec, int]:
        """Blocks until the barrier completes; returns the spec and its version.

        Waits at most until the registration timeout of the open barrier.

        Raises:
            RegistrationError: not every task registered in time, or the cluster stops
                (``close``, or ``stopping()`` turned true).
        """
        with self._cond:
            while self._spec is None and not (self._closed or stopping()):
                left = self._opened + self._timeout_s - self._clock()
                if left <= 0 or (not self._cond.wait(min(left, 1.0)) and self.overdue()):
                    raise RegistrationError("not every task registered in time")
            if self._spec is None or self._closed:
                raise RegistrationError("the cluster is stopping")
            return self._spec, self._version

    def _publish(self, spec: ClusterSpec) -> None:
        """Called with the lock held."""
        self._spec = spec
        self._version += 1
        self._cond.notify_all()
