"""Caches on the local backend: one server daemon per cache, on this machine.

``create`` checks everything it can before it starts anything (the name is free, the
source exists and its files share one schema, the partitions fit the memory this node
can give), so bad input costs nothing and never touches a cache that exists. The
daemon (``python -m clusterflow.cache.server``) runs in a session of its own, outside
any training cluster (it does not carry a cluster's id, so stopping a cluster never
stops it): a cache lives until ``drop``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from clusterflow._checks import whole
from clusterflow._files import write_json_atomic
from clusterflow.backends import kinds
from clusterflow.cache import plan
from clusterflow.cache.plan import CacheExistsError
from clusterflow.cache.store import free_for_caches, inspect, open_source
from clusterflow.cluster.contract import ENV_CLUSTER_ID
from clusterflow.data.cache_map import (
    CacheMap,
    NodeServer,
    cache_dir,
    caches_root,
    check_name,
    read_map,
    shm_root,
)
from clusterflow.data.cache_source import this_node
from clusterflow.data.cache_wire import STOP
from clusterflow.errors import ConfigError
from clusterflow.rpc import Credentials, RpcClient, RpcError

log = logging.getLogger(__name__)

SERVER_MODULE = "clusterflow.cache.server"
LOAD_TIMEOUT_S = 600.0
"""How long ``create`` waits for the servers to load the source."""
STOP_WAIT_S = 10.0


def create(
    name: str,
    source: str,
    partitions: int,
    *,
    replicas: int = 0,
    memory_per_node: int | None = None,
    timeout_s: float = LOAD_TIMEOUT_S,
) -> CacheMap:
    """Loads ``source`` into a new cache of ``partitions`` partitions on this node.

    Blocks until the server holds every partition (at most ``timeout_s``).

    Raises:
        CacheExistsError: the name is taken.
        ConfigError: 0 partitions, more than the records, or a replica with one node.
        SourceError: the source is missing or unreadable; SchemaMismatchError: its
            files differ in schema.
        CacheMemoryError: it does not fit; names the node and the shortfall.
    """
    check_name(name)
    folder = cache_dir(name)
    if (folder / "cache.json").exists():
        raise CacheExistsError(f"cache {name!r} exists; drop it first to load it again")
    partitions = whole("--partitions", partitions, least=1)
    info = inspect(open_source(source), source)
    node = this_node()
    parts = plan.place(
        plan.partition_ranges(info.num_records, partitions), info.bytes_per_record, [node], replicas
    )
    free = memory_per_node if memory_per_node is not None else free_for_caches()
    plan.check_memory(name, parts, {node: free})
    cache = CacheMap(
        name=name,
        source=source,
        schema=info.schema,
        partitions=parts,
        replicas=replicas,
        backend="local",
        status="loading",
        created=time.time(),
    )
    caches_root().mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        raise CacheExistsError(f"cache {name!r} is being created by another command") from None
    try:
        Credentials.generate().to_file(folder / "secret")
        write_json_atomic(folder / "cache.json", cache.to_json())
        shm = os.path.join(shm_root(), f"clusterflow-cache-{name}-{secrets.token_hex(4)}")
        proc = _spawn(folder, node, shm, memory_per_node)
        record = _wait_loaded(folder, node, proc, timeout_s)
        if not record.status.startswith("ready"):
            _stop_process(proc.pid, folder)
            raise _load_failure(name, record)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    measured = tuple(replace(p, bytes=record.bytes.get(p.index, p.bytes)) for p in parts)
    cache = replace(cache, partitions=measured, status="ready")
    write_json_atomic(folder / "cache.json", cache.to_json())
    return cache.with_servers({node: record})


def _load_failure(name: str, record: NodeServer) -> ConfigError:
    """The error for a server that failed to load, by the kind its record carries: a
    shortfall of memory is told in the store's own words (names the node, the shortfall)."""
    if record.failure == plan.MEMORY:
        return plan.load_error(record.status.removeprefix("failed: "), record.failure)
    return ConfigError(f"cache {name!r} failed to load: {record.status}")


def _spawn(folder: Path, node: str, shm: str, limit: int | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != ENV_CLUSTER_ID}
    argv = [sys.executable, "-m", SERVER_MODULE, str(folder), node, shm]
    if limit is not None:
        argv += ["--limit", str(limit)]
    with (folder / f"server-{node}.log").open("ab") as out:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the command that made it
        )


def _wait_loaded(
    folder: Path, node: str, proc: subprocess.Popen[bytes], timeout_s: float
) -> NodeServer:
    """The server's record once it is ready or failed; a ConfigError if it died."""
    path = folder / "nodes" / f"{node}.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            record = NodeServer.from_json(json.loads(path.read_text()))
            if record.status != "loading":
                return record
        if proc.poll() is not None:
            log_file = folder / f"server-{node}.log"
            tail = log_file.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise ConfigError(
                f"the cache server of node {node} exited with code {proc.returncode}: {tail[0]}"
            )
        time.sleep(0.05)
    _stop_process(proc.pid, folder)
    raise ConfigError(f"the cache server of node {node} did not load within {timeout_s:g}s")


# ls / describe / drop ----------------------------------------------------------------------


def list_caches() -> list[CacheMap]:
    """Every cache of this ``$CLUSTERFLOW_HOME``, with its status as of now."""
    root = caches_root()
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir()):
        if not (folder / "cache.json").exists():
            continue
        try:
            out.append(describe(folder.name))
        except ConfigError as exc:  # its Ray cluster unreachable, say: listed, and why
            with contextlib.suppress(ConfigError):
                out.append(replace(read_map(folder.name), status=f"unknown: {exc}"))
    return out


def describe(name: str) -> CacheMap:
    """The cache's map with its status as of now (a server gone is a lost node).

    Raises:
        UnknownCacheError: no such cache.
    """
    cache = read_map(name)
    if kinds.named(cache.backend).placed_by_ray:
        from clusterflow.cache import ray_nodes

        return ray_nodes.describe(cache)
    if not cache.status.startswith("ready"):
        return cache
    lost = [n for n, s in cache.servers.items() if not _alive(s.pid, cache_dir(name))]
    if lost or set(cache.nodes) - set(cache.servers):
        gone = sorted(set(lost) | (set(cache.nodes) - set(cache.servers)))
        return replace(cache, status=f"lost: server of node {', '.join(gone)} is gone")
    return cache


def drop(name: str) -> CacheMap:
    """Stops the cache's servers, frees its memory and removes its folder.

    Raises:
        UnknownCacheError: no such cache (nothing is touched).
    """
    cache = read_map(name)
    folder = cache_dir(name)
    on_ray = kinds.named(cache.backend).placed_by_ray
    if on_ray:
        from clusterflow.cache import ray_nodes

        ray_nodes.drop(cache)
    secret = folder / "secret"
    for server in cache.servers.values():
        if not on_ray and _alive(server.pid, folder) and secret.exists():
            with (
                contextlib.suppress(RpcError),
                RpcClient(server.address, Credentials.from_file(secret), deadline=5.0) as client,
            ):
                client.call(STOP)
            _stop_process(server.pid, folder)
        for path in server.files.values():  # a server killed before it could clean up
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    return cache


def _alive(pid: int, folder: Path) -> bool:
    """Whether ``pid`` is this cache's server (not a process that reused the number)."""
    import psutil

    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and str(folder) in proc.cmdline()
    except psutil.Error:
        return False


def _stop_process(pid: int, folder: Path) -> None:
    import signal

    import psutil

    if not _alive(pid, folder):
        return
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_WAIT_S)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_WAIT_S)
