"""A job's line to the manager of ``clusterflow start``: how it recovers, how it fares.

A task's job is a child of its supervisor, which heartbeats for it; but only the job
knows whether it can be relaunched alone (a worker of a parameter-server strategy) and
how far its training got. It tells the manager directly, at ``CLUSTERFLOW_MANAGER`` with
the cluster's credentials. Outside a cluster every call is a no-op; a manager that does
not answer costs one short deadline and a warning, never the training.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from clusterflow.rpc import Credentials, RpcClient, RpcError

log = logging.getLogger(__name__)

ENV_MANAGER = "CLUSTERFLOW_MANAGER"
ENV_TASK = "CLUSTERFLOW_TASK"
DEADLINE_S = 2.0


class ManagerLink:
    """The calls a job makes to its manager; ``None`` from :meth:`from_env` outside one."""

    def __init__(self, address: str, credentials: Credentials, task: str) -> None:
        self.address = address
        self.task = task
        self._client = RpcClient(address, credentials, deadline=DEADLINE_S)
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ManagerLink | None:
        env = os.environ if environ is None else environ
        address, task = env.get(ENV_MANAGER), env.get(ENV_TASK)
        if not address or not task:
            return None
        credentials = Credentials.from_env(dict(env))
        if credentials is None:
            return None
        return cls(address, credentials, task)

    def declare(self, *, respawnable: bool) -> None:
        """Whether the manager may relaunch this task alone when it dies."""
        self._call("manager.declare", {"task": self.task, "respawnable": respawnable})

    def report(self, **figures: Any) -> None:
        """Live figures (step, loss, samples_per_s) for ``clusterflow ps`` and stall checks."""
        self._call("task.report", {"task": self.task, **figures})

    def spec(self) -> dict[str, Any] | None:
        """The newest cluster spec and its version (a respawned task may have moved)."""
        reply = self._call("manager.spec", None)
        return reply if isinstance(reply, dict) else None

    def close(self) -> None:
        with self._lock:
            self._client.close()

    def _call(self, method: str, body: Any) -> Any:
        try:
            with self._lock:
                return self._client.call(method, body, deadline=DEADLINE_S).body
        except RpcError as exc:
            if not self._warned:
                self._warned = True
                log.warning("manager %s did not take %s: %s", self.address, method, exc)
            return None
