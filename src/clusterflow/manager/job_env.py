"""The environment of a task: its supervisor's, its job command's, its replicas'.

Pure functions of the run's config, the spec and what changed since the run began
(``Incarnation``), like ``policy.decide``: no processes, no clock, no I/O, so every
variable is tested without a cluster (``tests/unit/test_job_env.py``). The names come
from ``cluster/contract.py``; docs/architecture.md section 3 says who reads them.
"""

from __future__ import annotations

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


def ranks(config: RunConfig) -> list[TaskId]:
    """The tasks that train, in rank order: the chief, then the workers by index."""
    return [t for t in config.tasks() if t.job in REPLICA_JOBS]


def rank_of(config: RunConfig, task: TaskId) -> tuple[int, int] | None:
    """``task``'s position in ``ranks(config)`` and that list's length, in O(1).

    Each of a cluster's tasks asks for this when it registers: building the list each
    time made registering 1,000 tasks cost a million ``TaskId``s (docs/scaling.md).
    """
    if task.job not in REPLICA_JOBS:
        return None
    chief = 1 if config.chief else 0
    world = chief + config.workers
    position = 0 if task.job == "chief" else chief + task.index
    if (task.job == "chief" and not chief) or not 0 <= position < world:
        return None
    return position, world


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
    placed = rank_of(config, task)
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


def replica_env(config: RunConfig, task: TaskId) -> list[dict[str, str]]:
    """Per-process overrides when ``task`` runs several replicas; [] when it runs one.

    The task stands for a host with ``n`` devices, as a torchrun node with
    ``--nproc-per-node n``: its processes hold the contiguous ranks ``i*n .. i*n+n-1``
    (``i``: the task's position among chief and workers), ``LOCAL_RANK`` picks the
    device, and ``GROUP_RANK`` is the task's position. All share the task's TF_CONFIG.
    """
    n = config.replicas_of(task)
    if n == 1:
        return []
    placed = rank_of(config, task)
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
