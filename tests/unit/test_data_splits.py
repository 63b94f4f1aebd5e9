"""Pure split logic: ranges, per-epoch orders, shuffle buffers, the host-aware queue."""

from __future__ import annotations

import numpy as np
import pytest

from clusterflow.data.api import DatasetSpec, Lease
from clusterflow.data.splits import (
    PendingQueue,
    epoch_order,
    hosts_from_runs,
    location_runs,
    shuffle_buffer_order,
    split_range,
    split_seed,
)
from clusterflow.errors import ConfigError


def test_splits_cover_the_records_once_down_to_one_record() -> None:
    for n, size in [(10, 3), (10, 1), (10, 10), (10, 64), (1, 1)]:
        spec = DatasetSpec(name="d", source="s", num_records=n, split_size=size)
        records = [r for i in range(spec.num_splits) for r in range(*split_range(i, n, size))]
        assert records == list(range(n))


def test_epoch_orders_differ_per_epoch_and_repeat_per_seed() -> None:
    first = [epoch_order(7, e, 50) for e in range(3)]
    again = [epoch_order(7, e, 50) for e in range(3)]
    assert first == again
    assert first[0] != first[1] != first[2]
    assert all(sorted(o) == list(range(50)) for o in first)
    assert epoch_order(8, 0, 50) != first[0]


@pytest.mark.parametrize(("n", "buffer"), [(100, 0), (100, 1), (100, 10), (100, 100), (7, 500)])
def test_shuffle_buffer_is_a_reproducible_permutation(n: int, buffer: int) -> None:
    order = shuffle_buffer_order(n, buffer, split_seed(1, 0, 3))
    assert sorted(order.tolist()) == list(range(n))
    assert np.array_equal(order, shuffle_buffer_order(n, buffer, split_seed(1, 0, 3)))
    if buffer > 1:
        assert order.tolist() != list(range(n))


def test_small_shuffle_buffer_only_moves_records_locally() -> None:
    order = shuffle_buffer_order(1000, 10, split_seed(0, 0, 0))
    # A record cannot come out before the buffer has read it.
    assert all(record <= position + 9 for position, record in enumerate(order.tolist()))


def test_location_runs_round_trip() -> None:
    hosts = ["a", "a", None, "b", "b", "a"]
    runs = location_runs(hosts)
    assert runs == [[0, 2, "a"], [3, 5, "b"], [5, 6, "a"]]
    assert hosts_from_runs(runs, 6) == {0: "a", 1: "a", 3: "b", 4: "b", 5: "a"}


def test_queue_prefers_local_splits_and_never_starves() -> None:
    hosts = {0: "a", 1: "b", 2: "a", 3: "b"}
    queue = PendingQueue([0, 1, 2, 3, 4], hosts)
    assert queue.pop("b") == 1
    assert queue.pop("b") == 3
    assert queue.pop("b") == 0  # nothing left on b: the head of the queue
    assert queue.pop("c") == 2  # a host without local splits is served too
    assert queue.pop("a") == 4
    assert queue.pop("a") is None
    assert len(queue) == 0


def test_returned_split_goes_to_the_head() -> None:
    queue = PendingQueue([5, 6, 7], {})
    assert queue.pop(None) == 5
    queue.push_front(5)
    assert queue.pending() == [5, 6, 7]
    queue.remove(6)
    assert [queue.pop(None), queue.pop(None), queue.pop(None)] == [5, 7, None]


def test_spec_validates_itself() -> None:
    with pytest.raises(ConfigError, match="split_size"):
        DatasetSpec(name="d", source="s", num_records=10, split_size=0)
    with pytest.raises(ConfigError, match="num_records"):
        DatasetSpec(name="d", source="s", num_records=0)
    with pytest.raises(ConfigError, match="epochs"):
        DatasetSpec(name="d", source="s", num_records=1, epochs=0)
    spec = DatasetSpec(name="d", source="s", num_records=10, split_size=3, seed=2, epochs=None)
    assert DatasetSpec.from_wire(spec.to_wire()) == spec
    other = DatasetSpec(name="d", source="s", num_records=10, split_size=4, seed=2, epochs=None)
    assert spec.differences(other) == ["split_size: 3 != 4"]
    assert Lease.from_wire(Lease(1, 0, 5, 9).to_wire()) == Lease(1, 0, 5, 9)
