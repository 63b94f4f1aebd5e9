"""``policy.decide``: every rule of the manager, on plain values, without processes."""

from __future__ import annotations

import signal

import pytest

from clusterflow.manager.policy import (
    ClusterStatus,
    Decision,
    TaskStatus,
    Verdict,
    decide,
    describe_exit,
    exit_code_of,
)


def task(
    name: str,
    exit_code: int | None = None,
    *,
    tracked: bool = True,
    heartbeat_age_s: float | None = 0.5,
    error: str | None = None,
) -> TaskStatus:
    return TaskStatus(
        task=name,
        tracked=tracked,
        exit_code=exit_code,
        heartbeat_age_s=heartbeat_age_s,
        error=error,
    )


def status(*tasks: TaskStatus, **kwargs: object) -> ClusterStatus:
    return ClusterStatus(tasks=tasks, **kwargs)  # type: ignore[arg-type]


def test_running_tasks_continue() -> None:
    verdict = decide(status(task("ps:0", tracked=False), task("worker:0"), task("worker:1", 0)))
    assert verdict == Verdict(Decision.CONTINUE)


def test_tasks_before_their_first_heartbeat_continue() -> None:
    assert decide(status(task("worker:0", heartbeat_age_s=None))).decision == Decision.CONTINUE


def test_every_tracked_task_done_succeeds_while_untracked_still_run() -> None:
    verdict = decide(status(task("chief:0", 0), task("ps:0", tracked=False), task("worker:0", 0)))
    assert verdict == Verdict(Decision.SUCCEED)


def test_untracked_tasks_exiting_zero_do_not_end_the_run() -> None:
    verdict = decide(status(task("ps:0", 0, tracked=False), task("worker:0")))
    assert verdict.decision == Decision.CONTINUE


def test_no_tracked_task_never_succeeds() -> None:
    assert decide(status(task("ps:0", 0, tracked=False))).decision == Decision.CONTINUE


def test_a_failed_task_fails_the_run_naming_it() -> None:
    verdict = decide(status(task("worker:0"), task("worker:1", 3)))
    assert verdict.decision == Decision.FAIL
    assert verdict.failed_task == "worker:1"
    assert verdict.exit_code == 3
    assert verdict.reason == "task worker:1 exited with code 3"


def test_the_first_failed_task_in_order_is_named() -> None:
    verdict = decide(status(task("chief:0", 2), task("worker:0", 5)))
    assert (verdict.failed_task, verdict.exit_code) == ("chief:0", 2)


def test_an_untracked_task_failing_fails_the_run() -> None:
    verdict = decide(status(task("ps:0", 1, tracked=False), task("worker:0")))
    assert verdict.decision == Decision.FAIL
    assert verdict.failed_task == "ps:0"


def test_a_failure_wins_over_success_of_the_rest() -> None:
    verdict = decide(status(task("ps:0", 1, tracked=False), task("worker:0", 0)))
    assert verdict.decision == Decision.FAIL


def test_a_task_killed_by_a_signal_exits_like_a_shell() -> None:
    verdict = decide(status(task("worker:0", -signal.SIGKILL)))
    assert verdict.exit_code == 128 + signal.SIGKILL
    assert verdict.reason == "task worker:0 was killed by SIGKILL"


def test_the_reason_carries_what_the_supervisor_reported() -> None:
    error = "cannot run 'nosuch': No such file or directory"
    verdict = decide(status(task("ps:0", 127, tracked=False, error=error)))
    assert verdict.reason == f"task ps:0 exited with code 127: {error}"
    assert verdict.exit_code == 127


def test_missed_heartbeats_fail_a_running_task() -> None:
    verdict = decide(status(task("worker:0"), task("worker:1", heartbeat_age_s=31.0)))
    assert verdict.decision == Decision.FAIL
    assert verdict.failed_task == "worker:1"
    assert verdict.exit_code == 1
    assert "missed heartbeats" in verdict.reason


def test_heartbeat_age_at_the_timeout_is_still_alive() -> None:
    verdict = decide(status(task("worker:0", heartbeat_age_s=10.0), heartbeat_timeout_s=10.0))
    assert verdict.decision == Decision.CONTINUE


def test_the_heartbeat_timeout_is_the_snapshots() -> None:
    verdict = decide(status(task("worker:0", heartbeat_age_s=6.0), heartbeat_timeout_s=5.0))
    assert verdict.decision == Decision.FAIL


def test_an_exited_task_has_no_heartbeat_to_miss() -> None:
    verdict = decide(status(task("worker:0", 0, heartbeat_age_s=1000.0)))
    assert verdict.decision == Decision.SUCCEED


def test_registration_overdue_fails_the_run() -> None:
    verdict = decide(status(task("worker:0", heartbeat_age_s=None), registration_overdue=True))
    assert verdict.decision == Decision.FAIL
    assert verdict.failed_task is None
    assert verdict.exit_code == 1
    assert "registered" in verdict.reason


def test_a_stop_request_wins_over_everything() -> None:
    verdict = decide(
        status(
            task("worker:0", 3), task("worker:1", 0), stop_requested=True, registration_overdue=True
        )
    )
    assert verdict.decision == Decision.STOP
    assert verdict.exit_code == 130


@pytest.mark.parametrize(
    ("code", "expected"),
    [(1, 1), (3, 3), (255, 255), (256, 255), (1000, 255), (-2, 130), (-9, 137), (-15, 143)],
)
def test_exit_code_of(code: int, expected: int) -> None:
    assert exit_code_of(code) == expected


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (0, "exited with code 0"),
        (2, "exited with code 2"),
        (-15, "was killed by SIGTERM"),
        (-200, "was killed by signal 200"),
    ],
)
def test_describe_exit(code: int, words: str) -> None:
    assert describe_exit(code) == words


def test_an_abort_is_told_for_what_it_is() -> None:
    """Pins describe_exit's SIGABRT branch: the exit at the end of a run that torch's
    teardown race causes is named as the C++ runtime's abort, with the page that explains
    it, not as a kill."""
    words = describe_exit(-signal.SIGABRT)
    assert words.startswith("was killed by SIGABRT (the C++ runtime aborted it;")
    assert "docs/failure-semantics.md" in words


def test_status_values_are_frozen() -> None:
    snapshot = status(task("worker:0"))
    with pytest.raises(AttributeError):
        snapshot.stop_requested = True  # type: ignore[misc]


# Recovery (docs/architecture.md section 6) ---------------------------------------------------


def test_a_respawnable_worker_that_dies_is_respawned_alone_while_restarts_remain() -> None:
    dead = TaskStatus(task="worker:1", tracked=True, exit_code=-9, respawnable=True)
    verdict = decide(status(task("worker:0"), dead, max_restarts=3, restarts=2))
    assert verdict.decision == Decision.RESPAWN and verdict.failed_task == "worker:1"
    assert "SIGKILL" in verdict.reason


@pytest.mark.parametrize("name", ["worker:0", "ps:0", "chief:0"])
def test_any_other_death_restarts_the_whole_cluster(name: str) -> None:
    dead = TaskStatus(task=name, tracked=not name.startswith("ps"), exit_code=1)
    verdict = decide(status(task("worker:2"), dead, max_restarts=1))
    assert verdict.decision == Decision.RESTART and verdict.failed_task == name


def test_beyond_max_restarts_the_run_fails_naming_the_task_and_the_count() -> None:
    dead = TaskStatus(task="worker:0", tracked=True, exit_code=3, respawnable=True)
    verdict = decide(status(dead, max_restarts=2, restarts=2))
    assert verdict == Verdict(
        Decision.FAIL, "worker:0", 3, "task worker:0 exited with code 3 (after 2 restarts)"
    )


def test_without_restarts_a_death_fails_as_before() -> None:
    verdict = decide(status(TaskStatus(task="worker:0", tracked=True, exit_code=3)))
    assert verdict == Verdict(Decision.FAIL, "worker:0", 3, "task worker:0 exited with code 3")


def test_a_task_whose_step_stalls_past_the_timeout_is_dead() -> None:
    hung = TaskStatus(task="worker:1", tracked=True, exit_code=None, step_age_s=31.0)
    alive = TaskStatus(task="worker:0", tracked=True, exit_code=None, step_age_s=1.0)
    assert decide(status(alive, hung, stall_timeout_s=60.0)).decision == Decision.CONTINUE
    verdict = decide(status(alive, hung, stall_timeout_s=30.0, max_restarts=1))
    assert verdict.decision == Decision.RESTART and "no step for 31s" in verdict.reason
    # A task that never reported a step is not judged by steps.
    quiet = TaskStatus(task="worker:2", tracked=True, exit_code=None)
    assert decide(status(quiet, stall_timeout_s=0.1)).decision == Decision.CONTINUE


def _evaluator(exit_code: int | None = None) -> TaskStatus:
    return TaskStatus(task="evaluator:0", tracked=True, exit_code=exit_code, trailing=True)


def _done(name: str, age_s: float) -> TaskStatus:
    return TaskStatus(task=name, tracked=True, exit_code=0, exit_age_s=age_s)


def test_a_finished_run_waits_for_its_evaluator_within_the_grace() -> None:
    verdict = decide(
        status(_done("worker:0", 5.0), _done("worker:1", 3.0), _evaluator(), trailing_grace_s=4.0)
    )
    # worker:1 exited last, 3 s ago: the evaluator still has a second.
    assert verdict.decision == Decision.CONTINUE


def test_an_evaluator_past_the_grace_is_stopped_and_the_run_succeeds() -> None:
    verdict = decide(
        status(_done("worker:0", 9.0), _done("worker:1", 5.0), _evaluator(), trailing_grace_s=4.0)
    )
    assert verdict.decision == Decision.SUCCEED
    assert "evaluator:0" in verdict.reason and "4s" in verdict.reason


def test_an_evaluator_that_finishes_in_time_succeeds_plainly() -> None:
    verdict = decide(status(_done("worker:0", 1.0), _evaluator(0), trailing_grace_s=4.0))
    assert verdict == Verdict(Decision.SUCCEED)


def test_the_grace_never_starts_while_training_runs() -> None:
    # A worker still running: the evaluator is waited for, however long it has been.
    worker = TaskStatus(task="worker:1", tracked=True, exit_code=None, heartbeat_age_s=0.5)
    verdict = decide(status(_done("worker:0", 100.0), worker, _evaluator(), trailing_grace_s=1.0))
    assert verdict.decision == Decision.CONTINUE


def test_an_evaluator_that_fails_still_counts_as_a_failure() -> None:
    verdict = decide(status(_done("worker:0", 100.0), _evaluator(3), trailing_grace_s=1.0))
    assert verdict.decision == Decision.FAIL and verdict.failed_task == "evaluator:0"


# Memory (docs/ray.md, "Memory sized by the platform") ---------------------------------------


def test_a_kill_for_memory_restarts_with_more_without_counting_a_restart() -> None:
    oom = TaskStatus(task="worker:1", tracked=True, exit_code=-9, memory_kill=True)
    verdict = decide(status(task("worker:0"), oom))  # max_restarts 0: still not a failure
    assert verdict == Verdict(
        Decision.RESTART,
        "worker:1",
        137,
        "task worker:1 was killed by SIGKILL for outgrowing its memory request",
        memory=True,
    )


def test_a_respawnable_task_killed_for_memory_restarts_everything() -> None:
    # A lone respawn would go back into its bundle as it was; only a new group is larger.
    oom = TaskStatus(
        task="worker:1", tracked=True, exit_code=-9, respawnable=True, memory_kill=True
    )
    verdict = decide(status(task("worker:0"), oom, max_restarts=2))
    assert verdict.decision == Decision.RESTART and verdict.memory


def test_a_kill_for_memory_that_cannot_grow_counts_as_any_death() -> None:
    # At the largest node's memory the backend no longer reports a memory kill.
    killed = TaskStatus(task="worker:0", tracked=True, exit_code=-9)
    verdict = decide(status(killed, max_restarts=1, restarts=1))
    assert verdict.decision == Decision.FAIL and not verdict.memory


def test_heartbeats_reach_the_task_they_name_in_either_form() -> None:
    """The manager's heartbeat path finds a task by its canonical name without parsing,
    and still by TensorFlow's form; a stale or malformed name changes nothing."""
    from clusterflow.manager.config import RunConfig
    from clusterflow.manager.rendezvous import RegistrationError
    from clusterflow.manager.tasks import TaskTable

    table = TaskTable(RunConfig(command=("true",), workers=3))
    table.heartbeat("worker:1")
    table.heartbeat("/job:worker/task:2")
    for stale in ("worker:7", "nonsense", 12, None):
        table.heartbeat(stale)
    ages = {s.task: s.heartbeat_age_s for s in table.statuses()}
    assert ages["worker:0"] is None
    assert ages["worker:1"] is not None and ages["worker:2"] is not None
    assert table.find("/job:worker/task:0") is table.find("worker:0")
    with pytest.raises(RegistrationError, match="worker:7"):
        table.find("worker:7")
