"""The environment of a task (manager/job_env.py): pure functions, tested without processes."""

from __future__ import annotations

import json

import pytest

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.cluster.contract import TASK_ENVIRONMENT
from clusterflow.manager.config import RunConfig
from clusterflow.manager.job_env import (
    ClusterPlace,
    Incarnation,
    job_env,
    ranks,
    replica_env,
    supervisor_env,
)

PLACE = ClusterPlace(
    cluster_id="c0ffee",
    manager="127.0.0.1:5000",
    secret_file="/home/u/.clusterflow/clusters/c0ffee/secret",
    state_dir="/home/u/.clusterflow/clusters/c0ffee",
    checkpoint_url="memory://ckpt",
)
FIRST = Incarnation(spec_version=1, attempt=0, restarts=0, restore=None, store_port=29500)


def _spec(config: RunConfig) -> ClusterSpec:
    jobs: dict[str, list[str]] = {}
    for n, task in enumerate(config.tasks()):
        jobs.setdefault(task.job, []).append(f"127.0.0.1:{7000 + n}")
    return ClusterSpec(jobs)


def test_supervisor_env_finds_the_manager_and_keeps_the_run_s_variables() -> None:
    config = RunConfig(command=("python",), env={"EXTRA": "1", "PATH": "/run"})
    env = supervisor_env({"PATH": "/usr/bin", "HOME": "/h"}, config, PLACE, TaskId("worker", 0))
    assert env["CLUSTERFLOW_MANAGER"] == "127.0.0.1:5000"
    assert env["CLUSTERFLOW_TASK"] == "worker:0"
    assert env["CLUSTERFLOW_CLUSTER_ID"] == "c0ffee"
    assert env["CLUSTERFLOW_SECRET_FILE"].endswith("/secret")
    assert env["CLUSTERFLOW_HEARTBEAT_S"] == "1.0"
    assert (env["EXTRA"], env["PATH"], env["HOME"]) == ("1", "/run", "/h")  # the run wins


def test_ranks_are_the_chief_then_the_workers() -> None:
    config = RunConfig(command=("p",), chief=True, ps=2, workers=2, evaluator=True)
    assert ranks(_spec(config)) == [TaskId("chief", 0), TaskId("worker", 0), TaskId("worker", 1)]


def test_job_env_gives_tf_config_and_torchrun_variables_to_replicas() -> None:
    config = RunConfig(command=("p",), chief=True, ps=1, workers=2, max_restarts=3)
    spec = _spec(config)
    now = Incarnation(spec_version=4, attempt=2, restarts=1, restore="120", store_port=29511)
    env = job_env(config, PLACE, spec, TaskId("worker", 1), now)
    tf_config = json.loads(env["TF_CONFIG"])
    assert tf_config["task"] == {"type": "worker", "index": 1}
    assert tf_config["cluster"]["ps"] == ["127.0.0.1:7001"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("2", "3", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29511")
    assert env["CLUSTERFLOW_SPEC_VERSION"] == "4"
    assert env["CLUSTERFLOW_ATTEMPT"] == "2"
    assert env["CLUSTERFLOW_RESTORE"] == "120"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["CLUSTERFLOW_CHECKPOINT_DIR"] == "memory://ckpt"


@pytest.mark.parametrize("task", [TaskId("ps", 0), TaskId("evaluator", 0)])
def test_tasks_that_do_not_train_get_no_rank(task: TaskId) -> None:
    config = RunConfig(command=("p",), ps=1, workers=1, evaluator=True)
    env = job_env(config, PLACE, _spec(config), task, FIRST)
    assert "RANK" not in env and "MASTER_PORT" not in env
    assert env["CLUSTERFLOW_JOB"] == task.job and "CLUSTERFLOW_RESTORE" not in env


def test_replica_env_numbers_processes_as_torchrun_nodes() -> None:
    config = RunConfig(command=("p",), chief=True, workers=1, replicas_per_host=2)
    assert replica_env(config, _spec(config), TaskId("worker", 0)) == [
        {
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "4",
            "CLUSTERFLOW_REPLICA": str(local),
        }
        for local, rank in ((0, 2), (1, 3))
    ]
    two = RunConfig(command=("p",), workers=2)
    assert replica_env(two, _spec(two), TaskId("worker", 1)) == []


def test_every_variable_given_to_a_task_is_in_the_contract_table() -> None:
    config = RunConfig(command=("p",), chief=True, workers=1, replicas_per_host=2)
    task = TaskId("worker", 0)
    now = Incarnation(spec_version=1, attempt=0, restarts=0, restore="5", store_port=1)
    given = set(supervisor_env({}, config, PLACE, task))
    given |= set(job_env(config, PLACE, _spec(config), task, now))
    given |= {k for overrides in replica_env(config, _spec(config), task) for k in overrides}
    assert given <= set(TASK_ENVIRONMENT), sorted(given - set(TASK_ENVIRONMENT))


@pytest.mark.parametrize(
    ("chief", "ps", "workers", "evaluator"),
    [(False, 0, 1, False), (True, 2, 3, True), (False, 1, 4, True), (True, 0, 1, False)],
)
def test_rank_of_is_the_position_in_ranks(
    chief: bool, ps: int, workers: int, evaluator: bool
) -> None:
    """The rank each registration asks for is the one the ordered list gives."""
    from clusterflow.manager.job_env import rank_of

    config = RunConfig(
        command=("python", "t.py"), chief=chief, ps=ps, workers=workers, evaluator=evaluator
    )
    spec = _spec(config)
    order = ranks(spec)
    for task in config.tasks():
        expected = (order.index(task), len(order)) if task in order else None
        assert rank_of(spec, task) == expected, task
    assert rank_of(spec, TaskId("worker", workers)) is None


@pytest.mark.parametrize(
    ("chief", "workers", "expected"),
    [
        # worker:1 lost above MIN (2:3): the two left are ranks 0 and 1 of 2
        (False, {0: "h:10", 2: "h:12"}, {"worker:0": ("0", "2"), "worker:2": ("1", "2")}),
        # ... and worker:3 added later by `scale`, with a chief in front
        (
            True,
            {0: "h:10", 2: "h:12", 3: "h:13"},
            {"chief:0": ("0", "4"), "worker:0": ("1", "4"), "worker:2": ("2", "4")}
            | {"worker:3": ("3", "4")},
        ),
    ],
)
def test_ranks_are_dense_over_the_current_members_when_the_worker_indexes_have_a_hole(
    chief: bool, workers: dict[int, str], expected: dict[str, tuple[str, str]]
) -> None:
    """A loss above MIN leaves a hole in the worker indexes and a later worker takes an
    index above the highest: every replica still gets ``RANK`` 0..n-1 (chief first,
    then the workers by index) and ``WORLD_SIZE`` n, as ``collective.Membership``
    derives them from ``TF_CONFIG``. ``config.workers`` follows the size, as the
    manager's ``_resized`` keeps it. Counting ranks as ``chief + index`` gave
    ``worker:2`` no rank (or rank 3 of 4) and ``worker:3`` none at all."""
    config = RunConfig(command=("p",), chief=chief, ps=1, workers=len(workers), max_restarts=1)
    jobs: dict[str, object] = {"ps": ["h:1"], "worker": workers}
    if chief:
        jobs["chief"] = ["h:2"]
    spec = ClusterSpec(jobs)
    seen = {}
    for task in spec.tasks():
        env = job_env(config, PLACE, spec, task, FIRST)
        if "RANK" in env or task.job != "ps":
            seen[str(task)] = (env.get("RANK"), env.get("WORLD_SIZE"))
    assert seen == expected
    hosts = RunConfig(command=("p",), chief=chief, workers=len(workers), replicas_per_host=2)
    last = replica_env(hosts, spec, TaskId("worker", max(workers)))
    world = 2 * len(expected)
    assert [(e["RANK"], e["WORLD_SIZE"]) for e in last] == [
        (str(world - 2), str(world)),
        (str(world - 1), str(world)),
    ]
