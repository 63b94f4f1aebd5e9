"""Where the CLI finds a Ray cluster's head agent without joining Ray: a record per address.

``clusterflow ray-agents start``, and a launch that joined Ray and found the head's agent
(``ray_host``), ask the agent for its port (``NodeAgent.port``) and keep what it answers
in ``$CLUSTERFLOW_HOME/ray-agents/<address>.json`` (mode 0600: it holds the port's
secret), named by the Ray address as the user gives it (``--address``, else
``RAY_ADDRESS``, else ``auto``). A later launch, ``ps``, ``logs`` or ``stop`` with the
same address opens the port from it (``open_port``) and imports no Ray.

A record outlives what it names when the agents or the Ray cluster end without
``ray-agents stop`` from this home (``ray stop``, a crash, another machine's stop). Such
a record is never trusted: ``open_port`` checks the agent answers there, for its node and
with this clusterflow's code, within ``agent_port``'s short deadlines, and returns None
otherwise, with one log line naming the record; the caller then joins Ray as it would
without agents, and that launch writes the record anew.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from clusterflow._files import write_json_atomic
from clusterflow.backends import ray_agent
from clusterflow.backends.agent_port import AgentPort, AgentPortUnavailable
from clusterflow.errors import ConfigError
from clusterflow.manager import registry
from clusterflow.rpc import Credentials

log = logging.getLogger(__name__)

FOLDER = "ray-agents"


def address_of(address: str | None) -> str:
    """The Ray address a command names: ``address``, else ``RAY_ADDRESS``, else ``auto``
    (as ``ray_driver.join`` reads it)."""
    return address or os.environ.get("RAY_ADDRESS") or "auto"


def path(address: str | None) -> Path:
    """The record of the Ray cluster at ``address`` (see ``address_of``)."""
    name = re.sub(r"[^A-Za-z0-9.-]", "_", address_of(address))
    return registry.home() / FOLDER / f"{name}.json"


def write(address: str | None, port: dict[str, Any]) -> None:
    """Keeps what ``NodeAgent.port`` answered as the record of ``address``."""
    record = {
        "ray_address": address_of(address),
        "address": str(port["address"]),
        "secret": str(port["secret"]),
        "node_id": str(port["node_id"]),
    }
    target = path(address)
    target.parent.mkdir(mode=0o700, exist_ok=True)
    write_json_atomic(target, record)  # a temporary file of mode 0600, renamed


def remove(address: str | None) -> None:
    """Forgets the record of ``address`` (``ray-agents stop``)."""
    with contextlib.suppress(FileNotFoundError):
        path(address).unlink()


def describe(address: str | None) -> str:
    """One line on the record of ``address`` for ``ray-agents status``: its port and
    whether the agent answers there now (checked as a launch checks it, ``open_port``'s
    deadlines), or that there is none, so launches join Ray."""
    where = path(address)
    if not where.exists():
        return f"no agent port recorded in {where}: launches join Ray"
    port = open_port(address)
    if port is None:
        return f"agent port recorded in {where} does not answer: launches join Ray"
    try:
        return f"agent port {port.address} answers (recorded in {where})"
    finally:
        port.close()


def open_port(address: str | None) -> AgentPort | None:
    """The head agent's port of the Ray cluster at ``address``, checked to answer; None
    where there is no record, or the record is stale (logged, one line). Waits at most
    ``agent_port.CONNECT_TIMEOUT_S`` + ``PING_DEADLINE_S``; never joins Ray."""
    where = path(address)
    try:
        record = json.loads(where.read_text())
        credentials = Credentials.from_hex(record["secret"])
        port_address, node_id = str(record["address"]), str(record["node_id"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        log.warning("ignoring the unreadable agent record %s (%s); joining Ray", where, exc)
        return None
    try:
        return AgentPort.open(
            port_address, credentials, node_id=node_id, fingerprint=ray_agent.fingerprint()
        )
    except AgentPortUnavailable as exc:
        log.warning("%s (recorded in %s); joining Ray instead", exc, where)
        return None
