"""The head agent's port (``backends/agent_port.py``) and its record
(``manager/agent_record.py``), without Ray: a fake agent behind a real ``PortServer``.

A launch trusts a recorded port only once the agent it names answers there (its node,
its code) within short deadlines; anything else (nothing listening, a hung agent, the
wrong secret, another node, other code) is ``AgentPortUnavailable``, which the launch
turns into one log line and a fallback to joining Ray (``open_port`` returns None).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterflow.backends import agent_port, ray_agent
from clusterflow.backends.agent_port import AgentPort, AgentPortUnavailable, NotHosted, PortServer
from clusterflow.manager import agent_record
from clusterflow.rpc import Credentials, MalformedBody

pytestmark = pytest.mark.timeout(60)

NODE = "n" * 56


class FakeAgent:
    """``NodeAgent``'s four served calls over a dict; ``hang`` makes ``ping`` wait."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.hang = threading.Event()
        self.released = threading.Event()

    def ping(self) -> dict[str, Any]:
        if self.hang.is_set():
            self.released.wait(30)
        return {
            "node_id": NODE,
            "fingerprint": ray_agent.fingerprint(),
            "objects": sorted(self.objects),
        }

    def make(self, key: str, module: str, name: str, *args: Any) -> None:
        self.objects[key] = [module, name, *args]

    def call(self, key: str, method: str, *args: Any) -> Any:
        return [method, self.objects[key], *args]

    def drop(self, key: str) -> None:
        self.objects.pop(key, None)


@pytest.fixture
def served() -> Iterator[tuple[FakeAgent, PortServer]]:
    agent = FakeAgent()
    server = PortServer(agent, "127.0.0.1")
    yield agent, server
    agent.released.set()
    server.stop()


def _open(server: PortServer, **kwargs: Any) -> AgentPort:
    settings: dict[str, Any] = {"node_id": NODE, "fingerprint": ray_agent.fingerprint()}
    settings.update(kwargs)
    credentials = settings.pop("credentials", server.credentials)
    return AgentPort.open(server.address, credentials, **settings)


def test_calls_reach_the_agent_by_key(served: tuple[FakeAgent, PortServer]) -> None:
    agent, server = served
    port = _open(server)
    try:
        port.make("m", "clusterflow.x", "Host", 1, {"a": b"\x00"})
        assert agent.objects == {"m": ["clusterflow.x", "Host", 1, {"a": b"\x00"}]}
        assert port.hosts("m") and not port.hosts("other")
        assert port.call("m", "pull", {"f": 3}, deadline=5) == [
            "pull",
            ["clusterflow.x", "Host", 1, {"a": b"\x00"}],
            {"f": 3},
        ]
        with pytest.raises(NotHosted):
            port.call("gone", "pull", deadline=5)
        with pytest.raises(MalformedBody, match="'_private' is not a public call"):
            port.call("m", "_private", deadline=5)
        port.drop("m")
        assert agent.objects == {}
    finally:
        port.close()


def test_a_port_where_nothing_listens_is_unavailable_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        # Refused at the connect: the ping (which would wait its deadline) never runs.
        with pytest.raises(AgentPortUnavailable, match=f"{address}: nothing listens there"):
            AgentPort.open(address, Credentials.generate(), node_id=NODE, fingerprint="f")


def test_a_hung_agent_is_unavailable_within_the_ping_deadline(
    served: tuple[FakeAgent, PortServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, server = served
    monkeypatch.setattr(agent_port, "PING_DEADLINE_S", 0.5)
    agent.hang.set()
    with pytest.raises(AgentPortUnavailable, match=r"within 0\.5"):
        _open(server)


def test_the_wrong_secret_another_node_or_other_code_is_unavailable(
    served: tuple[FakeAgent, PortServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, server = served
    monkeypatch.setattr(agent_port, "PING_DEADLINE_S", 0.5)
    with pytest.raises(AgentPortUnavailable, match=server.address):
        _open(server, credentials=Credentials.generate())
    with pytest.raises(AgentPortUnavailable, match=r"answers for node 'n+', not 'other'"):
        _open(server, node_id="other")
    with pytest.raises(AgentPortUnavailable, match="runs other code"):
        _open(server, fingerprint="0" * 16)


def test_the_record_opens_the_port_and_a_stale_one_is_none_with_one_line(
    served: tuple[FakeAgent, PortServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, server = served
    monkeypatch.setenv("CLUSTERFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert agent_record.open_port("10.0.0.1:6379") is None  # no record: nothing logged
    assert not caplog.records
    port = {"address": server.address, "secret": server.credentials.to_hex(), "node_id": NODE}
    agent_record.write("10.0.0.1:6379", port)
    where = tmp_path / "ray-agents" / "10.0.0.1_6379.json"
    assert where.stat().st_mode & 0o777 == 0o600  # it holds the port's secret
    opened = agent_record.open_port("10.0.0.1:6379")
    assert opened is not None and opened.address == server.address
    opened.close()
    assert agent_record.open_port("auto") is None  # another address, another record

    server.stop()  # the agent is gone; its record stays behind
    with caplog.at_level(logging.WARNING):
        assert agent_record.open_port("10.0.0.1:6379") is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"{server.address}: nothing listens there" in line and str(where) in line, line
    assert line.endswith("joining Ray instead"), line

    where.write_text(json.dumps({**port, "secret": "not hex"}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert agent_record.open_port("10.0.0.1:6379") is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"ignoring the unreadable agent record {where}" in line, line
    agent_record.remove("10.0.0.1:6379")
    assert not where.exists()
