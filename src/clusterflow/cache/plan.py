"""Pure planning of a cache: cutting records into partitions, placing them on nodes,
checking they fit, and moving a lost node's partitions elsewhere.

No I/O here: the backends measure nodes and sources, these functions decide, and the
unit tests drive them with plain numbers.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from clusterflow._checks import whole
from clusterflow.data.cache_map import Partition
from clusterflow.errors import ConfigError

GRANULE = 1024
"""Partition boundaries fall on multiples of this many records (or of a smaller power
of two for small data), so splits of the data service's default size never straddle
two partitions, and each is read from one node."""


class CacheMemoryError(ConfigError):
    """A cache does not fit the memory its nodes can give; names the node and the shortfall."""


MEMORY = "memory"
"""The kind of a load failure that is a shortfall of memory (``CacheMemoryError``)."""


def failure_kind(exc: BaseException) -> str:
    """What kind of failure ``exc`` is, as a node's load failure travels to the command
    that created the cache (a Ray actor's reply, a local server's record): ``MEMORY`` or
    ``config``. The creator decides by this, never by the message's words."""
    return MEMORY if isinstance(exc, CacheMemoryError) else "config"


def load_error(message: str, kind: str) -> ConfigError:
    """The error a node's load failure of ``kind`` (``failure_kind``) raises where the
    cache was asked for: a ``CacheMemoryError`` for a shortfall of memory."""
    return CacheMemoryError(message) if kind == MEMORY else ConfigError(message)


class CacheExistsError(ConfigError):
    """A cache of that name exists already (it is left as it is)."""


def granule_for(num_records: int, partitions: int) -> int:
    """The largest power of two up to ``GRANULE`` that leaves every partition a record."""
    granule = GRANULE
    while granule > 1 and granule * partitions > num_records:
        granule //= 2
    return granule


def partition_ranges(num_records: int, partitions: int) -> list[tuple[int, int]]:
    """``partitions`` consecutive record ranges as even as the granule allows.

    Raises:
        ConfigError: fewer than one partition, or more partitions than records.
    """
    partitions = whole("--partitions", partitions, least=1)
    if num_records < partitions:
        raise ConfigError(
            f"--partitions {partitions} is more than the source's {num_records} records"
        )
    granule = granule_for(num_records, partitions)
    blocks = -(-num_records // granule)
    bounds = [min(num_records, (blocks * i // partitions) * granule) for i in range(partitions)]
    bounds.append(num_records)
    return list(itertools.pairwise(bounds))


def place(
    ranges: Sequence[tuple[int, int]],
    bytes_per_record: float,
    nodes: Sequence[str],
    replicas: int,
) -> tuple[Partition, ...]:
    """Owners round-robin over ``nodes``; a replica, if asked, on the next node.

    Raises:
        ConfigError: no node, a replica count other than 0 or 1, or a replica asked
            for with one node (it would sit on the node whose loss it is to survive).
    """
    if not nodes:
        raise ConfigError("no node to place the cache on")
    if replicas not in (0, 1):
        raise ConfigError(f"--replicas must be 0 or 1, got {replicas!r}")
    if replicas and len(nodes) < 2:
        raise ConfigError(
            f"--replicas 1 needs 2 nodes or more; this backend has {len(nodes)} ({nodes[0]})"
        )
    return tuple(
        Partition(
            index=i,
            start=start,
            stop=stop,
            bytes=int((stop - start) * bytes_per_record),
            owner=nodes[i % len(nodes)],
            replica=nodes[(i + 1) % len(nodes)] if replicas else None,
        )
        for i, (start, stop) in enumerate(ranges)
    )


def check_memory(name: str, partitions: Sequence[Partition], free: Mapping[str, int]) -> None:
    """Raises ``CacheMemoryError`` naming the first node whose share outgrows ``free``."""
    need: dict[str, int] = {}
    for p in partitions:
        for node in p.holders():
            need[node] = need.get(node, 0) + p.bytes
    for node, wanted in need.items():
        have = free.get(node, 0)
        if wanted > have:
            raise CacheMemoryError(
                f"cache {name!r} does not fit node {node}: it needs {human(wanted)} there, "
                f"{human(have)} is free for caches (short by {human(wanted - have)})"
            )


@dataclass(frozen=True, slots=True)
class Rebalance:
    """What a lost node changes: the new partitions, and what each node must load."""

    partitions: tuple[Partition, ...]
    loads: Mapping[str, tuple[int, ...]]
    """Node -> indexes of partitions it must load (from a surviving holder or the source)."""
    lost_data: tuple[int, ...]
    """Partitions no surviving node held: reloaded from the source."""


def rebalance(
    partitions: Sequence[Partition], lost: set[str], alive: Sequence[str], replicas: int
) -> Rebalance:
    """Moves the partitions of ``lost`` nodes onto ``alive`` ones.

    A partition whose owner is lost is served by its replica, which becomes the owner;
    one that lost every holder goes to the least loaded live node (reloaded from the
    source). Where the cache keeps replicas, a new one is placed on the least loaded
    live node that does not hold the partition yet, if there is one.

    Raises:
        ConfigError: no node is alive.
    """
    if not alive:
        raise ConfigError("every node of the cache is lost: nothing can hold it")
    load: dict[str, int] = dict.fromkeys(alive, 0)
    for p in partitions:
        for node in p.holders():
            if node in load:
                load[node] += p.bytes
    out: list[Partition] = []
    loads: dict[str, list[int]] = {}
    lost_data: list[int] = []
    for p in partitions:
        holders = [n for n in p.holders() if n not in lost]
        if len(holders) == len(p.holders()):
            out.append(p)
            continue
        if not holders:
            owner = min(load, key=lambda n: load[n])
            load[owner] += p.bytes
            loads.setdefault(owner, []).append(p.index)
            lost_data.append(p.index)
            holders = [owner]
        replica: str | None = holders[1] if len(holders) > 1 else None
        if replicas and replica is None:
            spare = [n for n in alive if n not in holders]
            if spare:
                replica = min(spare, key=lambda n: load[n])
                load[replica] += p.bytes
                loads.setdefault(replica, []).append(p.index)
        out.append(replace(p, owner=holders[0], replica=replica))
    return Rebalance(tuple(out), {k: tuple(v) for k, v in loads.items()}, tuple(lost_data))


def human(n: float) -> str:
    """Bytes in the units ``describe`` and errors use: ``1.5 GiB``, ``300 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
