"""The manager's side of fencing: a relaunched task's ps tasks hear of it first.

When the manager relaunches a task alone (a respawn), the old launch may still be
alive somewhere, cut off by a partition. The dispatcher lives in the manager and hears
of the relaunch in process; each ps task hears of it here, through ``ps.fence``
(``rpc/fencing.py``), before the replacement is launched. A ps answers once no request
of the old launch is still being served, so from then on nothing of it applies there,
even before the replacement's first request (docs/failure-semantics.md, "Fencing").
"""

from __future__ import annotations

import logging
import os

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.cluster.contract import ENV_SECRET_FILE
from clusterflow.manager.config import RunConfig
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.tasks import TaskRecord
from clusterflow.rpc import Credentials
from clusterflow.rpc.fencing import Fence, announce

log = logging.getLogger(__name__)


def cluster_credentials(cluster: ClusterDir, config: RunConfig) -> Credentials:
    """The cluster's credentials, read the tasks' way (``CLUSTERFLOW_AUTH`` means the
    same to the manager and to them)."""
    credentials = Credentials.from_env(
        {**os.environ, **config.env, ENV_SECRET_FILE: str(cluster.secret_file)}
    )
    assert credentials is not None  # the secret file was written with the cluster
    return credentials


def fence_ps_tasks(
    cluster: ClusterDir, config: RunConfig, spec: ClusterSpec | None, task: TaskRecord
) -> dict[str, str]:
    """Tells every ps task of ``spec`` that ``task``'s launch now coming is its newest
    (incarnation ``task.restarts``); records a ``fence_missed`` event for those that
    did not confirm in time, which learn of it from the replacement's first request.

    Returns:
        The ps addresses that did not confirm, with why.
    """
    if spec is None or "ps" not in spec.jobs:
        return {}
    addresses = [
        spec.task_address("ps", i) for i in spec.task_indices("ps") if TaskId("ps", i) != task.id
    ]
    fence = Fence(str(task.id), task.restarts)
    missed = announce(addresses, cluster_credentials(cluster, config), fence)
    if missed:
        cluster.append_event("fence_missed", task=str(task.id), ps=sorted(missed))
    return missed
