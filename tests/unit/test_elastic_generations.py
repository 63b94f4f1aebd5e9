"""The generations of a resizing all-reduce group (``collective/elastic.py``, issue 32).

A real ``TCPStore`` hosted in this process stands for the manager's: what one
generation's group writes under its prefix must be invisible to the next one's, and a
newcomer must find the generation it joins (once), not an older one.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

from clusterflow.collective.elastic import (
    Generation,
    generation_name,
    joining_generation,
    mark_started,
    next_tasks,
    publish,
    ready,
    share_of,
)
from clusterflow.collective.group import group_prefix
from clusterflow.data.api import Lease
from clusterflow.data.batching import Batcher, ReadSplit
from clusterflow.data.collate import numpy_collate
from clusterflow.strategies.resizing import _membership

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store() -> Iterator[TCPStore]:
    host = TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=5))
    yield host
    del host


def _generation(number: int, tasks: tuple[str, ...], newcomers: tuple[str, ...] = ()) -> Generation:
    return Generation(
        number=number,
        tasks=tasks,
        newcomers=newcomers,
        spec_version=number + 1,
        step=10 * number,
        global_batch=12,
        base_world=3,
    )


def test_a_message_of_generation_g_cannot_be_read_by_generation_g_plus_1(store: TCPStore) -> None:
    """The group of each generation meets under its own prefix (``group_prefix`` of the
    membership ``_membership`` builds for it): a rank's address that generation 1's
    group published is not there for generation 2's, which must wait for its own."""
    tasks = ("chief:0", "worker:0", "worker:1")
    old = _membership(_generation(1, tasks), "worker:0", "127.0.0.1", store.port)
    new = _membership(_generation(2, tasks), "worker:0", "127.0.0.1", store.port)
    assert group_prefix(old) != group_prefix(new)
    PrefixStore(group_prefix(old), store).set("group/0//cpu//0/1", "address of gen 1")
    later = PrefixStore(group_prefix(new), store)
    assert not later.check(["group/0//cpu//0/1"])
    later.set_timeout(datetime.timedelta(milliseconds=200))
    with pytest.raises(Exception, match=r"(?i)timeout"):
        later.get("group/0//cpu//0/1")
    # and the first group's own prefix is not a generation's either
    assert group_prefix(new) != "clusterflow/1.0"


def test_the_membership_of_a_generation_ranks_its_tasks_in_order() -> None:
    generation = _generation(3, ("chief:0", "worker:0", "worker:2"), ("worker:2",))
    member = _membership(generation, "worker:2", "h", 1)
    assert (member.rank, member.world_size, member.store_host) == (2, 3, None)
    assert [str(t) for t in member.tasks or ()] == list(generation.tasks)
    assert member.generation == generation_name(3)


def test_next_tasks_keeps_the_survivors_order_and_appends_newcomers_by_job_and_index() -> None:
    current = ["chief:0", "worker:0", "worker:1", "worker:3"]
    spec = ["chief:0", "worker:0", "worker:1", "worker:3", "worker:10", "worker:4"]
    tasks, newcomers = next_tasks(current, ["worker:1"], spec)
    assert tasks == ("chief:0", "worker:0", "worker:3", "worker:4", "worker:10")
    assert newcomers == ("worker:4", "worker:10")
    assert next_tasks(current, [], current) == (tuple(current), ())


@pytest.mark.parametrize(("rows", "world"), [(12, 5), (12, 4), (7, 3), (3, 5)])
def test_shares_of_a_global_batch_sum_to_it_and_differ_by_one_at_most(
    rows: int, world: int
) -> None:
    shares = [share_of(rows, world, r) for r in range(world)]
    assert sum(shares) == rows and max(shares) - min(shares) <= 1


def test_a_newcomer_joins_only_a_running_group_and_takes_its_invitation_once(
    store: TCPStore,
) -> None:
    """Before rank 0 marks the first group started, a replica is one of the first; after,
    it says it is ready (rank 0 admits only such newcomers) and waits for the generation
    that names it; the invitation is taken, so a task of the same name added again later
    waits for a generation of its own."""
    assert joining_generation(store, "worker:2", 1.0) is None
    assert ready(store, ["worker:2"]) == ()
    mark_started(store)
    first = _generation(1, ("chief:0", "worker:0", "worker:2"), ("worker:2",))
    joined: list[Generation | None] = []
    # its own connection, as the newcomer's process has
    own = TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
    newcomer = threading.Thread(
        target=lambda: joined.append(joining_generation(own, "worker:2", 10.0)), daemon=True
    )
    newcomer.start()
    deadline = time.monotonic() + 10
    while ready(store, ["worker:2", "worker:3"]) != ("worker:2",):
        assert time.monotonic() < deadline, "the newcomer never said it is ready"
        time.sleep(0.01)
    publish(store, first)
    newcomer.join(10)
    assert joined == [first]
    assert ready(store, ["worker:2"]) == ()
    with pytest.raises(Exception, match=r"(?i)timeout"):
        joining_generation(store, "worker:2", 0.2)
    again = _generation(4, ("chief:0", "worker:0", "worker:2"), ("worker:2",))
    publish(store, again)
    assert joining_generation(store, "worker:2", 1.0) == again


def test_a_batch_size_that_shrinks_below_the_records_held_back_flushes_them() -> None:
    """``DataClient.set_batch_size`` between two cuts: the records held back come out as
    one batch (a resized replica's share shrank) rather than a negative cut."""
    batcher = Batcher(4, numpy_collate, "d")
    first = ReadSplit(Lease(1, 0, 0, 6), {"id": np.arange(0, 6)}, None)
    a = batcher.cut(first)
    assert a is not None and a.data["id"].tolist() == [0, 1, 2, 3]
    assert batcher.cut(first) is None and batcher.held == 2  # 4, 5 held back
    batcher.batch_size = 1
    b = batcher.cut(ReadSplit(Lease(2, 0, 6, 12), {"id": np.arange(6, 12)}, None))
    assert b is not None and b.data["id"].tolist() == [4, 5] and b.completes == (1,)


class _Data:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def set_batch_size(self, size: int) -> None:
        self.sizes.append(size)


def _resizing(policy: str, rank: int, world: int) -> Any:
    """The batch policy's side of a strategy in a group of ``world`` (no group formed)."""
    from clusterflow.strategies.all_reduce import CollectiveAllReduceStrategy

    strategy: Any = object.__new__(CollectiveAllReduceStrategy)
    strategy._group = SimpleNamespace(world_size=world, rank=rank)
    strategy._elastic_batch = policy
    strategy._global_batch, strategy._base_world, strategy._base_lrs = 12, 3, [0.3, 0.03]
    return strategy


def test_the_global_batch_policy_gives_each_replica_its_share() -> None:
    data = _Data()
    session = SimpleNamespace(data=data, optimizer=None)
    for rank in range(5):
        _resizing("global", rank, 5)._apply_batch_policy(session)
    assert data.sizes == [3, 3, 2, 2, 2]


def test_the_per_replica_policy_keeps_the_batch_and_scales_the_lr_linearly() -> None:
    data = _Data()
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(
        [{"params": [params[0]], "lr": 0.3}, {"params": [params[1]], "lr": 0.03}]
    )
    session = SimpleNamespace(data=data, optimizer=optimizer)
    _resizing("per_replica", 4, 5)._apply_batch_policy(session)
    assert data.sizes == []
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5, 0.05])
    _resizing("per_replica", 0, 2)._apply_batch_policy(session)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.2, 0.02])


def test_an_unknown_batch_policy_is_refused_naming_it() -> None:
    from clusterflow.strategies.api import StrategyError
    from clusterflow.strategies.resizing import check_elastic_batch

    with pytest.raises(StrategyError, match="got 'both'"):
        check_elastic_batch("both")
