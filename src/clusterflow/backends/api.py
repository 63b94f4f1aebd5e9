"""What a backend is: it starts a task's supervisor somewhere and lets the manager watch it.

The manager talks to tasks' supervisors over RPC (registration, heartbeats, exit), so a
backend only has to start a process with an environment, stream its output, report its
exit and deliver signals. ``local`` uses subprocesses; the Ray backend (later) actors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Protocol

from clusterflow.cluster import TaskId

REPLICA_TAG = b"\x1f"
"""Frames the replica index at the start of a replica's output line (``\x1f1\x1f...``):
a task running several replicas relays their output through its own, and the manager's
output router turns the tag into the prefix ``[worker:0/1]``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskLaunch:
    """How to start one task's supervisor (the spec; ``TaskProcess`` is the instance)."""

    task: TaskId
    env: Mapping[str, str]
    """The supervisor's whole environment: it finds the manager and its secret there."""


class TaskProcess(Protocol):
    """A started supervisor (with the job command below it)."""

    @property
    def task(self) -> TaskId: ...

    @property
    def pid(self) -> int: ...

    @property
    def output(self) -> IO[bytes] | None:
        """Merged stdout and stderr of the supervisor and its job, or None if not streamed."""
        ...

    def poll(self) -> int | None:
        """The exit code once the supervisor ended (negative: killed by that signal)."""
        ...

    @property
    def memory_kill(self) -> bool:
        """It was killed for outgrowing its memory request, and a relaunch can ask for
        more (the manager then restarts it with more instead of counting a failure)."""
        ...

    def wait(self, timeout: float) -> int | None:
        """Blocks up to ``timeout`` seconds for the exit; None if still running."""
        ...

    def signal(self, signum: int) -> None:
        """Delivers ``signum`` to the supervisor and everything it started."""
        ...


class Backend(Protocol):
    name: str

    def launch(self, launch: TaskLaunch) -> TaskProcess:
        """Starts the task's supervisor; returns at once (registration comes later)."""
        ...

    def adopt(self, process: TaskProcess, task: TaskId) -> None:
        """A standby (launched earlier) took ``task`` over: ``process`` now runs it."""
        ...

    def reserve(self, tasks: Sequence[TaskId]) -> None:
        """A grow will launch ``tasks``: hold their room now, all or none (Ray places
        them as one placement group; a backend that places nothing does nothing).
        Called before the change touches the cluster.

        Raises:
            ConfigError: they cannot be placed (one line); nothing is held.
        """
        ...

    def release(self, task: TaskId) -> None:
        """``task`` left the cluster (after it stopped): what was held for it goes."""
        ...

    def job_env(self, task: TaskId) -> Mapping[str, str]:
        """What this backend adds to ``task``'s job environment (its GPUs), whichever
        supervisor runs it (a standby's too)."""
        ...
