"""The cluster manager: launches tasks, assembles the spec, watches them, decides.

Names are imported on first use, so ``clusterflow ps``/``describe``/``logs`` (which
need only the registry) do not pay for the controller's RPC stack at every call.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    "ClusterStatus": "policy",
    "Controller": "controller",
    "Decision": "policy",
    "RunConfig": "config",
    "TaskStatus": "policy",
    "Verdict": "policy",
    "decide": "policy",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
