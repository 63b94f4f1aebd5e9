"""Caches on a Ray cluster: one cache-server actor per node, pinned to it, and a keeper.

``create`` (run by the CLI, a Ray driver) starts a ``CacheNode`` actor on every live
node its label selector picks, each pinned there (node affinity, not soft), detached, so
the cache outlives the command and every training cluster. Each one serves its node's
partitions from shared memory (``server.CacheServer`` on the node's address) and keeps
the cache's map and secret in the node's ``node_dir``, where a job placed on the node
(``start --cache``) finds them. A detached ``CacheKeeper`` holds the map and watches the
nodes: when one dies it rebalances (``plan.rebalance``): partitions whose owner died are
served by their replicas at once, new replicas and partitions no survivor held are
loaded from the source on the least loaded live nodes, and the new map is published to
every node (readers re-read it when a server stops answering).

The CLI's own ``$CLUSTERFLOW_HOME/caches/NAME/cache.json`` says the cache lives on Ray
and where; ``describe`` asks the keeper for the current map.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from clusterflow._checks import whole
from clusterflow._files import write_json_atomic
from clusterflow.backends import ray_driver
from clusterflow.cache import plan
from clusterflow.cache.plan import CacheExistsError
from clusterflow.cache.server import CacheServer
from clusterflow.cache.store import free_for_caches, inspect, open_source
from clusterflow.data.cache_map import (
    CacheMap,
    NodeServer,
    cache_dir,
    caches_root,
    check_name,
    node_dir,
    shm_root,
)
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.rpc import Credentials

log = logging.getLogger(__name__)

NAMESPACE = ray_driver.NAMESPACE
"""Ray's namespace of clusterflow's detached actors (the manager's too)."""
CALL_S = 60.0
"""Deadline of one call to a cache actor (a load of a partition included)."""
LOAD_S = 600.0
WATCH_S = 0.5
"""How often the keeper looks for lost nodes (Ray declares a node dead on its own
health checks; this only bounds how soon after that the rebalance starts)."""


def keeper_name(name: str) -> str:
    return f"clusterflow-cache-{name}"


class CacheNode:
    """A cache server on one Ray node (a detached actor pinned to the node)."""

    def __init__(self, name: str, secret: str) -> None:
        import ray

        self.name = name
        self.node = ray.get_runtime_context().get_node_id()
        self._secret = secret
        folder = os.path.join(shm_root(), f"clusterflow-cache-{name}-{self.node[:12]}")
        self.server = CacheServer(
            name,
            self.node,
            Credentials.from_hex(secret),
            folder,
            host=ray.util.get_node_ip_address(),
        ).start()

    def free(self) -> int:
        """Bytes this node can give a cache (``store.free_for_caches``)."""
        return free_for_caches()

    def load(self, source: str, parts: list[tuple[int, int, int]], limit: int | None) -> Any:
        """Loads partitions; returns this server's record, or the one-line error."""
        try:
            self.server.load(source, [tuple(p) for p in parts], limit)  # type: ignore[misc]
        except ClusterflowError as exc:
            return {"error": str(exc), "failure": plan.failure_kind(exc)}
        return self.server.record().to_json()

    def record(self) -> dict[str, Any]:
        return self.server.record().to_json()

    def stats(self) -> dict[str, Any]:
        return self.server.stats()

    def publish(self, wire: dict[str, Any]) -> None:
        """Writes the map and the secret where this node's readers look (``node_dir``)."""
        folder = node_dir(self.name)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        secret = folder / "secret"
        if not secret.exists():
            Credentials.from_hex(self._secret).to_file(secret)
        write_json_atomic(folder / "map.json", wire)

    def stop(self) -> None:
        self.server.close()
        shutil.rmtree(node_dir(self.name), ignore_errors=True)


class CacheKeeper:
    """Holds a Ray cache's map and rebalances it when a node is lost (a detached actor)."""

    def __init__(self, wire: dict[str, Any], actors: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._map = CacheMap.from_wire(wire)
        self._actors = dict(actors)
        self.events: list[str] = []
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="cache-keeper", daemon=True).start()

    def map(self) -> dict[str, Any]:
        with self._lock:
            return replace(self._map, events=tuple(self.events)).to_wire()

    def drop(self) -> None:
        import ray

        self._stop.set()
        for actor in self._actors.values():
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(actor.stop.remote(), timeout=CALL_S)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def _watch(self) -> None:
        import ray

        while not self._stop.wait(WATCH_S):
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except Exception as exc:  # the GCS briefly unreachable: look again
                log.warning("cannot list Ray's nodes: %s", exc)
                continue
            lost = {node for node in self._actors if node not in alive}
            if lost:
                self._rebalance(lost)

    def _rebalance(self, lost: set[str]) -> None:
        import ray

        degraded = f"degraded: lost node {', '.join(sorted(lost))}"
        with self._lock:
            cache = self._map
            self._map = replace(cache, status=degraded)
        for node in lost:
            self._actors.pop(node, None)
        alive = [n for n in cache.nodes if n not in lost and n in self._actors]
        alive += [n for n in self._actors if n not in alive]
        try:
            moved = plan.rebalance(cache.partitions, lost, alive, cache.replicas)
        except ConfigError as exc:
            with self._lock:
                self._map = replace(self._map, status=f"failed: {exc}")
            return
        servers = {n: s for n, s in cache.servers.items() if n not in lost}
        # The new owners (replicas promoted) serve at once: publish before any load, still
        # degraded (the copies that restore the replica count are not loaded yet).
        self._publish(replace(cache, partitions=moved.partitions, servers=servers, status=degraded))
        for node, indexes in moved.loads.items():
            parts = [
                (p.index, p.start, p.stop) for p in moved.partitions if p.index in set(indexes)
            ]
            got = ray.get(self._actors[node].load.remote(cache.source, parts, None), timeout=LOAD_S)
            if "error" in got:
                with self._lock:
                    self._map = replace(self._map, status=f"failed: {got['error']}")
                return
            servers[node] = NodeServer.from_json(got)
        with self._lock:
            self.events.append(
                f"{time.strftime('%H:%M:%S')} lost {', '.join(sorted(lost))}: "
                f"{sum(len(v) for v in moved.loads.values())} partition copies loaded again"
            )
        self._publish(replace(cache, partitions=moved.partitions, servers=servers, status="ready"))

    def _publish(self, cache: CacheMap) -> None:
        import ray

        with self._lock:
            self._map = cache
        wire = cache.to_wire()
        calls = [actor.publish.remote(wire) for actor in self._actors.values()]
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(calls, timeout=CALL_S)


@functools.cache
def _classes() -> tuple[Any, Any]:
    import ray

    return (
        ray.remote(num_cpus=0, max_concurrency=8, max_restarts=0)(CacheNode),
        ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(CacheKeeper),
    )


def connect(address: str | None) -> None:
    """Joins the Ray cluster at ``address`` (``RAY_ADDRESS``, else ``auto``).

    Raises:
        ConfigError: Ray is not installed, or the cluster cannot be reached.
    """
    ray_driver.join(address)


def create(
    name: str,
    source: str,
    partitions: int,
    *,
    replicas: int = 0,
    memory_per_node: int | None = None,
    address: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> CacheMap:
    """Loads ``source`` into a new cache on the live Ray nodes ``labels`` select.

    Raises:
        CacheExistsError: the name is taken. SourceError, SchemaMismatchError,
        ConfigError, CacheMemoryError: as ``local.create``; nothing is left behind.
    """
    check_name(name)
    folder = cache_dir(name)
    if (folder / "cache.json").exists():
        raise CacheExistsError(f"cache {name!r} exists; drop it first to load it again")
    partitions = whole("--partitions", partitions, least=1)
    info = inspect(open_source(source), source)
    connect(address)
    import ray

    with contextlib.suppress(ValueError):
        ray.get_actor(keeper_name(name), namespace=NAMESPACE)
        raise CacheExistsError(f"cache {name!r} exists on the Ray cluster; drop it first")
    selector = dict(labels or {})
    nodes = sorted(
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and _selects(selector, n.get("Labels") or {})
    )
    if not nodes:
        raise ConfigError(f"no live Ray node carries the labels {selector}")
    parts = plan.place(
        plan.partition_ranges(info.num_records, partitions),
        info.bytes_per_record,
        nodes,
        replicas,
    )
    used = sorted({n for p in parts for n in p.holders()})
    secret = Credentials.generate().to_hex()
    node_class, keeper_class = _classes()
    actors = {node: _pinned(node_class, name, node).remote(name, secret) for node in used}
    try:
        free = dict(
            zip(used, ray.get([actors[n].free.remote() for n in used], timeout=CALL_S), strict=True)
        )
        limits = {n: memory_per_node if memory_per_node is not None else free[n] for n in used}
        plan.check_memory(name, parts, limits)
        loads = {
            n: actors[n].load.remote(
                source, [(p.index, p.start, p.stop) for p in parts if n in p.holders()], limits[n]
            )
            for n in used
        }
        records: dict[str, NodeServer] = {}
        for node, ref in loads.items():
            got = ray.get(ref, timeout=LOAD_S)
            if "error" in got:
                raise plan.load_error(got["error"], got["failure"])
            records[node] = NodeServer.from_json(got)
        sizes = {i: b for r in records.values() for i, b in r.bytes.items()}
        cache = CacheMap(
            name=name,
            source=source,
            schema=info.schema,
            partitions=tuple(replace(p, bytes=sizes.get(p.index, p.bytes)) for p in parts),
            replicas=replicas,
            backend="ray",
            status="ready",
            created=time.time(),
            servers=records,
            address=address,
        )
        wire = cache.to_wire()
        ray.get([a.publish.remote(wire) for a in actors.values()], timeout=CALL_S)
        keeper_class.options(
            name=keeper_name(name),
            namespace=NAMESPACE,
            lifetime="detached",
            scheduling_strategy=_on_head_node(),
        ).remote(wire, actors)
    except BaseException:
        for actor in actors.values():
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=CALL_S)
                ray.kill(actor, no_restart=True)
        raise
    caches_root().mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.mkdir(mode=0o700, exist_ok=True)
    Credentials.from_hex(secret).to_file(folder / "secret")
    write_json_atomic(folder / "cache.json", cache.to_json())
    return cache


def _on_head_node() -> Any:
    """The keeper goes to the head node: the Ray cluster ends with that node anyway,
    while any other node (a cache node among them) may go away."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in (node.get("Resources") or {}):
            return NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    return "DEFAULT"


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    from clusterflow.backends.ray_placement import label_matches

    return label_matches(selector, labels)


def _pinned(actor_class: Any, name: str, node: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return actor_class.options(
        name=f"{keeper_name(name)}-{node[:12]}",
        namespace=NAMESPACE,
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    )


def describe(cache: CacheMap) -> CacheMap:
    """The current map from the cache's keeper (its status says if the keeper is gone).

    Leaves Ray as it found it: a command that joins Ray afterwards (``start --backend
    ray``) joins with its own settings.
    """
    import ray

    joined = ray.is_initialized()
    try:
        connect(cache.address)
    except ray_driver.RayUnreachable as exc:  # `cache ls` lists the others all the same
        return replace(cache, status=f"unreachable: {exc}")
    try:
        keeper = ray.get_actor(keeper_name(cache.name), namespace=NAMESPACE)
        wire = ray.get(keeper.map.remote(), timeout=CALL_S)
    except (ValueError, ray.exceptions.RayError) as exc:
        return replace(cache, status=f"lost: its keeper is gone ({type(exc).__name__})")
    finally:
        if not joined:
            ray.shutdown()
    return CacheMap.from_wire(wire)


def drop(cache: CacheMap) -> None:
    """Stops every server of the cache and its keeper (a keeper already gone is fine)."""
    connect(cache.address)
    import ray

    with contextlib.suppress(ValueError, ray.exceptions.RayError):
        keeper = ray.get_actor(keeper_name(cache.name), namespace=NAMESPACE)
        ray.get(keeper.drop.remote(), timeout=CALL_S * 2)
        ray.kill(keeper, no_restart=True)
