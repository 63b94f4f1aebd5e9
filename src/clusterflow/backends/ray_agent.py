"""One long-lived clusterflow agent per Ray node, so that a launch starts no Ray worker.

A Ray actor runs in a worker process of its own, and Ray starts workers per job: every
``clusterflow start`` is a new job, so each task's actor (``ray_actor.SupervisorHost``)
used to wait for a fresh Python process to start and import Ray before its supervisor
could. An agent (``NodeAgent``) is a detached actor pinned to one node, named
``clusterflow-agent-<node id>`` in the namespace ``clusterflow``, that hosts any
number of supervisors in its one, already running, process: a launch is one call to it.

Enabled per Ray cluster, not per run: ``clusterflow ray-agents start`` records it in
Ray's key-value store (``KV_KEY``, gone with the cluster's head, so ``ray stop`` ends
it along with the agents) and starts an agent on every live node. While enabled, a
launch on a node without a live agent (a node that joined later, or one whose agent
crashed) starts one there and keeps it. Without it, launches start one actor per task
as before, so a Ray cluster holds nothing of clusterflow's between runs unless asked to.

Agents hold no Ray resources (``num_cpus=0``): the cluster's placement group reserves
every bundle (gang placement, per start and per grow, is unchanged), and the supervisor
an agent starts for a bundle's task runs on the node Ray placed that bundle on. Ray
cannot assign GPUs or a job's runtime environment (``--job-dir``) to a process it did
not start, so a task that asks for GPUs, and every task of a run with a runtime
environment, keeps its own actor (``RayBackend.launch`` decides).

An agent is never trusted blindly: each launch pings it within ``PING_DEADLINE_S``; one
that does not answer (dead, hung) is killed and replaced by a fresh one on the same node,
so a launch never waits on a dead agent for longer than that deadline. An agent started
from other code (another clusterflow) is replaced the same way (``fingerprint``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from clusterflow.backends import agent_port, forkserver
from clusterflow.backends.ray_actor import SupervisorHost
from clusterflow.backends.ray_driver import NAMESPACE
from clusterflow.errors import ClusterflowError, ConfigError

log = logging.getLogger(__name__)

PREFIX: Final = "clusterflow-agent-"
KV_KEY: Final = b"clusterflow:agents"
"""Set in Ray's key-value store while agents are enabled on the Ray cluster."""
PING_DEADLINE_S = 10.0
"""How long an agent may take to answer before it is counted dead and replaced (a fresh
one's first answer included: a new Ray worker starts within it on a loaded machine)."""
START_DEADLINE_S = 60.0
"""How long a fresh agent may take to start (a new Ray worker process and its imports)."""
MAX_CONCURRENCY = 64
"""Calls an agent serves at once: each hosted task has one output read waiting (up to
``ray_actor.READ_WAIT_S``) most of the time, and a signal must not queue behind them."""


def agent_name(node_id: str) -> str:
    return f"{PREFIX}{node_id}"


@functools.cache
def fingerprint() -> str:
    """A digest of the code an agent runs in its own process (this module and the host
    it makes): an agent whose code differs is replaced, not reused."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    code = ("ray_agent.py", "ray_actor.py", "memory_watch.py", "agent_port.py", "forked.py")
    for name in (*code, "forkserver.py", "zygote.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


class NodeAgent:
    """The agent of one node (a detached Ray actor, see ``agent_class``): hosts the
    supervisors of the tasks placed on its node, each under a key its manager chose."""

    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self._hosts: dict[str, SupervisorHost] = {}
        self._objects: dict[str, Any] = {}
        """Objects it hosts for others, by key: the head's agent hosts managers
        (``manager/ray_host.py``: ``ManagerHost``, which this layer may not import)."""
        self._lock = threading.Lock()
        self._port: list[agent_port.PortServer] = []
        self._warm = forkserver.WarmServer()
        """This node's warm fork server (torch imported once, as the agent starts): the
        supervisors of the tasks this agent hosts are forked from it, as a local
        cluster's are from its manager's, so a launch here pays no interpreter and no
        ``import torch`` either. It serves every cluster's tasks on this node, so it
        carries no cluster's id."""
        self._warm.ensure(tagged=False)
        # The managers hosted here fork their torch store's helper from it too (a cold
        # one's `import torch` held every rank's init_process_group for most of a second).
        forkserver.lend(self._warm)

    def port(self) -> dict[str, Any]:
        """Its own port (``agent_port``: what a launch calls without joining Ray), started
        on the first call on this node's address: the address, the port's secret (hex)
        and this node, for the caller to record (``manager/agent_record.py``)."""
        import ray

        server = agent_port.serve_once(self, ray.util.get_node_ip_address(), self._port)
        return {
            "address": server.address,
            "secret": server.credentials.to_hex(),
            "node_id": self.node_id,
        }

    def ping(self) -> dict[str, Any]:
        """Its node, its code's ``fingerprint``, its process and what it hosts now."""
        import os

        with self._lock:
            hosted = sorted(self._hosts)
            objects = sorted(self._objects)
        return {
            "objects": objects,
            "node_id": self.node_id,
            "fingerprint": fingerprint(),
            "pid": os.getpid(),
            "hosted": hosted,
        }

    def launch(
        self,
        key: str,
        task: str,
        env: Mapping[str, str],
        secret: str,
        limit: float | None,
        assigned: Mapping[str, float],
    ) -> None:
        """Starts a task's supervisor under ``key`` (as ``SupervisorHost`` does in an
        actor of its own); ``assigned``: its bundle's resources, which ``info`` reports."""
        host = SupervisorHost(
            task, env, secret, limit, assigned=assigned, warm=self._warm.address()
        )
        with self._lock:
            old = self._hosts.pop(key, None)
            self._hosts[key] = host
        if old is not None:
            old.close()

    def _host(self, key: str) -> SupervisorHost:
        with self._lock:
            host = self._hosts.get(key)
        if host is None:
            raise KeyError(f"no task {key!r} on this agent")
        return host

    def info(self, key: str) -> dict[str, Any]:
        return self._host(key).info()

    def read(self, key: str, wait_s: float) -> dict[str, Any]:
        return self._host(key).read(wait_s)

    def signal(self, key: str, signum: int) -> None:
        with contextlib.suppress(KeyError):
            self._host(key).signal(signum)

    def hold_to(self, key: str, limit: float | None) -> None:
        with contextlib.suppress(KeyError):
            self._host(key).hold_to(limit)

    def end(self, key: str) -> None:
        """The task's manager let it go: what is left of its tree is killed."""
        with self._lock:
            host = self._hosts.pop(key, None)
        if host is not None:
            host.close()

    def make(self, key: str, module: str, name: str, *args: Any) -> None:
        """Makes ``module.name(*args)`` here under ``key`` (a class of clusterflow's, such
        as a cluster's manager): what a detached actor of its own would be, without a new
        Ray worker. An object with a ``release_hook`` attribute gets a function that drops
        it from here (its own end, as a lone actor ends its process)."""
        if not module.startswith("clusterflow."):
            raise ValueError(f"{module!r} is not clusterflow's: an agent hosts only its own")
        import importlib

        obj = getattr(importlib.import_module(module), name)(*args)
        if hasattr(obj, "release_hook"):
            obj.release_hook = functools.partial(self.drop, key)
        with self._lock:
            if key in self._objects:
                raise ValueError(f"{key!r} is hosted here already")
            self._objects[key] = obj

    def call(self, key: str, method: str, *args: Any) -> Any:
        """``method(*args)`` of the object hosted under ``key``.

        Raises:
            KeyError: nothing is hosted under ``key`` (it ended, or never was).
        """
        with self._lock:
            obj = self._objects[key]
        return getattr(obj, method)(*args)

    def drop(self, key: str) -> None:
        """Forgets the object hosted under ``key``, if any."""
        with self._lock:
            self._objects.pop(key, None)

    def shutdown(self) -> None:
        """Ends every hosted task (``ray-agents stop``), before the agent is killed."""
        with self._lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            host.close()


@functools.cache
def agent_class() -> Any:
    """``NodeAgent`` as a Ray actor class, made on first use (Ray is optional)."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=MAX_CONCURRENCY, max_restarts=0)(NodeAgent)


class AgentSlot:
    """A task hosted by the agent of the node its bundle is on: ``RayProcess``'s side.

    ``start`` (on the ``RayProcess``'s own thread, never the controller's) waits for the
    bundle to be on a live node, finds or replaces that node's agent and starts the
    supervisor there; the other methods return Ray object refs, as an actor's do.
    """

    def __init__(
        self,
        key: str,
        group: Any,
        index: int,
        launch_args: tuple[str, Mapping[str, str], str, float | None, Mapping[str, float]],
    ) -> None:
        self.key = key
        self._group = group
        self._index = index
        self._args = launch_args
        self._agent: Any = None
        self._ended = threading.Event()

    def start(self) -> None:
        """Starts the supervisor on the bundle's node. Waits for the bundle to be placed
        (no deadline of its own: after a node died Ray places it again when a node is
        free, and the manager's registration timeout bounds that), then at most the
        agent's deadlines.

        Raises:
            ray.exceptions.RayError: the agent died while starting it (counted as a
                task killed, and the relaunch replaces the agent).
            AgentUnavailable: no agent answered on the node within the deadlines, or
                the slot was ended first.
        """
        import ray

        node = bundle_node(self._group, self._index, self._ended)
        if node is None:
            raise AgentUnavailable(f"{self.key}: ended before its bundle was placed")
        self._agent = ensure(node)
        ray.get(self._agent.launch.remote(self.key, *self._args), timeout=START_DEADLINE_S)

    def info(self) -> Any:
        return self._agent.info.remote(self.key)

    def read(self, wait_s: float) -> Any:
        return self._agent.read.remote(self.key, wait_s)

    def signal(self, signum: int) -> Any:
        return self._agent.signal.remote(self.key, signum) if self._agent else None

    def hold_to(self, limit: float | None) -> Any:
        return self._agent.hold_to.remote(self.key, limit) if self._agent else None

    def end(self) -> None:
        """Lets the task go: the agent kills what is left of it; the agent stays."""
        self._ended.set()
        if self._agent is not None:
            with contextlib.suppress(Exception):
                self._agent.end.remote(self.key)


class AgentUnavailable(ClusterflowError):
    """No agent answered on a node within the deadlines."""


def enabled() -> bool:
    """Whether agents are enabled on the Ray cluster this process joined."""
    from ray.experimental import internal_kv

    with contextlib.suppress(Exception):
        return internal_kv._internal_kv_get(KV_KEY, namespace=NAMESPACE) is not None
    return False


def bundle_node(group: Any, index: int, ended: threading.Event) -> str | None:
    """The live node bundle ``index`` of ``group`` is placed on, once it is; None if
    ``ended`` is set first."""
    import ray

    while not ended.is_set():
        table = ray.util.placement_group_table(group)
        node = (table.get("bundles_to_node_id") or {}).get(index) or ""
        if table.get("state") == "CREATED" and node and _alive(node):
            return str(node)
        ended.wait(0.1)  # Ray says nothing when a bundle is placed again: asked anew
    return None


def _alive(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


_locks: dict[str, threading.Lock] = {}
"""One per node: two launches on a node must not race to make its agent, and a node
whose agent is being replaced must not hold up launches on the others."""
_locks_lock = threading.Lock()


def ensure(node_id: str) -> Any:
    """The live agent of ``node_id`` running this code, started (or replaced) if need
    be; one per node, however many threads ask at once.

    Raises:
        AgentUnavailable: none answered within ``START_DEADLINE_S``.
    """
    import ray

    with _locks_lock:
        lock = _locks.setdefault(node_id, threading.Lock())
    with lock:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            agent = _find(node_id)
            if agent is None:
                agent = _start(node_id)
                if agent is None:
                    continue  # its dead predecessor's name is not released yet
            try:
                got = ray.get(agent.ping.remote(), timeout=_ping_deadline(deadline))
            except (ray.exceptions.RayError, KeyError) as exc:
                log.warning("the agent on node %s did not answer (%s): replaced", node_id, exc)
                _kill(agent)
                continue
            if got["fingerprint"] != fingerprint():
                busy = [*got["hosted"], *got["objects"]]
                if busy:
                    raise AgentUnavailable(
                        f"the agent on node {node_id} runs other code and hosts "
                        f"{', '.join(busy)}; stop them or `clusterflow ray-agents stop --force`"
                    )
                log.info("the agent on node %s runs other code: replaced", node_id)
                _kill(agent)
                continue
            return agent
    raise AgentUnavailable(f"no agent answered on node {node_id} within {START_DEADLINE_S:g}s")


def head_agent() -> Any:
    """The head node's live agent (started or replaced if need be); None where agents
    are not enabled. Managers go there (``manager/ray_host.py``).

    Raises:
        AgentUnavailable: none answered on the head within the deadlines.
    """
    import ray

    if not enabled():
        return None
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in (node.get("Resources") or {}):
            return ensure(node["NodeID"])
    return None


def find_head_agent() -> Any:
    """The head node's agent if one runs (nothing is started); None otherwise."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in (node.get("Resources") or {}):
            return _find(node["NodeID"])
    return None


def head_port() -> dict[str, Any] | None:
    """The head agent's port (``NodeAgent.port``: its address, secret and node), started
    there if need be; None where the head runs no agent.

    Raises:
        ray.exceptions.RayError: the agent did not answer within ``PING_DEADLINE_S``.
    """
    import ray

    agent = find_head_agent()
    if agent is None:
        return None
    port: dict[str, Any] = ray.get(agent.port.remote(), timeout=PING_DEADLINE_S)
    return port


def _ping_deadline(deadline: float) -> float:
    return max(0.1, min(PING_DEADLINE_S, deadline - time.monotonic()))


def _find(node_id: str) -> Any:
    import ray

    try:
        return ray.get_actor(agent_name(node_id), namespace=NAMESPACE)
    except ValueError:
        return None


def _start(node_id: str) -> Any:
    """A fresh agent pinned to ``node_id``; None if its name is still taken (a dead
    agent's, released by Ray shortly after it died)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        return (
            agent_class()
            .options(
                name=agent_name(node_id),
                namespace=NAMESPACE,
                lifetime="detached",
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote()
        )
    except ValueError:
        time.sleep(0.1)  # retried by the caller's loop, within its deadline
        return None


def _kill(agent: Any) -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.kill(agent, no_restart=True)


def start_all() -> list[dict[str, Any]]:
    """Enables agents on the joined Ray cluster and starts one on every live node
    (``clusterflow ray-agents start``); what each answered.

    Raises:
        AgentUnavailable: a node's agent did not answer within the deadlines.
    """
    import ray
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_KEY, b"1", overwrite=True, namespace=NAMESPACE)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    agents = [ensure(node) for node in nodes]
    return [ray.get(a.ping.remote(), timeout=PING_DEADLINE_S) for a in agents]


def running() -> list[dict[str, Any]]:
    """What every agent of the joined Ray cluster answers (``ray-agents status``); a
    dead or silent one answers ``{"node_id": ..., "error": ...}``."""
    import ray

    out = []
    for name in _names():
        node = name.removeprefix(PREFIX)
        try:
            agent = ray.get_actor(name, namespace=NAMESPACE)
            out.append(ray.get(agent.ping.remote(), timeout=PING_DEADLINE_S))
        except (ray.exceptions.RayError, ValueError) as exc:
            out.append({"node_id": node, "error": str(exc).splitlines()[0]})
    return out


def stop_all(*, force: bool) -> list[str]:
    """Disables agents on the joined Ray cluster and ends every agent; the node ids.

    Raises:
        AgentsBusy: an agent hosts tasks and ``force`` is not set (nothing is stopped).
    """
    import ray
    from ray.experimental import internal_kv

    found = {}
    for info in running():
        busy = [*info.get("hosted", ()), *info.get("objects", ())]
        if busy and not force:
            raise AgentsBusy(
                f"the agent on node {info['node_id']} hosts {', '.join(busy)}; stop their "
                "clusters first, or --force"
            )
        found[info["node_id"]] = info
    internal_kv._internal_kv_del(KV_KEY, namespace=NAMESPACE)
    for node in found:
        agent = _find(node)
        if agent is None:
            continue
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(agent.shutdown.remote(), timeout=PING_DEADLINE_S)
        _kill(agent)
    return sorted(found)


def _names() -> list[str]:
    import ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        n["name"] for n in names if n["namespace"] == NAMESPACE and n["name"].startswith(PREFIX)
    )


class AgentsBusy(ConfigError):
    """``ray-agents stop`` without ``--force`` while an agent hosts tasks."""
