"""A job's line to the manager of ``clusterflow start``: how it recovers, how it fares.

A task's job is a child of its supervisor, which heartbeats for it; but only the job
knows whether it can be relaunched alone (a worker of a parameter-server strategy), how
far its training got, and when a peer moved. It tells the manager directly, at
``CLUSTERFLOW_MANAGER`` with the cluster's credentials: the one client of the manager's
job-facing methods (``manager.declare``, ``manager.spec``, ``task.report``). Outside a
cluster there is no link at all; a manager that does not answer costs one short deadline
and a warning, never the training.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from clusterflow.cluster.contract import ENV_MANAGER, ENV_TASK
from clusterflow.rpc import Credentials, MalformedBody, RpcClient, RpcError
from clusterflow.server.manager_messages import (
    CheckpointsReply,
    CheckpointsRequest,
    DeclareReply,
    DeclareRequest,
    ReportRequest,
    SpecReply,
    SpecRequest,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEADLINE_S = 2.0
"""Every call's deadline: the manager answers at once, or it is gone."""


class ManagerLink:
    """The calls a job makes to its manager; ``None`` from :meth:`from_env` outside one.

    Thread-safe: calls are serialised on one connection.
    """

    def __init__(
        self, address: str, credentials: Credentials, task: str, *, deadline_s: float = DEADLINE_S
    ) -> None:
        self.address = address
        self.task = task
        self.deadline_s = deadline_s
        self._client = RpcClient(address, credentials, deadline=deadline_s)
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, task: str | None = None
    ) -> ManagerLink | None:
        """The link of a task started by ``clusterflow start``; None outside a cluster.

        Args:
            environ: the environment to read (default: this process's).
            task: this task's name when the environment has none (``CLUSTERFLOW_TASK``).

        Raises:
            ConfigError: the cluster's secret is named but cannot be read.
        """
        env = os.environ if environ is None else environ
        address, task = env.get(ENV_MANAGER), env.get(ENV_TASK) or task
        if not address or not task:
            return None
        credentials = Credentials.from_env(dict(env))
        if credentials is None:
            return None
        return cls(address, credentials, task)

    def declare(self, *, respawnable: bool, resizable: bool | None = None) -> DeclareReply | None:
        """Whether the manager may relaunch this task alone when it dies, and whether
        the cluster may grow and shrink around it (``clusterflow scale``; None: not
        said, so it may not). Returns the manager's answer (``max_restarts``, and
        ``elastic``: whether the cluster has a worker range), None when it did not
        answer. Never raises."""
        request = DeclareRequest(task=self.task, respawnable=respawnable, resizable=resizable)
        return self._quiet(request.METHOD, request.to_wire(), DeclareReply.from_wire)

    def checkpoints_at(self, url: str) -> bool:
        """Tells the manager that this job's checkpoints live at ``url`` (the chief's
        own ``--checkpoint-dir``), so a whole restart restores every task, the ps tasks
        and the data cursor from there. Whether the manager took it (never raises)."""
        request = CheckpointsRequest(task=self.task, url=url)
        reply = self._quiet(request.METHOD, request.to_wire(), CheckpointsReply.from_wire)
        return reply is not None

    def spec(self) -> SpecReply | None:
        """The newest cluster spec and its version (a respawned task may have moved).

        None when the manager did not answer (never raises).
        """
        request = SpecRequest()
        return self._quiet(request.METHOD, request.to_wire(), SpecReply.from_wire)

    def report(self, *, step: int, loss: float | None, samples_per_s: float | None) -> None:
        """Sends live figures now, for ``clusterflow ps`` and stall detection.

        Most callers want ``clusterflow.train.report``, which rate-limits, sends from a
        background thread and never raises.

        Raises:
            RpcError: the manager did not take them (``RemoteError`` with code
                ``not_found``: a manager that takes no figures at all).
        """
        request = ReportRequest(task=self.task, step=step, loss=loss, samples_per_s=samples_per_s)
        self.call(request.METHOD, request.to_wire())

    def call(self, method: str, body: Any) -> Any:
        """One call to the manager; returns the reply's body.

        Raises:
            RpcError: no answer within the deadline, or an error reply.
        """
        with self._lock:
            return self._client.call(method, body, deadline=self.deadline_s).body

    def close(self) -> None:
        with self._lock:
            self._client.close()

    def _quiet(self, method: str, body: Any, parse: Callable[[Any], T]) -> T | None:
        """``parse`` of the reply; None, with one warning, when the manager did not
        answer or answered what the contract does not allow (``MalformedBody``)."""
        try:
            return parse(self.call(method, body))
        except (RpcError, MalformedBody) as exc:
            if not self._warned:
                self._warned = True
                log.warning("manager %s did not take %s: %s", self.address, method, exc)
            return None
