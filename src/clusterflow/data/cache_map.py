"""The partition map of an in-memory cache: which node holds which records, and where.

A cache (``clusterflow cache create``, the ``clusterflow.cache`` package) cuts a
dataset into partitions of consecutive records; each partition has an owner node and
optionally a replica node, whose cache servers hold it as one Arrow record batch in an
IPC file in shared memory. This module is the one typed definition of that map, read
by the servers, the CLI and the readers of ``cache://`` datasets (``cache_source.py``),
so the data service can take its locality from it without depending on the servers.

On disk (local backend) a cache is a folder ``$CLUSTERFLOW_HOME/caches/<name>/``:
``cache.json`` (the plan: partitions, owners, replicas; written by whoever creates or
rebalances the cache), ``nodes/<node>.json`` (one per cache server: its address, pid
and the shared-memory file of each partition it holds; written by that server alone)
and ``secret`` (the credentials of its servers, mode 0600).
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from clusterflow.cluster.contract import ENV_HOME
from clusterflow.data.api import DataError
from clusterflow.errors import ConfigError

SHM_ROOT = "/dev/shm"
NODE_MAPS = "clusterflow-caches"
"""On a Ray node, ``<shm root>/clusterflow-caches/<name>/`` holds the map (``map.json``,
servers included) and the secret of each cache with a server on the node: where a job
placed there by ``start --cache`` finds them (its ``$CLUSTERFLOW_HOME`` is the node's)."""
SCHEME = "cache://"
"""How a dataset names a cache: ``cache://NAME``."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class UnknownCacheError(DataError, ConfigError):
    """No cache of that name exists (the message lists those that do)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """Records ``[start, stop)`` of the cache's dataset, and the nodes holding them."""

    index: int
    start: int
    stop: int
    bytes: int
    """Bytes the partition takes in memory (estimated until loaded, then measured)."""
    owner: str
    """The node whose server holds it and answers for it first."""
    replica: str | None = None
    """A second node holding a copy (``--replicas 1``), so one lost node loses nothing."""

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def holders(self) -> list[str]:
        return [self.owner] if self.replica is None else [self.owner, self.replica]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeServer:
    """One cache server as it reported itself: where it listens and what it holds."""

    node: str
    address: str
    """``host:port`` of its RPC server (remote reads, stats, stop)."""
    pid: int = 0
    """Its process id on its node (local backend), 0 where the node is not this host."""
    files: Mapping[int, str] = field(default_factory=dict)
    """Partition index -> the shared-memory Arrow IPC file holding it on that node."""
    bytes: Mapping[int, int] = field(default_factory=dict)
    """Partition index -> bytes it takes there."""
    status: str = "ready"
    """``loading``, ``ready`` or ``failed: <reason>``."""
    failure: str = ""
    """For a ``failed`` server, what kind of failure (``cache.plan.failure_kind``), so the
    command waiting for it decides by a field rather than by the reason's words."""

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "address": self.address,
            "pid": self.pid,
            "files": {str(k): v for k, v in self.files.items()},
            "bytes": {str(k): v for k, v in self.bytes.items()},
            "status": self.status,
            "failure": self.failure,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeServer:
        return cls(
            node=str(data["node"]),
            address=str(data["address"]),
            pid=int(data.get("pid", 0)),
            files={int(k): str(v) for k, v in (data.get("files") or {}).items()},
            bytes={int(k): int(v) for k, v in (data.get("bytes") or {}).items()},
            status=str(data.get("status", "ready")),
            failure=str(data.get("failure", "")),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheMap:
    """A cache's whole plan: its dataset, its partitions and their servers."""

    name: str
    source: str
    """The URL the records were loaded from (a glob, folder or file; any fsspec URL)."""
    schema: str
    """The Arrow schema every file shares, as text (shown by ``describe``)."""
    partitions: tuple[Partition, ...]
    replicas: int = 0
    backend: str = "local"
    status: str = "loading"
    """``loading``, ``ready``, ``degraded`` (a lost node's partitions being reloaded) or
    ``failed: <reason>``."""
    created: float = 0.0
    servers: Mapping[str, NodeServer] = field(default_factory=dict)
    """Node -> its server, as the servers reported themselves."""
    address: str | None = None
    """Ray backend: the Ray cluster's address."""
    events: tuple[str, ...] = ()
    """What happened to the cache since it was made (a lost node, a rebalance)."""

    def __post_init__(self) -> None:
        check_name(self.name)
        if not self.partitions:
            raise ConfigError(f"cache {self.name!r} has no partitions")

    @property
    def num_records(self) -> int:
        return self.partitions[-1].stop

    @property
    def nodes(self) -> list[str]:
        """Every node holding a partition, in order of first appearance."""
        seen: dict[str, None] = {}
        for p in self.partitions:
            for node in p.holders():
                seen.setdefault(node)
        return list(seen)

    def partition_of(self, record: int) -> Partition:
        """The partition holding ``record``."""
        starts = [p.start for p in self.partitions]
        return self.partitions[bisect.bisect_right(starts, record) - 1]

    def bytes_per_node(self) -> dict[str, int]:
        """What each node gives the cache: its partitions, as owner or as replica."""
        out: dict[str, int] = {}
        for p in self.partitions:
            for node in p.holders():
                out[node] = out.get(node, 0) + p.bytes
        return out

    def with_servers(self, servers: Mapping[str, NodeServer]) -> CacheMap:
        return replace(self, servers=dict(servers))

    def to_wire(self) -> dict[str, Any]:
        """The plan and its servers in one value (Ray actors, a node's ``map.json``)."""
        servers = {n: s.to_json() for n, s in self.servers.items()}
        return {**self.to_json(), "servers": servers, "events": list(self.events)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CacheMap:
        servers = {str(n): NodeServer.from_json(s) for n, s in (data.get("servers") or {}).items()}
        events = tuple(str(e) for e in data.get("events") or ())
        return replace(cls.from_json(data, servers), events=events)

    def to_json(self) -> dict[str, Any]:
        """The plan as ``cache.json`` holds it (servers live in their own files)."""
        return {
            "name": self.name,
            "source": self.source,
            "schema": self.schema,
            "replicas": self.replicas,
            "backend": self.backend,
            "status": self.status,
            "created": self.created,
            "address": self.address,
            "partitions": [
                [p.index, p.start, p.stop, p.bytes, p.owner, p.replica] for p in self.partitions
            ],
        }

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], servers: Mapping[str, NodeServer] | None = None
    ) -> CacheMap:
        """Parses ``to_json``'s form.

        Raises:
            ConfigError: a field is missing or malformed.
        """
        try:
            parts = tuple(
                Partition(
                    index=int(i),
                    start=int(a),
                    stop=int(b),
                    bytes=int(n),
                    owner=str(o),
                    replica=None if r is None else str(r),
                )
                for i, a, b, n, o, r in data["partitions"]
            )
            return cls(
                name=str(data["name"]),
                source=str(data["source"]),
                schema=str(data.get("schema", "")),
                partitions=parts,
                replicas=int(data.get("replicas", 0)),
                backend=str(data.get("backend", "local")),
                status=str(data.get("status", "ready")),
                created=float(data.get("created", 0.0)),
                address=data.get("address"),
                servers=dict(servers or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed cache map: {exc}") from exc


def check_name(name: str) -> str:
    """``name`` if it can name a cache (a folder and a URL host), else a ConfigError."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ConfigError(
            f"bad cache name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def parse_url(url: str) -> str:
    """The cache name of ``cache://NAME``."""
    if not url.startswith(SCHEME):
        raise ConfigError(f"not a cache URL: {url!r} (expected {SCHEME}NAME)")
    return check_name(url.removeprefix(SCHEME).strip("/"))


# The local backend's folders ------------------------------------------------------------


def caches_root(environ: Mapping[str, str] | None = None) -> Path:
    """``$CLUSTERFLOW_HOME/caches`` (``~/.clusterflow/caches`` by default)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_HOME)
    root = Path(raw).expanduser() if raw else Path.home() / ".clusterflow"
    return root / "caches"


def cache_dir(name: str, environ: Mapping[str, str] | None = None) -> Path:
    return caches_root(environ) / check_name(name)


def shm_root() -> str:
    """Where partitions live: ``/dev/shm`` (shared memory) where it exists."""
    import tempfile

    if os.path.isdir(SHM_ROOT) and os.access(SHM_ROOT, os.W_OK):
        return SHM_ROOT
    return tempfile.gettempdir()


def node_dir(name: str) -> Path:
    """This node's folder of cache ``name`` (Ray backend): ``map.json`` and ``secret``."""
    return Path(shm_root()) / NODE_MAPS / check_name(name)


def find_map(name: str, environ: Mapping[str, str] | None = None) -> tuple[CacheMap, Path]:
    """The map of cache ``name`` as a reader on this node sees it, and its secret's file.

    A local-backend cache is read from ``$CLUSTERFLOW_HOME``; a Ray cache from the
    folder its server on this node keeps (``node_dir``).

    Raises:
        UnknownCacheError: no such cache here.
        ConfigError: a Ray cache with no server on this node.
    """
    node_map = node_dir(name) / "map.json"
    if node_map.exists():
        try:
            return CacheMap.from_wire(json.loads(node_map.read_text())), node_map.parent / "secret"
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the map of cache {name!r}: {exc}") from exc
    cache = read_map(name, environ)
    if cache.backend != "local":
        raise ConfigError(
            f"cache {name!r} ({cache.backend}) has no server on this node: read it from a "
            "node that holds partitions (start --cache places workers there)"
        )
    return cache, cache_dir(name, environ) / "secret"


def read_map(name: str, environ: Mapping[str, str] | None = None) -> CacheMap:
    """The map of cache ``name`` from its folder, with every server's own record.

    Raises:
        UnknownCacheError: no such cache (the message lists those that exist).
    """
    folder = cache_dir(name, environ)
    try:
        plan = json.loads((folder / "cache.json").read_text())
    except FileNotFoundError:
        root = caches_root(environ)
        known = (
            sorted(p.name for p in root.iterdir() if (p / "cache.json").exists())
            if (root.is_dir())
            else []
        )
        raise UnknownCacheError(
            f"no cache {name!r} (caches: {', '.join(known) or 'none'}); "
            f"create it with `clusterflow cache create {name} --from URL --partitions N`"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the map of cache {name!r}: {exc}") from exc
    servers: dict[str, NodeServer] = {}
    for path in sorted((folder / "nodes").glob("*.json")):
        try:
            server = NodeServer.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            continue  # being written for the first time: atomically replaced, so skip
        servers[server.node] = server
    return CacheMap.from_json(plan, servers)
