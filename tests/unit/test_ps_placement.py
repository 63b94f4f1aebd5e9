"""Placement of variables on ps tasks: greedy balance, explicit devices, partitioning."""

from __future__ import annotations

import random

import pytest
import torch

from clusterflow.errors import ConfigError
from clusterflow.ps.api import VariableSpec
from clusterflow.ps.placement import FixedShardsPartitioner, MinSizePartitioner, place


def spec(name: str, *shape: int, device: int | None = None) -> VariableSpec:
    return VariableSpec(name=name, shape=tuple(shape), dtype="float32", device=device)


@pytest.mark.parametrize("num_ps", [2, 3, 5])
@pytest.mark.parametrize("seed", range(5))
def test_greedy_loads_are_within_one_largest_tensor(num_ps: int, seed: int) -> None:
    rng = random.Random(seed)
    specs = [spec(f"v{i}", rng.randint(1, 300), rng.randint(1, 50)) for i in range(40)]
    placement = place(specs, num_ps)
    loads = placement.load(num_ps, {s.name: s for s in specs})
    largest = max(s.nbytes for s in specs)
    assert sum(loads) == sum(s.nbytes for s in specs)
    assert max(loads) - min(loads) <= largest


def test_placement_is_deterministic() -> None:
    specs = [spec(f"v{i}", 10 + i, 3) for i in range(10)]
    assert place(specs, 3) == place(list(specs), 3)


def test_explicit_device_wins() -> None:
    specs = [spec("big", 1000, 10), spec("pinned", 10, device=0), spec("other", 10)]
    placement = place(specs, 2)
    assert placement.shards["pinned"][0].ps == 0
    assert placement.shards["big"][0].ps == 0
    assert placement.shards["other"][0].ps == 1


def test_explicit_device_out_of_range_names_it() -> None:
    with pytest.raises(ConfigError, match="/job:ps/task:3"):
        place([spec("w", 4, device=3)], 2)


def test_duplicate_names_and_no_ps_are_errors() -> None:
    with pytest.raises(ConfigError, match="'w'"):
        place([spec("w", 4), spec("w", 4)], 1)
    with pytest.raises(ConfigError, match="no ps task"):
        place([spec("w", 4)], 0)


def test_partitioned_tensor_reassembles_exactly() -> None:
    tensor = torch.randn(101, 7)
    specs = [spec("emb", 101, 7)]
    placement = place(specs, 3, MinSizePartitioner(min_shard_bytes=100, max_shards=4))
    shards = placement.shards["emb"]
    assert len(shards) == 4
    assert {s.ps for s in shards} == {0, 1, 2}
    parts = [tensor[s.start : s.stop] for s in shards]
    assert [tuple(p.shape) for p in parts] == [s.shape for s in shards]
    assert torch.equal(torch.cat(parts), tensor)
    assert [s.name for s in shards] == [f"emb/part_{i}" for i in range(4)]


def test_min_size_partitioner_respects_min_bytes_and_rows() -> None:
    part = MinSizePartitioner(min_shard_bytes=400, max_shards=10)
    assert part.num_shards(spec("a", 10, 10), 2) == 1  # 400 bytes: one shard
    assert part.num_shards(spec("b", 100, 10), 2) == 10  # 4000 bytes, capped by max_shards
    assert part.num_shards(spec("c", 3, 1000), 2) == 3  # no more shards than rows
    assert part.num_shards(spec("scalar"), 2) == 1
    assert FixedShardsPartitioner(4).num_shards(spec("d", 2, 5), 2) == 2


def test_bad_partitioner_settings() -> None:
    with pytest.raises(ConfigError, match="min_shard_bytes"):
        MinSizePartitioner(min_shard_bytes=0)
