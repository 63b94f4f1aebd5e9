"""What the manager does next, as a pure function of a snapshot of the cluster.

Kept free of processes and I/O so every rule is unit-tested on plain values (the
controller/policy split of Ray Train v2).

Failure rules (docs/architecture.md section 6). A task is dead when it exits non-zero, misses
heartbeats past the timeout, or reports steps and then stops advancing past the stall
timeout. While restarts remain (``max_restarts``), a dead task that declared itself
respawnable (a worker of a parameter-server strategy: nobody else holds its state) is
respawned alone; any other death (all-reduce workers, ps, chief) restarts every task
from the last committed checkpoint. Beyond the bound, the run fails naming the task.

Elastic clusters (``--workers MIN:MAX``, issue 32): a worker whose job resizes live
(``TaskStatus.resizable``) that dies when no restart is left, while the cluster holds
more than MIN workers, leaves the cluster (``SHRINK``): the run goes on at the smaller
size and no other task restarts. At MIN, the rules above apply unchanged.

Memory: a task its backend killed for outgrowing its memory request, when a relaunch
can be given more (``TaskStatus.memory_kill``, the Ray backend), restarts every task
(so the placement is made anew, larger) and does not count against ``max_restarts``:
the request was the platform's guess, not the job's fault. It is bounded all the same:
each such restart asks 1.5 times as much, and once a request reaches the largest node's
memory the backend no longer reports a kill as ``memory_kill`` (docs/ray.md).

Success: every tracked task exited 0. A *trailing* task (the evaluator) is waited for
only so long: once every other tracked task exited 0 it has ``trailing_grace_s`` to
finish its last evaluation, and is then stopped, so a slow or hung evaluator can
never keep a finished run from ending.
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
    RESPAWN = "respawn"
    """Relaunch the failed task alone; the others keep running."""
    RESTART = "restart"
    """Stop every task and relaunch them all from the last committed checkpoint."""
    SHRINK = "shrink"
    """The dead worker leaves the elastic cluster; the others go on at the smaller size."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskStatus:
    task: str
    """``job:index``."""
    tracked: bool
    """Whether the run waits for this task to exit (jobs not in ``--untracked``)."""
    exit_code: int | None
    """None while running; negative for death by signal, as Popen reports it."""
    exit_age_s: float | None = None
    """Seconds since it exited; None while it runs."""
    trailing: bool = False
    """It follows training (the evaluator): once the rest of the run succeeded, it is
    waited for only ``ClusterStatus.trailing_grace_s`` more."""
    heartbeat_age_s: float | None = None
    """Seconds since the last heartbeat from its supervisor; None before its command ran."""
    error: str | None = None
    """Why the task's command could not run, as its supervisor reported it."""
    respawnable: bool = False
    """The job declared that this task alone can be relaunched (its peers keep going)."""
    step_age_s: float | None = None
    """Seconds since the task's reported step last advanced; None if it never reported."""
    memory_kill: bool = False
    """It was killed for outgrowing its memory request, and a relaunch can ask for more."""
    resizable: bool = False
    """Its job declared that the cluster may resize around it (an async ps worker)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterStatus:
    tasks: tuple[TaskStatus, ...]
    stop_requested: bool = False
    registration_overdue: bool = False
    """Not every task registered within the registration timeout."""
    heartbeat_timeout_s: float = 30.0
    stall_timeout_s: float | None = None
    """A task whose step stops advancing for this long is dead; None: never."""
    trailing_grace_s: float = 60.0
    """How long a trailing task may run on after the rest of the run succeeded."""
    restarts: int = 0
    """Recoveries (respawns and whole restarts) made so far."""
    max_restarts: int = 0
    workers: int = 0
    """Worker tasks the cluster holds now (the dead ones included)."""
    min_workers: int | None = None
    """MIN of an elastic worker job (``--workers MIN:MAX``); None: a fixed size."""


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    failed_task: str | None = None
    exit_code: int = 0
    reason: str = ""
    memory: bool = False
    """A restart with more memory (not counted against ``max_restarts``)."""


def decide(status: ClusterStatus) -> Verdict:
    """The decision for one poll of the controller loop."""
    if status.stop_requested:
        return Verdict(Decision.STOP, exit_code=130, reason="stop requested")
    for task in status.tasks:
        death = _death(task, status)
        if death is None:
            continue
        reason, code = death
        if task.memory_kill and task.exit_code is not None:
            reason += " for outgrowing its memory request"
            return Verdict(Decision.RESTART, task.task, code, reason, memory=True)
        if status.restarts < status.max_restarts:
            decision = Decision.RESPAWN if task.respawnable else Decision.RESTART
            return Verdict(decision, task.task, code, reason)
        if _may_leave(task, status):
            reason += f"; the cluster goes on with {status.workers - 1} workers"
            return Verdict(Decision.SHRINK, task.task, code, reason)
        if status.max_restarts:
            reason += f" (after {status.restarts} restart{'s' if status.restarts != 1 else ''})"
        return Verdict(Decision.FAIL, task.task, code, reason)
    if status.registration_overdue:
        return Verdict(Decision.FAIL, exit_code=1, reason="not every task registered in time")
    tracked = [t for t in status.tasks if t.tracked]
    if tracked and all(t.exit_code == 0 for t in tracked):
        return Verdict(Decision.SUCCEED)
    leading = [t for t in tracked if not t.trailing]
    if leading and all(t.exit_code == 0 for t in leading):
        ended_s = min(t.exit_age_s or 0.0 for t in leading)  # the last of them to exit
        if ended_s > status.trailing_grace_s:
            late = ", ".join(t.task for t in tracked if t.trailing and t.exit_code is None)
            reason = (
                f"training ended; {late} still running {status.trailing_grace_s:g}s later "
                "was stopped"
            )
            return Verdict(Decision.SUCCEED, reason=reason)
    return Verdict(Decision.CONTINUE)


def _may_leave(task: TaskStatus, status: ClusterStatus) -> bool:
    """Whether ``task``, dead with no restart left, may leave the cluster instead of
    failing the run: a worker of a job that resizes live, above MIN."""
    return (
        task.resizable
        and task.task.startswith("worker:")
        and status.min_workers is not None
        and status.workers > status.min_workers
    )


def _death(task: TaskStatus, status: ClusterStatus) -> tuple[str, int] | None:
    """Why ``task`` counts as dead, with the exit code to report; None while it lives."""
    if task.exit_code is not None and task.exit_code != 0:
        reason = f"task {task.task} {describe_exit(task.exit_code)}"
        if task.error:
            reason += f": {task.error}"
        return reason, exit_code_of(task.exit_code)
    if task.exit_code is not None:
        return None
    if (task.heartbeat_age_s or 0.0) > status.heartbeat_timeout_s:
        return f"task {task.task} missed heartbeats for {task.heartbeat_age_s:.0f}s", 1
    stall = status.stall_timeout_s
    if stall is not None and task.step_age_s is not None and task.step_age_s > stall:
        return f"task {task.task} made no step for {task.step_age_s:.0f}s (hung)", 1
    return None


def exit_code_of(code: int) -> int:
    """The manager's own exit code for a task's: signals map to 128+N, like a shell."""
    if code < 0:
        return 128 + (-code)
    return min(code, 255) or 1


ABORT_NOTE = (
    "the C++ runtime aborted it; after a job's last line this is a thread still in torch's "
    "C++ code while Python exited, a torch race that clusterflow's strategies and examples "
    "avoid by leaving their process group first (docs/failure-semantics.md, Process exit)"
)
"""Said of a SIGABRT: a plain "killed by SIGABRT" reads as clusterflow killing the task."""


def describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGABRT:
            return f"was killed by {name} ({ABORT_NOTE})"
        return f"was killed by {name}"
    return f"exited with code {code}"
