"""The partitions one cache server holds: loaded from the source, kept in shared memory.

Each partition is one Arrow record batch in an Arrow IPC file in a folder of shared
memory (``/dev/shm``: a RAM file system, so the file *is* the memory). The server maps
each file to answer remote reads; readers on the same node map the same file
(``data/cache_source.py``), so a local read shares the server's pages instead of
asking it over a socket.

Loading goes through the data service's ``ArrowSource`` (pyarrow over fsspec: Parquet,
Arrow IPC, CSV from any URL it reads); the schema of every file is checked first, so a
source whose files disagree fails before anything is loaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterflow.cache.plan import CacheMemoryError, human
from clusterflow.data.api import SourceError
from clusterflow.data.cache_map import shm_root
from clusterflow.data.sources import ArrowSource
from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

SAMPLE_RECORDS = 4096
"""Records read to estimate a source's bytes per record in memory."""
HEADROOM = 0.9
"""The share of a node's free memory a cache may take by default: the rest is left to
the training processes and the page cache, so a cache never pushes the node to swap."""


class SchemaMismatchError(SourceError, ConfigError):
    """The files of a source do not share one schema; names two files and the difference."""


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What planning needs to know of a source, read from metadata and a small sample."""

    url: str
    num_records: int
    bytes_per_record: float
    schema: str


def open_source(url: str, storage_options: Mapping[str, Any] | None = None) -> ArrowSource:
    """The source at ``url``, its files' schemas checked equal.

    Raises:
        SourceError: nothing at ``url``, or not a readable file of its format.
        SchemaMismatchError: two files differ in schema.
        ConfigError: the format cannot be told from the names.
    """
    source = ArrowSource(url, storage_options=storage_options)
    schemas = source.file_schemas()
    first = schemas[0]
    for path, schema in zip(source.files[1:], schemas[1:], strict=True):
        if not schema.equals(first):
            raise SchemaMismatchError(
                f"the files of {url!r} differ in schema: {path!r} has "
                f"{_fields(schema)}, {source.files[0]!r} has {_fields(first)}"
            )
    return source


def inspect(source: ArrowSource, url: str) -> SourceInfo:
    """Counts the records and estimates their bytes in memory from a sample."""
    n = source.num_records()
    if n == 0:
        raise SourceError(f"{url!r} holds no records")
    sample = source.read_table(0, min(n, SAMPLE_RECORDS))
    per_record = max(1.0, sample.nbytes / max(1, sample.num_rows))
    schema = ", ".join(f"{f.name}: {f.type}" for f in sample.schema)
    return SourceInfo(url, n, per_record, schema)


def _fields(schema: Any) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")"


def free_for_caches() -> int:
    """Bytes this node can give a cache: free memory (less headroom), at most what the
    shared-memory file system has room for."""
    import psutil

    available = int(psutil.virtual_memory().available * HEADROOM)
    return min(available, shutil.disk_usage(shm_root()).free)


@dataclass(slots=True)
class Held:
    """One partition held: its file, its bytes, the batch over the mapped file."""

    path: str
    bytes: int
    batch: Any


class PartitionStore:
    """The partitions of one cache on one node, in shared-memory IPC files.

    Args:
        name: the cache's name (part of the folder's name).
        node: this node's name (in errors).
        folder: the shared-memory folder to write into (made if missing).
    """

    def __init__(self, name: str, node: str, folder: str | os.PathLike[str]) -> None:
        self.name = name
        self.node = node
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}

    def load(
        self, source: ArrowSource, parts: Iterable[tuple[int, int, int]], limit: int | None = None
    ) -> dict[int, int]:
        """Loads partitions ``(index, start, stop)`` from ``source``; returns their bytes.

        Raises:
            CacheMemoryError: a partition would outgrow ``limit`` or the shared memory's
                free space (nothing more is written; the ones loaded stay).
            SourceError: the source cannot be read.
        """
        out: dict[int, int] = {}
        for index, start, stop in parts:
            table = source.read_table(start, stop).combine_chunks()
            out[index] = self.put(index, table, limit)
        return out

    def put(self, index: int, table: Any, limit: int | None = None) -> int:
        """Writes one partition (a table of one chunk) to its file and maps it."""
        import pyarrow as pa  # type: ignore[import-untyped]

        need = int(table.nbytes)
        free = shutil.disk_usage(self.folder).free
        held = self.bytes_held()
        room = free if limit is None else min(free, limit - held)
        if need > room:
            raise CacheMemoryError(
                f"cache {self.name!r} does not fit node {self.node}: partition {index} needs "
                f"{human(need)}, {human(max(0, room))} is left (short by {human(need - room)})"
            )
        path = self.folder / f"p{index:05d}.arrow"
        tmp = path.with_suffix(".tmp")
        batches = table.to_batches()
        batch = batches[0] if len(batches) == 1 else table.combine_chunks().to_batches()[0]
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_batch(batch)
        os.replace(tmp, path)
        mapped = pa.ipc.open_file(pa.memory_map(str(path))).get_batch(0)
        size = path.stat().st_size
        with self._lock:
            self._held[index] = Held(str(path), size, mapped)
        log.info(
            "%s: partition %d held (%d records, %s)", self.name, index, len(batch), human(size)
        )
        return size

    def get(self, index: int) -> Held:
        with self._lock:
            held = self._held.get(index)
        if held is None:
            raise ConfigError(f"cache {self.name!r}: node {self.node} holds no partition {index}")
        return held

    def ipc_bytes(self, index: int, lo: int, hi: int) -> bytes:
        """Records ``[lo, hi)`` of a partition as an Arrow IPC stream (a remote read)."""
        import pyarrow as pa

        batch = self.get(index).batch
        if not 0 <= lo <= hi <= len(batch):
            raise ConfigError(f"partition {index} has no records [{lo}, {hi}) in {len(batch)}")
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch.slice(lo, hi - lo))
        data: bytes = sink.getvalue().to_pybytes()
        return data

    def files(self) -> dict[int, str]:
        with self._lock:
            return {i: h.path for i, h in self._held.items()}

    def sizes(self) -> dict[int, int]:
        with self._lock:
            return {i: h.bytes for i, h in self._held.items()}

    def bytes_held(self) -> int:
        with self._lock:
            return sum(h.bytes for h in self._held.values())

    def close(self) -> None:
        """Removes every file: the memory goes back once readers unmap theirs."""
        with self._lock:
            self._held.clear()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.folder)
