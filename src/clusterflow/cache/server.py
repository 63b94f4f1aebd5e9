"""A cache server: one node's partitions of one cache, served to readers elsewhere.

Readers on the same node do not call it for records: they map its shared-memory files
(``data/cache_source.py``). It answers (the types: ``data/cache_wire.py``):

* ``cache.read``: ``{name, partition, start, stop}`` -> ``{ipc}`` (an Arrow IPC stream of
  those records, for a reader on another node);
* ``cache.load``: ``{source, parts: [[index, start, stop], ...], limit?}`` -> ``{bytes}``
  (more partitions, e.g. a lost node's, from the source);
* ``cache.stats``: its counters (``records_sent`` and ``bytes_sent`` count every
  record that left it over a socket; a data-local run leaves them at 0);
* ``cache.stop``: drops its partitions and stops.

On the local backend it runs as a daemon, ``python -m clusterflow.cache.server DIR NODE``,
started by ``clusterflow cache create`` and independent of any training cluster; on Ray
its host is an actor pinned to the node (``cache/ray_nodes.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from clusterflow._files import write_json_atomic
from clusterflow.cache.plan import failure_kind
from clusterflow.cache.store import PartitionStore, open_source
from clusterflow.data.cache_map import CacheMap, NodeServer
from clusterflow.data.cache_wire import (
    LOAD,
    READ,
    STATS,
    STOP,
    LoadReply,
    LoadRequest,
    ReadReply,
    ReadRequest,
)
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.rpc import Credentials, Request, RpcServer

log = logging.getLogger(__name__)


class CacheServer:
    """Holds partitions of one cache on one node and serves them (see the module).

    Args:
        name: the cache.
        node: this node's name, as the partition map names it.
        credentials: the cache's secret; readers without it are refused.
        folder: the shared-memory folder of its partition files.
        host: the interface to serve on (the node's address on Ray).
    """

    def __init__(
        self,
        name: str,
        node: str,
        credentials: Credentials,
        folder: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
    ) -> None:
        self.name = name
        self.node = node
        self.store = PartitionStore(name, node, folder)
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self.reads = 0
        self.records_sent = 0
        self.bytes_sent = 0
        self.rpc = RpcServer(credentials, host=host, name=f"cache-{name}")
        handlers: dict[str, tuple[Callable[[Request], Any], bool]] = {
            READ: (self._on_read, False),
            LOAD: (self._on_load, True),
            STATS: (lambda r: self.stats(), False),
            STOP: (self._on_stop, False),
        }
        for method, (handler, blocking) in handlers.items():
            self.rpc.register(method, handler, blocking=blocking)

    @property
    def address(self) -> str:
        return self.rpc.address

    def start(self) -> CacheServer:
        self.rpc.start()
        return self

    def load(
        self, source_url: str, parts: list[tuple[int, int, int]], limit: int | None
    ) -> dict[int, int]:
        """Loads ``(index, start, stop)`` partitions of ``source_url`` into memory."""
        source = open_source(source_url)
        return self.store.load(source, parts, limit)

    def record(self, status: str = "ready", failure: str = "") -> NodeServer:
        """This server as the partition map lists it (``failure``: see ``NodeServer``)."""
        return NodeServer(
            node=self.node,
            address=self.address,
            pid=os.getpid(),
            files=self.store.files(),
            bytes=self.store.sizes(),
            status=status,
            failure=failure,
        )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "node": self.node,
                "partitions": sorted(self.store.files()),
                "bytes_held": self.store.bytes_held(),
                "reads": self.reads,
                "records_sent": self.records_sent,
                "bytes_sent": self.bytes_sent,
            }

    def close(self) -> None:
        self.rpc.stop()
        self.store.close()
        self.stopped.set()

    # Handlers -------------------------------------------------------------------------

    def _on_read(self, request: Request) -> dict[str, Any]:
        read = ReadRequest.from_wire(request.body)
        if read.name != self.name:
            raise ConfigError(f"this server holds cache {self.name!r}, not {read.name!r}")
        data = self.store.ipc_bytes(read.partition, read.start, read.stop)
        with self._lock:
            self.reads += 1
            self.records_sent += read.stop - read.start
            self.bytes_sent += len(data)
        return ReadReply(ipc=data).to_wire()

    def _on_load(self, request: Request) -> dict[str, Any]:
        load = LoadRequest.from_wire(request.body)
        sizes = self.load(load.source, list(load.parts), load.limit)
        return LoadReply(sizes=sizes, files=self.record().to_json()).to_wire()

    def _on_stop(self, request: Request) -> None:
        threading.Thread(target=self.close, name="cache-stop", daemon=True).start()


# The local backend's daemon ------------------------------------------------------------


def write_record(folder: Path, record: NodeServer) -> None:
    """Writes ``nodes/<node>.json`` atomically (readers see the old one or the new one)."""
    nodes = folder / "nodes"
    nodes.mkdir(exist_ok=True)
    write_json_atomic(nodes / f"{record.node}.json", record.to_json())


def serve_local(folder: Path, node: str, shm: str, limit: int | None) -> int:
    """The daemon's body: load this node's partitions, report, serve until stopped."""
    plan = CacheMap.from_json(json.loads((folder / "cache.json").read_text()))
    credentials = Credentials.from_file(folder / "secret")
    server = CacheServer(plan.name, node, credentials, shm).start()

    def _stop(signum: int, frame: FrameType | None) -> None:
        server.stopped.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    write_record(folder, server.record("loading"))
    mine = [(p.index, p.start, p.stop) for p in plan.partitions if node in p.holders()]
    try:
        server.load(plan.source, mine, limit)
    except ClusterflowError as exc:
        write_record(folder, server.record(f"failed: {exc}", failure=failure_kind(exc)))
        server.close()
        return 1
    write_record(folder, server.record("ready"))
    log.info("cache %r: node %s ready at %s", plan.name, node, server.address)
    while not server.stopped.wait(1.0):
        pass
    server.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clusterflow.cache.server")
    parser.add_argument("folder", help="the cache's folder under $CLUSTERFLOW_HOME/caches")
    parser.add_argument("node", help="this node's name in the partition map")
    parser.add_argument("shm", help="the shared-memory folder for partition files")
    parser.add_argument("--limit", type=int, default=None, help="bytes this node may hold")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    started = time.monotonic()
    code = serve_local(Path(args.folder), args.node, args.shm, args.limit)
    log.info("cache server exits %d after %.1fs", code, time.monotonic() - started)
    sys.exit(code)


if __name__ == "__main__":
    main()
