"""What the manager does next, as a pure function of a snapshot of the cluster.

Kept free of processes and I/O so every rule is unit-tested on plain values (the
controller/policy split of Ray Train v2). The fault-tolerance issue adds restarts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Decision(StrEnum):
    CONTINUE = "continue"
    """Nothing to do; poll again."""
    SUCCEED = "succeed"
    """Every tracked task exited 0: stop the untracked ones and exit 0."""
    FAIL = "fail"
    """A task failed: stop the others and exit non-zero naming it."""
    STOP = "stop"
    """The user asked to stop (Ctrl-C, ``clusterflow stop``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskStatus:
    task: str
    """``job:index``."""
    tracked: bool
    """Whether the run waits for this task to exit (jobs not in ``--untracked``)."""
    exit_code: int | None
    """None while running; negative for death by signal, as Popen reports it."""
    heartbeat_age_s: float | None = None
    """Seconds since the last heartbeat from its supervisor; None before its command ran."""
    error: str | None = None
    """Why the task's command could not run, as its supervisor reported it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterStatus:
    tasks: tuple[TaskStatus, ...]
    stop_requested: bool = False
    registration_overdue: bool = False
    """Not every task registered within the registration timeout."""
    heartbeat_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    failed_task: str | None = None
    exit_code: int = 0
    reason: str = ""


def decide(status: ClusterStatus) -> Verdict:
    """The decision for one poll of the controller loop."""
    if status.stop_requested:
        return Verdict(Decision.STOP, exit_code=130, reason="stop requested")
    for task in status.tasks:
        if task.exit_code is not None and task.exit_code != 0:
            reason = f"task {task.task} {describe_exit(task.exit_code)}"
            if task.error:
                reason += f": {task.error}"
            return Verdict(Decision.FAIL, task.task, exit_code_of(task.exit_code), reason)
        if task.exit_code is None and (task.heartbeat_age_s or 0.0) > status.heartbeat_timeout_s:
            return Verdict(
                Decision.FAIL,
                task.task,
                1,
                f"task {task.task} missed heartbeats for {task.heartbeat_age_s:.0f}s",
            )
    if status.registration_overdue:
        return Verdict(Decision.FAIL, exit_code=1, reason="not every task registered in time")
    tracked = [t for t in status.tasks if t.tracked]
    if tracked and all(t.exit_code == 0 for t in tracked):
        return Verdict(Decision.SUCCEED)
    return Verdict(Decision.CONTINUE)


def exit_code_of(code: int) -> int:
    """The manager's own exit code for a task's: signals map to 128+N, like a shell."""
    if code < 0:
        return 128 + (-code)
    return min(code, 255) or 1


def describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
