"""Where a worker finds the dispatcher and what it is called, from the environment."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from clusterflow.cluster import TFConfig
from clusterflow.cluster.contract import ENV_DISPATCHER, ENV_MANAGER, ENV_TASK

__all__ = ["ENV_DISPATCHER", "ENV_MANAGER", "ENV_TASK", "default_worker_name", "resolve_dispatcher"]


def default_worker_name(environ: Mapping[str, str] | None = None) -> str:
    """This process's task (``worker:1``), as the manager names it; else ``host:pid``."""
    env = os.environ if environ is None else environ
    if env.get(ENV_TASK):
        return env[ENV_TASK]
    config = TFConfig.from_env(env)
    if config is not None and config.task is not None:
        return str(config.task)
    return f"{socket.gethostname()}:{os.getpid()}"


def resolve_dispatcher(environ: Mapping[str, str] | None = None) -> str | None:
    """Where this task finds the data dispatcher, or None outside a cluster.

    In order: ``CLUSTERFLOW_DISPATCHER``; the manager (``CLUSTERFLOW_MANAGER``, under
    ``clusterflow start``); the chief's address in ``TF_CONFIG`` (manual mode, where the
    chief hosts the dispatcher on its ``Server``).
    """
    env = os.environ if environ is None else environ
    for key in (ENV_DISPATCHER, ENV_MANAGER):
        if env.get(key):
            return env[key]
    config = TFConfig.from_env(env)
    if config is not None and config.cluster.chief is not None:
        chief = config.cluster.chief
        return config.cluster.task_address(chief.job, chief.index)
    return None
