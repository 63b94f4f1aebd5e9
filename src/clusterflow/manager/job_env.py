"""The environment of a task: its supervisor's, its job command's, its replicas'.

Pure functions of the run's config, the spec and what changed since the run began
(``Incarnation``), like ``policy.decide``: no processes, no clock, no I/O, so every
variable is tested without a cluster (``tests/unit/test_job_env.py``). The names come
from ``cluster/contract.py``; docs/architecture.md section 3 says who reads them.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from clusterflow.cluster import ClusterSpec, TaskId, TFConfig
from clusterflow.cluster.contract import (
    ENV_ATTEMPT,
    ENV_BIND_HOST,
    ENV_CHECKPOINT_DIR,
    ENV_CLUSTER_ID,
    ENV_HEARTBEAT_S,
    ENV_INCARNATION,
    ENV_JOB,
    ENV_MANAGER,
    ENV_REGISTER_TIMEOUT,
    ENV_REPLICA,
    ENV_RESTORE,
    ENV_SECRET_FILE,
    ENV_SPEC_VERSION,
    ENV_STATE_DIR,
    ENV_TASK,
    ENV_TASK_INDEX,
    PYTHONUNBUFFERED,
    TF_CONFIG,
    TF_GRPC_REUSE_PORT,
    Torchrun,
)
from clusterflow.manager.config import REPLICA_JOBS, RunConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterPlace:
    """Where a cluster lives: the same for every task and every launch."""

    cluster_id: str
    manager: str
    """The manager's ``host:port``."""
    secret_file: str
    state_dir: str
    """The cluster's folder under ``$CLUSTERFLOW_HOME``."""
    checkpoint_url: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Incarnation:
    """What one launch of a task is told that the next launch may be told otherwise."""

    spec_version: int
    attempt: int
    """Whole-cluster restarts so far."""
    restarts: int
    """Relaunches of this task so far (alone or with every task)."""
    restore: str | None
    """The step of the checkpoint to restore, or None to start afresh."""
    store_port: int
    """``MASTER_PORT``: the hosted store of this attempt."""


def supervisor_env(
    base: Mapping[str, str], config: RunConfig, place: ClusterPlace, task: TaskId
) -> dict[str, str]:
    """The supervisor's environment: ``base`` (the manager's own), the run's extra
    variables, and how to find the manager and prove membership."""
    env = dict(base)
    env.update(config.env)
    env.update(
        {
            ENV_MANAGER: place.manager,
            ENV_SECRET_FILE: place.secret_file,
            ENV_TASK: str(task),
            ENV_CLUSTER_ID: place.cluster_id,
            ENV_BIND_HOST: config.host,
            ENV_HEARTBEAT_S: str(config.heartbeat_s),
            ENV_REGISTER_TIMEOUT: str(config.register_timeout_s),
            PYTHONUNBUFFERED: "1",
        }
    )
    return env


def ranks(spec: ClusterSpec) -> list[TaskId]:
    """The tasks that train, in rank order: the chief, then the workers by index.

    Over the tasks the spec holds now, so the ranks are dense ``0..n-1`` however the
    worker indexes run: a worker lost above MIN leaves a hole (``worker:0`` and
    ``worker:2``), and a worker added later takes an index above the highest.
    """
    return [t for t in spec.tasks() if t.job in REPLICA_JOBS]


def rank_of(spec: ClusterSpec, task: TaskId) -> tuple[int, int] | None:
    """``task``'s position in ``ranks(spec)`` and that list's length; None for a task
    that does not train, or one the spec does not hold.

    The rank comes from the spec the task is answered with, not from a count of the
    workers: ``chief + index`` is right only while the indexes are ``0..n-1``, and an
    elastic cluster's are not (a loss above MIN leaves a hole). It is also the rank
    ``collective.Membership`` derives from ``TF_CONFIG``, which must agree with
    ``RANK``. One pass over the spec's replica indexes (ints, no ``TaskId`` built per
    task: registering 1,000 tasks once cost a million, docs/scaling.md); each answer
    serialises the whole spec into ``TF_CONFIG`` anyway.
    """
    if task.job not in REPLICA_JOBS or task not in spec:
        return None
    chief = 1 if TaskId("chief", 0) in spec else 0
    workers = spec.task_indices("worker") if "worker" in spec.jobs else []
    position = 0 if task.job == "chief" else chief + bisect.bisect_left(workers, task.index)
    return position, chief + len(workers)


def job_env(
    config: RunConfig,
    place: ClusterPlace,
    spec: ClusterSpec,
    task: TaskId,
    now: Incarnation,
) -> dict[str, str]:
    """What the job command sees on top of its supervisor's environment: ``TF_CONFIG``,
    torchrun's variables (for the tasks that train) and ``CLUSTERFLOW_*``."""
    env = {
        TF_CONFIG: TFConfig(spec, task).to_json(),
        ENV_JOB: task.job,
        ENV_TASK_INDEX: str(task.index),
        ENV_SPEC_VERSION: str(now.spec_version),
        ENV_STATE_DIR: place.state_dir,
        ENV_CHECKPOINT_DIR: place.checkpoint_url,
        ENV_ATTEMPT: str(now.attempt),
        ENV_INCARNATION: str(now.restarts),  # rpc/fencing.py: older launches are refused
        # A TensorFlow gRPC server may then bind beside the reserved socket.
        TF_GRPC_REUSE_PORT: "1",
    }
    if now.restore is not None:
        env[ENV_RESTORE] = now.restore
    placed = rank_of(spec, task)
    if placed is not None:
        rank, world = placed
        env.update(
            {
                Torchrun.RANK: str(rank),
                Torchrun.WORLD_SIZE: str(world),
                # One host: every rank of a local cluster is local, unless each task
                # stands for a host of its own (--replicas-per-host, replica_env).
                Torchrun.LOCAL_RANK: str(rank),
                Torchrun.LOCAL_WORLD_SIZE: str(world),
                Torchrun.GROUP_RANK: "0",
                Torchrun.GROUP_WORLD_SIZE: "1",
                Torchrun.ROLE_RANK: str(rank),
                Torchrun.ROLE_WORLD_SIZE: str(world),
                Torchrun.MASTER_ADDR: config.host,
                Torchrun.MASTER_PORT: str(now.store_port),
                Torchrun.USE_AGENT_STORE: "True",
                Torchrun.RESTART_COUNT: str(now.restarts),
                Torchrun.MAX_RESTARTS: str(config.max_restarts),
            }
        )
    return env


def replica_env(config: RunConfig, spec: ClusterSpec, task: TaskId) -> list[dict[str, str]]:
    """Per-process overrides when ``task`` runs several replicas; [] when it runs one.

    The task stands for a host with ``n`` devices, as a torchrun node with
    ``--nproc-per-node n``: its processes hold the contiguous ranks ``i*n .. i*n+n-1``
    (``i``: the task's position among chief and workers), ``LOCAL_RANK`` picks the
    device, and ``GROUP_RANK`` is the task's position. All share the task's TF_CONFIG.
    """
    n = config.replicas_of(task)
    if n == 1:
        return []
    placed = rank_of(spec, task)
    if placed is None:
        raise ValueError(f"{task} is not a replica task of this cluster")
    position, hosts = placed
    world = hosts * n
    out = []
    for replica in range(n):
        rank = position * n + replica
        out.append(
            {
                Torchrun.RANK: str(rank),
                Torchrun.WORLD_SIZE: str(world),
                Torchrun.LOCAL_RANK: str(replica),
                Torchrun.LOCAL_WORLD_SIZE: str(n),
                Torchrun.GROUP_RANK: str(position),
                Torchrun.GROUP_WORLD_SIZE: str(hosts),
                Torchrun.ROLE_RANK: str(rank),
                Torchrun.ROLE_WORLD_SIZE: str(world),
                ENV_REPLICA: str(replica),
            }
        )
    return out
