"""The cluster manager: launches tasks, assembles the spec, watches them, decides.

Names are imported on first use, so ``clusterflow ps``/``describe``/``logs`` (which
need only the registry) do not pay for the controller's RPC stack at every call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clusterflow._lazy import lazy_exports

if TYPE_CHECKING:
    from clusterflow.manager.config import RunConfig
    from clusterflow.manager.controller import Controller
    from clusterflow.manager.policy import ClusterStatus, Decision, TaskStatus, Verdict, decide

__all__ = [
    "ClusterStatus",
    "Controller",
    "Decision",
    "RunConfig",
    "TaskStatus",
    "Verdict",
    "decide",
]

_HOMES = {
    "ClusterStatus": "clusterflow.manager.policy",
    "Controller": "clusterflow.manager.controller",
    "Decision": "clusterflow.manager.policy",
    "RunConfig": "clusterflow.manager.config",
    "TaskStatus": "clusterflow.manager.policy",
    "Verdict": "clusterflow.manager.policy",
    "decide": "clusterflow.manager.policy",
}


__getattr__ = lazy_exports(__name__, _HOMES)
