"""Planning a cache: partitions, placement, memory, rebalance (pure functions)."""

from __future__ import annotations

import itertools

import pytest

from clusterflow.cache.plan import (
    CacheMemoryError,
    check_memory,
    partition_ranges,
    place,
    rebalance,
)
from clusterflow.errors import ConfigError


def test_partitions_cover_the_records_on_granule_boundaries() -> None:
    ranges = partition_ranges(10_000, 3)
    assert ranges == [(0, 3072), (3072, 6144), (6144, 10_000)]
    assert partition_ranges(5, 5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    for n, k in [(1, 1), (1023, 2), (4096, 4), (100_003, 7), (70, 9)]:
        got = partition_ranges(n, k)
        assert len(got) == k and got[0][0] == 0 and got[-1][1] == n
        assert all(a < b for a, b in got) and all(x[1] == y[0] for x, y in itertools.pairwise(got))


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_a_partition_count_below_one_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="--partitions must be an integer >= 1"):
        partition_ranges(100, bad)  # type: ignore[arg-type]


def test_more_partitions_than_records_is_refused() -> None:
    with pytest.raises(ConfigError, match="more than the source's 3 records"):
        partition_ranges(3, 4)


def test_owners_round_robin_and_replicas_on_the_next_node() -> None:
    parts = place([(0, 10), (10, 20), (20, 30)], 8.0, ["a", "b"], replicas=1)
    assert [(p.owner, p.replica, p.bytes) for p in parts] == [
        ("a", "b", 80),
        ("b", "a", 80),
        ("a", "b", 80),
    ]
    with pytest.raises(ConfigError, match="--replicas 1 needs 2 nodes or more"):
        place([(0, 10)], 1.0, ["a"], replicas=1)


def test_a_cache_that_does_not_fit_names_the_node_and_the_shortfall() -> None:
    parts = place([(0, 1024), (1024, 2048)], 1024.0, ["a", "b"], replicas=1)  # 1 MiB each
    check_memory("c", parts, {"a": 2 << 20, "b": 2 << 20})
    with pytest.raises(CacheMemoryError) as caught:
        check_memory("c", parts, {"a": 2 << 20, "b": 1 << 20})
    message = str(caught.value)
    assert "\n" not in message
    assert "node b" in message and "needs 2.0 MiB" in message and "short by 1.0 MiB" in message


def test_a_lost_owner_hands_its_partitions_to_the_replica_and_places_new_replicas() -> None:
    parts = place([(0, 10), (10, 20), (20, 30)], 1.0, ["a", "b", "c"], replicas=1)
    moved = rebalance(parts, {"b"}, ["a", "c"], replicas=1)
    by_index = {p.index: p for p in moved.partitions}
    assert (by_index[0].owner, by_index[0].replica) == ("a", "c")  # lost its replica b
    assert (by_index[1].owner, by_index[1].replica) == ("c", "a")  # owner b -> replica c
    assert (by_index[2].owner, by_index[2].replica) == ("c", "a")  # untouched
    assert moved.lost_data == ()  # every partition had a surviving copy
    assert sorted((n, i) for n, ix in moved.loads.items() for i in ix) == [("a", 1), ("c", 0)]
    assert all("b" not in p.holders() for p in moved.partitions)


def test_a_partition_without_any_survivor_is_reloaded_on_the_least_loaded_node() -> None:
    parts = place([(0, 10), (10, 20), (20, 30)], 1.0, ["a", "b", "c"], replicas=0)
    moved = rebalance(parts, {"c"}, ["a", "b"], replicas=0)
    assert moved.lost_data == (2,)
    assert moved.partitions[2].owner in ("a", "b") and moved.partitions[2].replica is None
    assert dict(moved.loads) == {moved.partitions[2].owner: (2,)}
    with pytest.raises(ConfigError, match="every node of the cache is lost"):
        rebalance(parts, {"a", "b", "c"}, [], replicas=0)
