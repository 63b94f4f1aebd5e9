"""The cluster manager: launches tasks, assembles the spec, watches them, decides."""

from __future__ import annotations

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
