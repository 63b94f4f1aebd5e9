"""Which Ray requests fail at once, before any placement group waits (``unplaceable``).

The nodes are what ``ray.nodes()`` reports (ray 2.60): totals under ``Resources`` (with
Ray's own ``node:IP`` and memory entries beside the CPUs), labels under ``Labels``.
"""

from __future__ import annotations

from typing import Any

import pytest

from clusterflow.backends.ray_placement import TaskRequest, unplaceable
from clusterflow.cluster import TaskId

pytestmark = pytest.mark.timeout(30)


def _node(ip: str, labels: dict[str, str], alive: bool = True, **resources: float) -> Any:
    return {
        "NodeID": f"{ip.replace('.', '')}" * 4,
        "Alive": alive,
        "NodeManagerAddress": ip,
        "Resources": {
            "memory": 8.0 * 2**30,
            "object_store_memory": 2.0 * 2**30,
            f"node:{ip}": 1.0,
            **resources,
        },
        "Labels": {"ray.io/node-id": ip, **labels},
    }


NODES = [
    _node("10.77.0.1", {"zone": "a"}, CPU=2.0),
    _node("10.77.0.2", {"zone": "b", "gpu-type": "A100"}, CPU=2.0, GPU=1.0),
    _node("10.77.0.3", {"zone": "c"}, CPU=2.0),
]


def _workers(count: int, labels: dict[str, str] | None = None, **resources: float) -> list[Any]:
    return [
        TaskRequest(task=TaskId("worker", i), resources=resources, labels=labels or {})
        for i in range(count)
    ]


def test_two_tasks_only_one_node_can_hold_at_once_fail_naming_the_second() -> None:
    """The case of issue 31: each task fits the labelled node, both do not."""
    reason = unplaceable(_workers(2, {"zone": "b"}, CPU=2.0), NODES)
    assert reason == (
        "task worker:1 needs CPU=2 with zone=b: no node has room for it beside the cluster's "
        "other tasks (the nodes with zone=b: 10.77.0.2 has CPU=2 in all)"
    )


def test_tasks_that_fit_node_by_node_pass() -> None:
    assert unplaceable(_workers(3, CPU=2.0), NODES) is None  # one per node
    assert unplaceable(_workers(6, CPU=1.0), NODES) is None  # two per node
    assert unplaceable(_workers(2, {"zone": "in(a,c)"}, CPU=2.0), NODES) is None


def test_more_tasks_than_the_nodes_hold_in_sum_fail() -> None:
    reason = unplaceable(_workers(4, CPU=2.0), NODES)
    assert reason is not None
    assert reason.startswith("task worker:3 needs CPU=2: no node has room for it beside")


def test_a_dead_node_holds_nothing() -> None:
    nodes = [*NODES[:2], _node("10.77.0.3", {"zone": "c"}, alive=False, CPU=2.0)]
    reason = unplaceable(_workers(3, CPU=2.0), nodes)
    assert reason is not None
    assert reason.startswith("task worker:2 needs CPU=2:")


def test_first_fit_in_task_order_is_not_the_judge() -> None:
    """First fit puts the half-CPU task on the first node, leaving no whole node for the
    two-CPU one; the search finds the packing that exists, so nothing fails at once."""
    nodes = [_node("10.77.0.1", {}, CPU=2.0), _node("10.77.0.2", {}, CPU=2.5)]
    requests = [
        TaskRequest(task=TaskId("ps", 0), resources={"CPU": 0.5}),
        TaskRequest(task=TaskId("worker", 0), resources={"CPU": 2.0}),
        TaskRequest(task=TaskId("worker", 1), resources={"CPU": 2.0}),
    ]
    assert unplaceable(requests, nodes) is None


def test_one_task_no_node_could_ever_run_is_named_by_its_job_as_before() -> None:
    reason = unplaceable(_workers(1, {"gpu-type": "H100"}, GPU=1.0), NODES)
    assert reason == "job worker needs GPU=1 with gpu-type=H100: no node has it"


def test_a_search_past_its_bound_leaves_the_answer_to_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a packing proven impossible fails at once: a search that gives up says nothing."""
    import clusterflow.backends.ray_placement as placement

    requests = _workers(4, CPU=2.0)
    assert unplaceable(requests, NODES) is not None
    monkeypatch.setattr(placement, "PACK_STEPS", 1)
    assert unplaceable(requests, NODES) is None
