"""Deterministic placement of variables on ps tasks.

Every worker runs the same script and so declares the same variables in the same
order; placement is a pure function of those declarations, so every worker computes
the same map without talking to anyone.

* Greedy by bytes (TensorFlow's ``GreedyLoadBalancingStrategy``): each variable, in
  creation order, goes to the least-loaded ps task (lowest index on ties). Loads then
  differ by at most the largest variable.
* Explicit: a variable created under ``clusterflow.device("/job:ps/task:1")`` goes there.
* Partitioned: a partitioner may split a large variable along dimension 0 into shards
  (``MinSizePartitioner``: shards of at least ``min_shard_bytes``, at most
  ``max_shards``), each placed greedily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from clusterflow.errors import ConfigError
from clusterflow.ps.api import Placement, Shard, VariableSpec


class Partitioner(Protocol):
    def num_shards(self, spec: VariableSpec, num_ps: int) -> int:
        """How many shards to cut ``spec`` into along dimension 0 (1: keep it whole)."""
        ...


@dataclass(frozen=True, slots=True)
class MinSizePartitioner:
    """Shards of at least ``min_shard_bytes``, at most ``max_shards`` of them (TF's name)."""

    min_shard_bytes: int = 256 << 10
    max_shards: int = 1

    def __post_init__(self) -> None:
        if self.min_shard_bytes < 1 or self.max_shards < 1:
            raise ConfigError(
                f"MinSizePartitioner needs min_shard_bytes >= 1 and max_shards >= 1, "
                f"got {self.min_shard_bytes} and {self.max_shards}"
            )

    def num_shards(self, spec: VariableSpec, num_ps: int) -> int:
        if not spec.shape:
            return 1
        by_size = max(1, spec.nbytes // self.min_shard_bytes)
        return max(1, min(self.max_shards, by_size, spec.shape[0]))


@dataclass(frozen=True, slots=True)
class FixedShardsPartitioner:
    """Exactly ``num_shards`` shards (fewer if dimension 0 is shorter)."""

    shards: int

    def num_shards(self, spec: VariableSpec, num_ps: int) -> int:
        if not spec.shape:
            return 1
        return max(1, min(self.shards, spec.shape[0]))


def _row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """``torch.tensor_split`` boundaries: the first ``rows % parts`` parts get one more."""
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def place(
    specs: Sequence[VariableSpec], num_ps: int, partitioner: Partitioner | None = None
) -> Placement:
    """The placement of ``specs`` (in creation order) on ``num_ps`` ps tasks.

    Raises:
        ConfigError: no ps task, a duplicate name, or an explicit device out of range.
    """
    if num_ps < 1:
        raise ConfigError("the cluster has no ps task to place variables on")
    load = [0] * num_ps
    placed: dict[str, tuple[Shard, ...]] = {}
    for spec in specs:
        if spec.name in placed:
            raise ConfigError(f"two variables are named {spec.name!r}")
        if spec.device is not None and not 0 <= spec.device < num_ps:
            raise ConfigError(
                f"variable {spec.name!r} is placed on /job:ps/task:{spec.device}, "
                f"but the cluster has {num_ps} ps task(s)"
            )
        parts = 1 if partitioner is None else partitioner.num_shards(spec, num_ps)
        rows = spec.shape[0] if spec.shape else 1
        row_bytes = spec.nbytes // max(1, rows)
        shards = []
        for i, (start, stop) in enumerate(_row_ranges(rows, parts)):
            ps = (
                spec.device
                if spec.device is not None
                else min(range(num_ps), key=lambda k: load[k])
            )
            load[ps] += row_bytes * (stop - start)
            shape = (stop - start, *spec.shape[1:]) if spec.shape else ()
            name = spec.name if parts == 1 else f"{spec.name}/part_{i}"
            shards.append(
                Shard(variable=spec.name, name=name, ps=ps, start=start, stop=stop, shape=shape)
            )
        placed[spec.name] = tuple(shards)
    return Placement(placed)
