"""``cache://NAME``: records of an in-memory cache, read where they lie.

A ``CacheSource`` is a ``LocatedSource`` whose locations are the cache's partition map:
the dispatcher lends each worker the splits of partitions on its own node first. A
split of a partition held on this node is read straight out of the cache server's
shared-memory Arrow IPC file: the file is memory-mapped copy-on-write, and fixed-width
columns become NumPy arrays *over the mapping itself*, so no byte is copied and nothing
crosses a socket (a training step that writes into a batch copies only the pages it
touches, privately). A split held elsewhere is asked of its owner's server over
clusterflow's RPC (Arrow IPC stream bytes), then of its replica's, and only then, after
re-reading the map (a rebalance may have moved it), does the read fail.

The counters (``stats()``) say which way every record came: the proof that a data-local
run read everything from memory and nothing over the wire.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clusterflow.cluster.contract import ENV_CACHE, ENV_NODE
from clusterflow.data.api import Columns, SourceError
from clusterflow.data.cache_map import (
    CacheMap,
    NodeServer,
    cache_dir,
    check_name,
    find_map,
    parse_url,
)
from clusterflow.data.cache_wire import ReadReply, ReadRequest
from clusterflow.data.columns import arrow_columns
from clusterflow.errors import ConfigError
from clusterflow.rpc import Credentials, RpcClient, RpcError

log = logging.getLogger(__name__)

REMOTE_DEADLINE_S = 10.0
"""One remote read's deadline: a dead server is an error within it, and the next holder
is asked."""
REMAP_WAIT_S = 60.0
"""How long a read of a partition no live server holds waits for a rebalance to place it."""


def this_node(environ: Mapping[str, str] | None = None) -> str:
    """The node this process runs on, as cache maps name nodes: ``CLUSTERFLOW_NODE``
    (the Ray node id, set on Ray), else the host name (the local backend's one node)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_NODE) or socket.gethostname()


@dataclass(slots=True)
class _Mapped:
    """One partition's IPC file, memory-mapped copy-on-write, and its one record batch."""

    mm: mmap.mmap
    batch: Any
    base: int
    size: int


class CacheSource:
    """The records of cache ``name``, read locally through shared memory when possible.

    Args:
        name: the cache (``cache://NAME`` or ``NAME``).
        node: this process's node (default ``this_node()``).
        cache_map: the map, when it does not come from ``$CLUSTERFLOW_HOME`` (Ray).
        credentials: the cache servers' secret (default: the cache folder's).
        refresh: returns a newer map (after a rebalance); default re-reads the folder.

    Raises:
        UnknownCacheError: there is no such cache.
        SourceError: the cache is not ready (still loading, or failed).
    """

    has_locations = True

    def __init__(
        self,
        name: str,
        *,
        node: str | None = None,
        cache_map: CacheMap | None = None,
        credentials: Credentials | None = None,
        refresh: Callable[[], CacheMap] | None = None,
    ) -> None:
        self.name = _cache_name(name)
        self.node = node or this_node()
        self._secret_file: Path | None = None
        self._refresh = refresh or self._find
        self.map = cache_map or self._refresh()
        if not self.map.status.startswith(("ready", "degraded")):
            raise SourceError(f"cache {self.name!r} is not ready: {self.map.status}")
        self.uri = f"cache://{self.name}"
        self._credentials = credentials
        self._lock = threading.Lock()
        self._mapped: dict[int, _Mapped] = {}
        self._clients: dict[str, RpcClient] = {}
        self._dead: set[str] = set()
        self.records_local = 0
        """Records read from this node's shared memory."""
        self.records_remote = 0
        """Records asked of another node's server over the wire."""
        self.bytes_zero_copy = 0
        """Bytes handed out as arrays over the shared mapping (no copy)."""
        self.bytes_copied = 0
        """Bytes of local records that had to be converted (columns with nulls, strings)."""
        self.bytes_remote = 0
        """Bytes received over the wire (Arrow IPC)."""

    # Source -----------------------------------------------------------------------------

    def num_records(self) -> int:
        return self.map.num_records

    def location(self, start: int, stop: int) -> str | None:
        """The owner node of the partition holding ``start``: the dispatcher's locality."""
        if not 0 <= start < self.num_records():
            return None
        return self.map.partition_of(start).owner

    def read(self, start: int, stop: int) -> Columns:
        """Records ``[start, stop)``: local partitions without a copy, others over RPC."""
        if not 0 <= start <= stop <= self.num_records():
            raise SourceError(f"{self.uri}: no records [{start}, {stop}) in {self.num_records()}")
        pieces: list[Columns] = []
        at = start
        while at < stop:
            part = self.map.partition_of(at)
            hi = min(stop, part.stop)
            pieces.append(self._read_part(part.index, at - part.start, hi - part.start))
            at = hi
        if len(pieces) == 1:
            return pieces[0]
        # A split across two partitions: joined with a copy (aligned splits never are).
        joined = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
        self.bytes_copied += sum(int(getattr(v, "nbytes", 0)) for v in joined.values())
        return joined

    def stats(self) -> dict[str, int]:
        """Which way the records came (see the attributes); JSON-able."""
        return {
            "records_local": self.records_local,
            "records_remote": self.records_remote,
            "bytes_zero_copy": self.bytes_zero_copy,
            "bytes_copied": self.bytes_copied,
            "bytes_remote": self.bytes_remote,
        }

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
            self._mapped.clear()  # the mappings close when their last array goes

    def _find(self) -> CacheMap:
        cache, self._secret_file = find_map(self.name)
        return cache

    # Local ------------------------------------------------------------------------------

    def _read_part(self, index: int, lo: int, hi: int) -> Columns:
        mapped = self._local(index)
        if mapped is not None:
            return self._zero_copy(mapped, lo, hi)
        return self._remote(index, lo, hi)

    def _local(self, index: int) -> _Mapped | None:
        found = self._mapped.get(index)
        if found is not None:
            return found
        server = self.map.servers.get(self.node)
        path = server.files.get(index) if server is not None else None
        if path is None:
            return None
        import pyarrow as pa  # type: ignore[import-untyped]

        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            log.warning("%s: partition %d not mappable at %s (%s)", self.uri, index, path, exc)
            return None
        buffer = pa.py_buffer(mm)
        reader = pa.ipc.open_file(buffer)
        batch = reader.get_batch(0) if reader.num_record_batches == 1 else _one(reader)
        mapped = _Mapped(mm, batch, buffer.address, buffer.size)
        self._mapped[index] = mapped
        return mapped

    def _zero_copy(self, mapped: _Mapped, lo: int, hi: int) -> Columns:
        """Records ``[lo, hi)`` of a mapped partition as arrays over the mapping itself."""
        batch = mapped.batch.slice(lo, hi - lo)
        out: dict[str, Any] = {}
        for name, array in zip(batch.schema.names, batch.columns, strict=True):
            view = _view(array, mapped)
            if view is not None:
                out[name] = view
                self.bytes_zero_copy += view.nbytes
                continue
            import pyarrow as pa

            converted = arrow_columns(pa.table({name: array}))[name]
            out[name] = converted
            self.bytes_copied += int(array.nbytes)
        self.records_local += hi - lo
        return out

    # Remote -----------------------------------------------------------------------------

    def _remote(self, index: int, lo: int, hi: int) -> Columns:
        """Asks the partition's holders in turn; re-reads the map while none answers."""
        import pyarrow as pa

        deadline = time.monotonic() + REMAP_WAIT_S
        errors: list[str] = []
        self._reread()  # a remote read is rare: take a rebalance into account first
        while True:
            part = self.map.partitions[index]
            if self.node in part.holders() and self._local(index) is not None:
                return self._read_part(index, lo, hi)  # moved here by a rebalance
            for node in part.holders():
                server = self.map.servers.get(node)
                if server is None or node == self.node or server.address in self._dead:
                    continue
                try:
                    request = ReadRequest(name=self.name, partition=index, start=lo, stop=hi)
                    reply = self._client(server).call(
                        request.METHOD, request.to_wire(), deadline=REMOTE_DEADLINE_S
                    )
                except RpcError as exc:
                    errors.append(f"{node}: {exc}")
                    self._dead.add(server.address)  # not asked again: its node is gone
                    self._drop_client(server.address)
                    continue
                data = ReadReply.from_wire(reply.body).ipc
                table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
                self.records_remote += hi - lo
                self.bytes_remote += len(data)
                return arrow_columns(table)
            if time.monotonic() > deadline:
                raise SourceError(
                    f"{self.uri}: no server holding partition {index} answered within "
                    f"{REMAP_WAIT_S:g}s ({'; '.join(errors[-3:]) or 'no holder has a server'})"
                )
            time.sleep(0.2)  # a rebalance takes seconds; re-read the map at this pace
            errors += self._reread()

    def _reread(self) -> list[str]:
        """Takes the newest map (a rebalance may have moved partitions); its errors."""
        try:
            self.map = self._refresh()
        except Exception as exc:  # the map's file is briefly unreadable: the old one serves
            return [f"map: {exc}"]
        return []

    def _client(self, server: NodeServer) -> RpcClient:
        with self._lock:
            client = self._clients.get(server.address)
            if client is None:
                secret = self._secret_file or cache_dir(self.name) / "secret"
                credentials = self._credentials or Credentials.from_file(secret)
                client = RpcClient(server.address, credentials, deadline=REMOTE_DEADLINE_S)
                self._clients[server.address] = client
            return client

    def _drop_client(self, address: str) -> None:
        with self._lock:
            client = self._clients.pop(address, None)
        if client is not None:
            client.close()


def _cache_name(text: str) -> str:
    """``cache://NAME`` or ``NAME``; ``cache://`` alone is the cache of ``start --cache``."""
    if text.rstrip("/") == "cache:":
        name = os.environ.get(ENV_CACHE)
        if not name:
            raise ConfigError("cache:// names no cache, and this task was not started with --cache")
        return check_name(name)
    return parse_url(text) if "://" in text else check_name(text)


def _one(reader: Any) -> Any:
    """The file's batches as one (servers write one batch per partition; older or
    foreign files are combined once, with a copy)."""
    import pyarrow as pa

    table = pa.Table.from_batches([reader.get_batch(i) for i in range(reader.num_record_batches)])
    return table.combine_chunks().to_batches()[0]


def _view(array: Any, mapped: _Mapped) -> np.ndarray | None:
    """``array`` as a writable NumPy array over the copy-on-write mapping, or None where
    Arrow's layout is not NumPy's (nulls, bit-packed booleans, strings, nested lists)."""
    import pyarrow as pa
    import pyarrow.types as pat  # type: ignore[import-untyped]

    if array.null_count:
        return None
    kind = array.type
    shape: tuple[int, ...] = (len(array),)
    if pat.is_fixed_size_list(kind):
        shape = (len(array), kind.list_size)
        array = array.flatten()
        kind = array.type
        if array.null_count:
            return None
    if not (pat.is_integer(kind) or pat.is_floating(kind)):
        return None
    try:
        flat = array.to_numpy(zero_copy_only=True)
    except pa.ArrowInvalid:
        return None
    address = flat.__array_interface__["data"][0]
    if flat.size and not mapped.base <= address <= mapped.base + mapped.size - flat.nbytes:
        return None
    offset = address - mapped.base if flat.size else 0
    view = np.frombuffer(mapped.mm, dtype=flat.dtype, count=flat.size, offset=offset)
    return view.reshape(shape)
