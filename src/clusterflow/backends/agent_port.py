"""The head agent's own port: a launch reaches it without importing Ray or joining it.

With agents (``ray_agent``), a launch on Ray starts no Ray worker, but the CLI still
imported Ray (about 1 s quiet, 2.3 s loaded) and joined the cluster as a driver before
it could ask the head's agent for a manager: that join was most of what a Ray launch
cost beyond a local one (docs/ray.md, "Launch time"). So the agent also serves the few
calls a launch and the commands that follow a cluster make (``make`` a manager,
``call`` one of its methods, ``drop`` it, ``ping``) on a port of its own, over
clusterflow's RPC layer: deadlines on every call, and the cluster-secret authentication
of every other endpoint (CURVE beyond loopback; the agent binds its node's address, as
a manager does).

The secret is the agent's own, made when it first serves. It leaves the agent only in
the reply of ``NodeAgent.port``, a Ray call (Ray's own connection, as a cluster's secret
reaches its manager), to ``clusterflow ray-agents start`` or a launch that joined Ray,
which keep it (mode 0600) in ``$CLUSTERFLOW_HOME`` beside the address
(``manager/agent_record.py``). Whoever holds it may make and call managers in the agent,
as anyone who can run code on the Ray cluster can anyway.

This module is the wire contract (each request typed once, parsed by the server with
the same types the client builds) and both ends: ``serve`` in the agent, ``AgentPort``
in the CLI. It imports nothing of Ray.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from clusterflow.errors import ClusterflowError
from clusterflow.rpc import (
    CodedError,
    Credentials,
    MalformedBody,
    Request,
    RpcClient,
    RpcError,
    RpcServer,
    body_map,
    split_endpoint,
)

log = logging.getLogger(__name__)

PING: Final = "agent.ping"
MAKE: Final = "agent.make"
CALL: Final = "agent.call"
DROP: Final = "agent.drop"
CONNECT_TIMEOUT_S = 2.0
"""How long the recorded address may take to accept a TCP connection. A stale record
(the agent or its whole Ray cluster gone) is refused at once; a lost host is silent,
and the launch falls back to joining Ray after this long."""
PING_DEADLINE_S = 5.0
"""How long a connected agent may take to answer ``ping`` before the launch falls back
(a hung agent; the Ray path then replaces it within ``ray_agent.PING_DEADLINE_S``)."""
CALL_DEADLINE_S = 60.0
"""Default deadline of ``make`` and ``drop``: a manager's making reads no more than its
config, writes its folder and imports the manager's modules in the agent."""


class NotHosted(CodedError):
    """Nothing is hosted under the key asked for (it ended, or never was)."""

    wire_code = "agent_not_hosted"


class AgentPortUnavailable(ClusterflowError):
    """The recorded agent port does not answer as the agent it names (gone, hung, of
    other code or another Ray cluster): the caller falls back to joining Ray."""


class PortedAgent(Protocol):
    """What the port serves: ``ray_agent.NodeAgent``'s calls of the same names."""

    def ping(self) -> dict[str, Any]: ...

    def make(self, key: str, module: str, name: str, *args: Any) -> None: ...

    def call(self, key: str, method: str, *args: Any) -> Any: ...

    def drop(self, key: str) -> None: ...


# The wire contract -----------------------------------------------------------------


def _key(method: str, b: Mapping[str, Any], field: str = "key") -> str:
    value = b.get(field)
    if not isinstance(value, str) or not value:
        raise MalformedBody(f"{method}: {field} must be a non-empty string, got {value!r:.80}")
    return value


def _args(method: str, b: Mapping[str, Any]) -> tuple[Any, ...]:
    value = b.get("args", [])
    if not isinstance(value, list | tuple):
        raise MalformedBody(f"{method}: args must be a list, got {value!r:.80}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class MakeRequest:
    """Make ``module.name(*args)`` in the agent under ``key`` (``NodeAgent.make``)."""

    key: str
    module: str
    name: str
    args: tuple[Any, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key, "module": self.module, "name": self.name, "args": self.args}

    @classmethod
    def from_wire(cls, body: Any) -> MakeRequest:
        b = body_map(f"{MAKE} body", body)
        return cls(_key(MAKE, b), _key(MAKE, b, "module"), _key(MAKE, b, "name"), _args(MAKE, b))


@dataclass(frozen=True, slots=True)
class CallRequest:
    """Call ``method(*args)`` of what the agent hosts under ``key`` (``NodeAgent.call``).
    A name that starts with ``_`` is refused: only an object's public calls are served."""

    key: str
    method: str
    args: tuple[Any, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key, "method": self.method, "args": self.args}

    @classmethod
    def from_wire(cls, body: Any) -> CallRequest:
        b = body_map(f"{CALL} body", body)
        method = _key(CALL, b, "method")
        if method.startswith("_"):
            raise MalformedBody(f"{CALL}: method {method!r} is not a public call")
        return cls(_key(CALL, b), method, _args(CALL, b))


@dataclass(frozen=True, slots=True)
class DropRequest:
    """Forget what the agent hosts under ``key`` (``NodeAgent.drop``)."""

    key: str

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key}

    @classmethod
    def from_wire(cls, body: Any) -> DropRequest:
        return cls(_key(DROP, body_map(f"{DROP} body", body)))


# The agent's side ------------------------------------------------------------------


class PortServer:
    """The port of one agent: an ``RpcServer`` on ``host`` (its node's address) whose
    handlers call ``agent``. Every handler may wait (a manager's ``start`` places the
    whole cluster), so all run on the server's pool, never on its loop."""

    def __init__(self, agent: PortedAgent, host: str) -> None:
        self.credentials = Credentials.generate()
        self._agent = agent
        self._server = RpcServer(
            self.credentials, host=host, name="agent-port", workers=16, tensors=False
        )
        handlers: dict[str, Callable[[Request], Any]] = {
            PING: lambda _request: agent.ping(),
            MAKE: self._make,
            CALL: self._call,
            DROP: self._drop,
        }
        for method, handler in handlers.items():
            self._server.register(method, handler, blocking=True)
        self._server.start()

    @property
    def address(self) -> str:
        return self._server.address

    def _make(self, request: Request) -> None:
        made = MakeRequest.from_wire(request.body)
        self._agent.make(made.key, made.module, made.name, *made.args)

    def _call(self, request: Request) -> Any:
        called = CallRequest.from_wire(request.body)
        try:
            return self._agent.call(called.key, called.method, *called.args)
        except KeyError:
            raise NotHosted(f"nothing is hosted under {called.key!r} on this agent") from None

    def _drop(self, request: Request) -> None:
        self._agent.drop(DropRequest.from_wire(request.body).key)

    def stop(self) -> None:
        self._server.stop()


_serving_lock = threading.Lock()


def serve_once(agent: PortedAgent, host: str, slot: list[PortServer]) -> PortServer:
    """The agent's one ``PortServer`` (kept in ``slot``), started on first use."""
    with _serving_lock:
        if not slot:
            slot.append(PortServer(agent, host))
        return slot[0]


# The CLI's side --------------------------------------------------------------------


class AgentPort:
    """The CLI's connection to a head agent's port, checked before use (``open``).

    Every call has a deadline; every failure other than the agent's own typed answer is
    an ``RpcError`` for the caller to turn into its one line.
    """

    def __init__(self, address: str, credentials: Credentials, ping: Mapping[str, Any]) -> None:
        self.address = address
        self.info = dict(ping)
        """What the agent answered to ``ping`` when opened (its node, pid, what it hosts)."""
        self._client = RpcClient(address, credentials, deadline=CALL_DEADLINE_S)

    @classmethod
    def open(
        cls, address: str, credentials: Credentials, *, node_id: str, fingerprint: str
    ) -> AgentPort:
        """Connects to ``address`` and checks that the agent of ``node_id`` running code of
        ``fingerprint`` answers there. Waits at most ``CONNECT_TIMEOUT_S`` for the TCP
        connection and ``PING_DEADLINE_S`` for the answer.

        Raises:
            AgentPortUnavailable: nothing listens there, it does not answer in time (a
                hung agent, or a process that does not hold the secret's key), or
                another agent (node, code) answers; the message says which, in one line.
        """
        host, _ = split_endpoint(address)
        port = int(address.rsplit(":", 1)[1])
        try:
            with socket.create_connection((host, port), CONNECT_TIMEOUT_S):
                pass
        except OSError as exc:
            why = "nothing listens there" if isinstance(exc, ConnectionRefusedError) else exc
            raise AgentPortUnavailable(f"the agent port {address}: {why}") from None
        client = RpcClient(address, credentials, deadline=PING_DEADLINE_S)
        try:
            got = client.call(PING).body
        except RpcError as exc:
            raise AgentPortUnavailable(f"the agent port {address}: {exc}") from None
        finally:
            client.close()
        if not isinstance(got, Mapping) or got.get("node_id") != node_id:
            node = got.get("node_id") if isinstance(got, Mapping) else got
            raise AgentPortUnavailable(
                f"the agent port {address} answers for node {node!r}, not {node_id!r}"
            )
        if got.get("fingerprint") != fingerprint:
            raise AgentPortUnavailable(f"the agent at {address} runs other code")
        return cls(address, credentials, got)

    def make(self, key: str, module: str, name: str, *args: Any) -> None:
        """Makes ``module.name(*args)`` in the agent under ``key``.

        Raises:
            RpcError: no answer within ``CALL_DEADLINE_S``, or the agent refused it.
        """
        self._client.call(MAKE, MakeRequest(key, module, name, args).to_wire())

    def call(self, key: str, method: str, *args: Any, deadline: float) -> Any:
        """``method(*args)`` of what the agent hosts under ``key``, within ``deadline``.

        Raises:
            NotHosted: nothing is hosted under ``key`` (typed: ``RemoteNotHosted``).
            RpcError: no answer in time, or the call raised there.
        """
        body = CallRequest(key, method, args).to_wire()
        return self._client.call(CALL, body, deadline=deadline).body

    def drop(self, key: str) -> None:
        """Forgets what is hosted under ``key`` (no error if nothing is).

        Raises:
            RpcError: no answer within ``CALL_DEADLINE_S``.
        """
        self._client.call(DROP, DropRequest(key).to_wire())

    def hosts(self, key: str) -> bool:
        """Whether the agent hosts ``key`` now (one ``ping``, within its deadline).

        Raises:
            RpcError: no answer in time.
        """
        got = self._client.call(PING, deadline=PING_DEADLINE_S).body
        return key in (got.get("objects") or ())

    def close(self) -> None:
        self._client.close()
