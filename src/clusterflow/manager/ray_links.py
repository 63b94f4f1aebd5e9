"""How the CLI calls a cluster's manager on Ray: over Ray (its own actor, or hosted by
the head node's agent) or through the head agent's own port, with no Ray in the CLI's
process (``agent_port``, docs/ray.md "Launch time"). ``ray_host.ManagerHandle`` holds
one link and keeps the local folder a mirror through it."""

from __future__ import annotations

import contextlib
from typing import Any

from clusterflow.backends import ray_agent
from clusterflow.backends.agent_port import AgentPort
from clusterflow.errors import ClusterflowError
from clusterflow.rpc import RpcError

CALL_DEADLINE_S = 30.0
"""Deadline of a call from the CLI to the manager actor."""


class Hosted:
    """A manager hosted by the head node's agent (``ray_agent``), called as its own
    actor would be: ``hosted.pull.remote(offsets)`` is the agent's ``call``."""

    def __init__(self, agent: Any, key: str) -> None:
        self.agent = agent
        self.key = key

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        agent, key = self.agent, self.key

        class Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                return agent.call.remote(key, method, *args)

        return Method

    @classmethod
    def find(cls, key: str) -> Hosted | None:
        """The manager ``key`` if the head's agent hosts it; None otherwise."""
        import ray

        agent = ray_agent.find_head_agent()
        if agent is None:
            return None
        try:
            got = ray.get(agent.ping.remote(), timeout=ray_agent.PING_DEADLINE_S)
        except ray.exceptions.RayError:
            return None
        return cls(agent, key) if key in got["objects"] else None

    def end(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.drop.remote(self.key)


class ManagerGone(ClusterflowError):
    """The manager did not answer a call within its deadline: it ended, its node or its
    agent died, or (through the agent's port) the agent is gone."""


class RayLink:
    """The CLI's calls to a manager over Ray: its own actor, or ``Hosted`` in the head's
    agent (the process joined Ray)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def call(self, method: str, *args: Any, deadline: float) -> Any:
        """``method(*args)`` of the manager, waited for at most ``deadline`` seconds.

        Raises:
            ManagerGone: Ray says it is gone, or it did not answer in time.
        """
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=deadline)
        except ray.exceptions.RayError as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ManagerGone(f"the manager did not answer {method}: {why}") from exc

    def end(self) -> None:
        """Lets the manager end: told it may, then dropped from its agent (which lives on
        for the next run) or its actor killed."""
        import ray

        with contextlib.suppress(ManagerGone):
            self.call("release", deadline=CALL_DEADLINE_S)
        if isinstance(self.actor, Hosted):
            self.actor.end()
        else:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(self.actor, no_restart=True)


class PortLink:
    """The CLI's calls to a manager hosted by the head's agent, through the agent's port
    (``agent_port``): no Ray in this process."""

    def __init__(self, port: AgentPort, key: str) -> None:
        self.port = port
        self.key = key

    def call(self, method: str, *args: Any, deadline: float) -> Any:
        """``method(*args)`` of the manager, waited for at most ``deadline`` seconds.

        Raises:
            ManagerGone: the agent hosts it no more, or did not answer in time.
        """
        try:
            return self.port.call(self.key, method, *args, deadline=deadline)
        except RpcError as exc:
            raise ManagerGone(f"the manager did not answer {method}: {exc}") from exc

    def end(self) -> None:
        """Lets the manager end: told it may, then dropped from the agent."""
        with contextlib.suppress(ManagerGone):
            self.call("release", deadline=CALL_DEADLINE_S)
        with contextlib.suppress(RpcError):
            self.port.drop(self.key)
        self.port.close()
