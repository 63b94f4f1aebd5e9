"""Elastic clusters (issue 32): what ``clusterflow scale`` accepts, and how the spec and
the registration barrier follow a worker job that grows and shrinks.

The manager's loop carrying a change out is tested on a real cluster
(``tests/integration/test_elastic.py``; this file has another name, as pytest
needs unique module names); here are its pure pieces.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.cluster.errors import ClusterSpecError
from clusterflow.errors import ConfigError
from clusterflow.manager.elastic import ScaleRefused, ScaleView, check_scale
from clusterflow.manager.rendezvous import Arrival, Rendezvous
from clusterflow.manager.state import ClusterState, MembershipChange
from clusterflow.server.manager_messages import ScaleRequest

pytestmark = pytest.mark.timeout(30)

VIEW = ScaleView(
    cluster_id="c0ffee", status="running", workers=2, workers_range=(2, 4), resizable=True
)


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("resizable", [True, None])
def test_a_size_within_the_range_of_a_running_cluster_is_taken(
    workers: int, resizable: bool | None
) -> None:
    """Resizable: live. Declared nothing (an unmodified torchrun script): taken too,
    the manager restarts every task at the new size."""
    check_scale(replace(VIEW, resizable=resizable), workers)


@pytest.mark.parametrize(
    ("changes", "workers", "message"),
    [
        ({}, 1, "--workers 1 is outside the range 2:4 of cluster c0ffee (it runs 2 now)"),
        ({}, 5, "--workers 5 is outside the range 2:4 of cluster c0ffee"),
        ({}, 0, "--workers 0 is outside the range 2:4"),
        ({"workers_range": None}, 3, "cluster c0ffee has a fixed size of 2 worker(s)"),
        ({"status": "restarting"}, 3, "cluster c0ffee is restarting: it can be resized only"),
        ({"resizable": False}, 3, "the workers of cluster c0ffee have not declared"),
        ({"resizable": False}, 3, "a pipeline's stage count is the model's cut"),
        ({"resizable": False}, 3, "a sync ps with embedding tables keeps it"),
    ],
)
def test_a_request_the_cluster_cannot_take_is_refused_in_one_line(
    changes: dict[str, Any], workers: int, message: str
) -> None:
    """Pins every refusal of ``check_scale``: remove one and its case passes through."""
    view = ScaleView(**{**{f: getattr(VIEW, f) for f in VIEW.__slots__}, **changes})
    with pytest.raises(ScaleRefused) as refused:
        check_scale(view, workers)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"workers": 0}, "--workers must be at least 1, got 0"),
        ({"workers": -3}, "--workers must be at least 1, got -3"),
    ],
)
def test_the_scale_request_refuses_fewer_than_one_worker_in_the_users_words(
    body: Any, message: str
) -> None:
    """A count below 1 is the user's input (``ConfigError``, ``ScaleRefused`` on the
    wire), not a malformed body; the shapes are ``test_manager_messages.py``'s."""
    with pytest.raises(ConfigError) as raised:
        ScaleRequest.from_wire(body)
    assert str(raised.value).startswith(message)


def test_a_spec_gains_and_loses_tasks_without_touching_the_others() -> None:
    spec = ClusterSpec({"ps": ["h:1"], "worker": ["h:2", "h:3"]})
    grown = spec.with_task(TaskId("worker", 2), "h:4")
    assert grown.as_dict() == {"ps": ["h:1"], "worker": ["h:2", "h:3", "h:4"]}
    assert spec.num_tasks("worker") == 2  # a value: unchanged
    assert grown.without(TaskId("worker", 2)) == spec
    # a task that is not the last leaves a hole: a sparse job, as TensorFlow allows
    assert grown.without(TaskId("worker", 1)).as_dict()["worker"] == {0: "h:2", 2: "h:4"}
    with pytest.raises(ClusterSpecError):
        grown.with_task(TaskId("worker", 0), "h:9")
    with pytest.raises(ClusterSpecError):
        spec.without(TaskId("worker", 5))


def test_the_rendezvous_admits_a_new_task_and_dismisses_a_leaving_one_at_new_versions() -> None:
    w = [TaskId("worker", i) for i in range(3)]
    rdv = Rendezvous([TaskId("ps", 0), w[0], w[1]], timeout_s=5)
    for task, port in ((TaskId("ps", 0), 1), (w[0], 2), (w[1], 3)):
        rdv.register(task, f"h:{port}", respawned=False)
    spec, version = rdv.current()
    assert version == 1 and spec is not None and spec.num_tasks("worker") == 2
    with pytest.raises(Exception, match="not part of this cluster"):
        rdv.register(w[2], "h:4", respawned=True)  # not admitted yet
    rdv.admit(w[2])
    assert rdv.register(w[2], "h:4", respawned=True) == Arrival.JOINED
    spec, version = rdv.current()
    assert version == 2 and spec is not None and spec.task_address("worker", 2) == "h:4"
    assert rdv.dismiss(w[2]) == 3
    spec, _ = rdv.current()
    assert spec is not None and TaskId("worker", 2) not in spec
    # a whole restart's barrier waits for the members as they are now, by index
    rdv.dismiss(w[0])
    rdv.reopen()
    for task, port in ((TaskId("ps", 0), 5), (w[1], 6)):
        rdv.register(task, f"h:{port}", respawned=False)
    spec, _ = rdv.current()
    assert spec is not None and spec.as_dict()["worker"] == {1: "h:6"}


def test_the_membership_history_round_trips_through_the_state_file() -> None:
    change = MembershipChange(
        time=1.5, task="worker:3", change="left", spec_version=5, step=36, workers=2
    )
    state = ClusterState(id="c", workers_range=(2, 4), membership=(change,))
    back = ClusterState.from_dict(state.to_dict())
    assert back.membership == (change,) and back.workers_range == (2, 4)
    assert ClusterState.from_dict({"id": "c", "membership": "x", "workers_range": [1]}) == (
        ClusterState(id="c")
    )


# Loss above MIN (manager/policy.py) -------------------------------------------------------


def _status(*, workers: int, min_workers: int | None, resizable: bool = True, **kw: Any) -> Any:
    from clusterflow.manager.policy import ClusterStatus, TaskStatus

    tasks = [TaskStatus(task="chief:0", tracked=True, exit_code=None)]
    tasks += [
        TaskStatus(
            task=f"worker:{i}",
            tracked=True,
            exit_code=-9 if i == 1 else None,
            resizable=resizable,
            respawnable=True,
        )
        for i in range(workers)
    ]
    return ClusterStatus(tasks=tuple(tasks), workers=workers, min_workers=min_workers, **kw)


def test_a_dead_resizable_worker_above_min_with_no_restart_left_leaves_the_cluster() -> None:
    """Pins ``_may_leave``: without it the run fails (``FAIL``)."""
    from clusterflow.manager.policy import Decision, decide

    verdict = decide(_status(workers=3, min_workers=2))
    assert verdict.decision == Decision.SHRINK and verdict.failed_task == "worker:1"
    assert "goes on with 2 workers" in verdict.reason


@pytest.mark.parametrize(
    ("changes", "decision"),
    [
        ({"workers": 2, "min_workers": 2}, "fail"),  # at MIN: today's policy
        ({"workers": 3, "min_workers": None}, "fail"),  # a fixed size
        ({"workers": 3, "min_workers": 2, "resizable": False}, "fail"),  # all-reduce, sync
        ({"workers": 3, "min_workers": 2, "max_restarts": 1}, "respawn"),  # restarts first
    ],
)
def test_otherwise_a_dead_worker_meets_the_failure_policy(
    changes: dict[str, Any], decision: str
) -> None:
    from clusterflow.manager.policy import decide

    assert decide(_status(**changes)).decision == decision
