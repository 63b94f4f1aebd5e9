"""The ``cache.*`` wire contract: each request and reply typed once, for both ends.

A cache server (``cache/server.py``) serves it; a reader on another node
(``data/cache_source.py``) calls ``cache.read``. The types live on the data side of the
layers, as ``cache_map.py`` does, because the reader is the data layer's and the cache
package imports the data layer, not the other way round. A body that breaks the
contract is ``rpc``'s ``MalformedBody``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from clusterflow.rpc.errors import MalformedBody
from clusterflow.rpc.message import body_map

SERVICE = "cache"
READ, LOAD, STATS, STOP = (f"{SERVICE}.{m}" for m in ("read", "load", "stats", "stop"))
METHODS = (READ, LOAD, STATS, STOP)
"""Every method a cache server registers."""


def _count(method: str, body: Mapping[str, Any], key: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedBody(f"{method}: {key} must be a non-negative integer, got {value!r:.80}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadRequest:
    """Records ``start..stop`` of one partition, for a reader on another node."""

    METHOD: ClassVar[str] = READ
    name: str
    """The cache's name: a server holds one cache and refuses reads of another."""
    partition: int
    start: int
    stop: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "partition": self.partition,
            "start": self.start,
            "stop": self.stop,
        }

    @classmethod
    def from_wire(cls, body: Any) -> ReadRequest:
        b = body_map(f"{cls.METHOD} body", body)
        name = b.get("name")
        if not isinstance(name, str):
            raise MalformedBody(f"{cls.METHOD}: name must be a cache's name, got {name!r:.80}")
        start, stop = _count(cls.METHOD, b, "start"), _count(cls.METHOD, b, "stop")
        if stop < start:
            raise MalformedBody(f"{cls.METHOD}: stop {stop} is before start {start}")
        return cls(name=name, partition=_count(cls.METHOD, b, "partition"), start=start, stop=stop)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadReply:
    ipc: bytes
    """The records as one Arrow IPC stream."""

    def to_wire(self) -> dict[str, Any]:
        return {"ipc": self.ipc}

    @classmethod
    def from_wire(cls, body: Any) -> ReadReply:
        ipc = body_map(f"{READ} reply", body).get("ipc")
        if not isinstance(ipc, bytes | bytearray | memoryview):
            raise MalformedBody(f"{READ} reply: ipc must be bytes, got {type(ipc).__name__}")
        return cls(ipc=bytes(ipc))


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRequest:
    """More partitions for this server, from the source (a lost node's, say)."""

    METHOD: ClassVar[str] = LOAD
    source: str
    parts: tuple[tuple[int, int, int], ...]
    """``(index, start, stop)`` of each partition."""
    limit: int | None = None
    """Bytes this server may hold at most; None: no limit of its own."""

    def to_wire(self) -> dict[str, Any]:
        return {"source": self.source, "parts": [list(p) for p in self.parts], "limit": self.limit}

    @classmethod
    def from_wire(cls, body: Any) -> LoadRequest:
        b = body_map(f"{cls.METHOD} body", body)
        source, parts, limit = b.get("source"), b.get("parts"), b.get("limit")
        if not isinstance(source, str) or not source:
            raise MalformedBody(f"{cls.METHOD}: source must be a URL, got {source!r:.80}")
        ok = isinstance(parts, list) and all(
            isinstance(p, list | tuple)
            and len(p) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p)
            for p in parts
        )
        if not ok:
            raise MalformedBody(
                f"{cls.METHOD}: parts must be [index, start, stop] triples, got {parts!r:.80}"
            )
        assert isinstance(parts, list)  # ok says so
        if limit is not None:
            limit = _count(cls.METHOD, b, "limit")
        return cls(
            source=source, parts=tuple((int(i), int(a), int(z)) for i, a, z in parts), limit=limit
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReply:
    sizes: dict[int, int]
    """Bytes now held, per partition index (``bytes`` on the wire)."""
    files: dict[str, Any]
    """The server as the partition map lists it (``NodeServer.to_json``)."""

    def to_wire(self) -> dict[str, Any]:
        return {"bytes": {str(k): v for k, v in self.sizes.items()}, "files": self.files}

    @classmethod
    def from_wire(cls, body: Any) -> LoadReply:
        b = body_map(f"{LOAD} reply", body)
        sizes, files = b.get("bytes"), b.get("files")
        if not isinstance(sizes, Mapping) or not isinstance(files, Mapping):
            raise MalformedBody(f"{LOAD} reply: bytes and files must be maps")
        return cls(sizes={int(k): int(v) for k, v in sizes.items()}, files=dict(files))
