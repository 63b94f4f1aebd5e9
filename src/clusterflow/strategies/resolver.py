"""Where a strategy learns its cluster: the spec, its own task and the credentials.

Kept apart from the spec (a value), as TensorFlow keeps ``ClusterResolver`` apart from
``ClusterSpec``. ``TFConfigClusterResolver`` reads what ``clusterflow start`` injected;
``SimpleClusterResolver`` takes values from code (tests, manual mode).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from clusterflow.cluster import ClusterSpec, ClusterSpecLike, TaskId, TFConfig
from clusterflow.errors import ConfigError
from clusterflow.rpc import Credentials


@dataclass(frozen=True, slots=True)
class ClusterResolver:
    """A resolved cluster: what every strategy needs to find its peers."""

    cluster_spec: ClusterSpec
    task: TaskId | None
    credentials: Credentials | None

    @property
    def task_type(self) -> str | None:
        return self.task.job if self.task else None

    @property
    def task_id(self) -> int | None:
        return self.task.index if self.task else None

    @property
    def is_chief(self) -> bool:
        """The chief task, or any task of a cluster that has none (a single process)."""
        if self.task is None:
            return True
        return self.cluster_spec.is_chief(self.task)

    def num_workers(self) -> int:
        """Tasks that compute: the chief and the workers."""
        jobs = self.cluster_spec.jobs
        return sum(self.cluster_spec.num_tasks(j) for j in ("chief", "worker") if j in jobs)

    def require_credentials(self) -> Credentials:
        if self.credentials is None:
            raise ConfigError(
                "no cluster credentials: run under `clusterflow start`, or set "
                "CLUSTERFLOW_SECRET_FILE, or pass credentials to the resolver"
            )
        return self.credentials


def TFConfigClusterResolver(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The cluster that ``TF_CONFIG`` (and the launcher's secret) describes.

    Raises:
        ConfigError: ``TF_CONFIG`` is unset or invalid.
    """
    env = dict(os.environ if environ is None else environ)
    config = TFConfig.from_env(env)
    if config is None:
        raise ConfigError("TF_CONFIG is not set: start the job with `clusterflow start`")
    return ClusterResolver(config.cluster, config.task, Credentials.from_env(env))


def SimpleClusterResolver(
    cluster_spec: ClusterSpecLike,
    task_type: str | None = None,
    task_id: int | None = None,
    credentials: Credentials | None = None,
) -> ClusterResolver:
    """A resolver from values, as ``tf.distribute.cluster_resolver.SimpleClusterResolver``."""
    spec = ClusterSpec(cluster_spec)
    task = None
    if task_type is not None:
        spec.task_address(task_type, task_id or 0)  # raises naming a bad job or index
        task = TaskId(task_type, task_id or 0)
    return ClusterResolver(spec, task, credentials)
