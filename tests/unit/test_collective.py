"""The collective engine's pure parts: membership from the environment, options, backend
choice, failure recognition, and the heartbeats that name a lost peer. No processes."""

from __future__ import annotations

import threading

import pytest
import torch

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.collective import (
    AllReduceAlgorithm,
    CollectiveError,
    CommunicationImplementation,
    CommunicationOptions,
    Compression,
    Membership,
    MembershipError,
    PeerLost,
)
from clusterflow.collective.group import (
    CollectiveGroup,
    is_collective_failure,
    select_backend,
    select_device,
)
from clusterflow.collective.hierarchy import hosts_of
from clusterflow.collective.liveness import Liveness
from clusterflow.errors import ConfigError

SPEC = ClusterSpec(
    {
        "chief": ["127.0.0.1:2220"],
        "ps": ["127.0.0.1:2221"],
        "worker": ["127.0.0.1:2222", "127.0.0.1:2223"],
    }
)


def _start_env(rank: int, world: int = 3) -> dict[str, str]:
    """What ``clusterflow start`` sets for a replica task (manager/controller.py)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "CLUSTERFLOW_SPEC_VERSION": "2",
    }


# Membership ---------------------------------------------------------------------------


def test_ranks_follow_the_managers_order_chief_then_workers() -> None:
    m = Membership.from_env(_start_env(2), SPEC, TaskId("worker", 1))
    assert (m.rank, m.world_size) == (2, 3)
    assert m.tasks == (TaskId("chief", 0), TaskId("worker", 0), TaskId("worker", 1))
    assert m.describe(0) == "rank 0 (chief:0)"
    assert (m.master_addr, m.master_port) == ("127.0.0.1", 29400)
    assert m.store_host is None and not m.hosts_store  # the manager hosts the store
    assert m.generation == "2.0"


def test_manual_mode_meets_at_the_chiefs_address_and_rank_0_hosts_the_store() -> None:
    chief = Membership.from_env({}, SPEC, TaskId("chief", 0))
    worker = Membership.from_env({}, SPEC, TaskId("worker", 0))
    assert (chief.master_addr, chief.master_port) == ("127.0.0.1", 2220)
    assert chief.hosts_store and not worker.hosts_store and worker.store_host == 0
    # Every replica task of this spec is on 127.0.0.1: one host of three replicas.
    assert (worker.local_rank, worker.local_world_size) == (1, 3)


def test_bare_torchrun_variables_and_a_lone_process() -> None:
    env = {**_start_env(1, 2)}
    del env["TORCHELASTIC_USE_AGENT_STORE"]
    m = Membership.from_env(env)
    assert (m.rank, m.world_size, m.tasks, m.store_host) == (1, 2, None, 0)
    assert m.describe(1) == "rank 1"
    assert Membership.from_env({}) == Membership.single()
    assert Membership.single().world_size == 1


def test_several_replicas_per_task_take_contiguous_ranks() -> None:
    # What --replicas-per-host 2 will launch: two processes per task, one per device.
    env = {**_start_env(3, 6), "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    m = Membership.from_env(env, SPEC, TaskId("worker", 0))
    assert (m.rank, m.world_size, m.local_rank) == (3, 6, 1)
    assert m.describe(3) == "rank 3 (worker:0)" and m.describe(5) == "rank 5 (worker:1)"
    with pytest.raises(MembershipError, match=r"task worker:1 is ranks 4..5"):
        Membership.from_env(env, SPEC, TaskId("worker", 1))


@pytest.mark.parametrize(
    ("env", "task", "message"),
    [
        ({**_start_env(1), "WORLD_SIZE": "4"}, TaskId("worker", 0), "4 is not a multiple of 3"),
        (_start_env(2), TaskId("worker", 0), "RANK=2 but task worker:0 is rank 1"),
        ({}, TaskId("ps", 0), "task ps:0 is not a replica"),
        ({}, None, "names no task"),
    ],
)
def test_a_launcher_that_disagrees_with_the_spec_is_refused(
    env: dict[str, str], task: TaskId | None, message: str
) -> None:
    with pytest.raises(MembershipError, match=message) as info:
        Membership.from_env(env, SPEC, task)
    assert isinstance(info.value, ConfigError)  # a ValueError, as TensorFlow raises


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0"}, "RANK and WORLD_SIZE must be set together"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside a world of 2"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_ADDR and MASTER_PORT"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
            "LOCAL_WORLD_SIZE=3 exceeds WORLD_SIZE=2",
        ),
    ],
)
def test_malformed_variables_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(MembershipError, match=message):
        Membership.from_env(env)


# Options and backends -----------------------------------------------------------------


def test_options_take_tensorflows_names_and_check_values() -> None:
    options = CommunicationOptions(implementation="RING", compression="bf16")  # type: ignore[arg-type]
    assert options.implementation is CommunicationImplementation.RING
    assert options.compression is Compression.BF16
    with pytest.raises(ConfigError, match="unknown implementation 'grpc'"):
        CommunicationOptions(implementation="grpc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="timeout_seconds"):
        CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ConfigError, match="bytes_per_pack"):
        CommunicationOptions(bytes_per_pack=-1)
    assert CommunicationOptions().algorithm is AllReduceAlgorithm.BACKEND
    options = CommunicationOptions(algorithm="Hierarchical")  # type: ignore[arg-type]
    assert options.algorithm is AllReduceAlgorithm.HIERARCHICAL
    with pytest.raises(ConfigError, match="unknown algorithm 'tree'"):
        CommunicationOptions(algorithm="tree")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="algorithm HIERARCHICAL with compression BF16"):
        CommunicationOptions(algorithm=AllReduceAlgorithm.HIERARCHICAL, compression="bf16")  # type: ignore[arg-type]


def test_clusterflows_own_algorithms_run_over_gloo_only() -> None:
    from clusterflow.collective.hooks import check_algorithm

    check_algorithm(AllReduceAlgorithm.HIERARCHICAL, "gloo")
    check_algorithm(AllReduceAlgorithm.BACKEND, "nccl")
    with pytest.raises(ConfigError, match=r"algorithm='hierarchical'\) runs over gloo, but"):
        check_algorithm(AllReduceAlgorithm.HIERARCHICAL, "nccl")


@pytest.mark.parametrize(
    ("places", "hosts"),
    [
        ([(0, 2), (1, 2), (0, 2), (1, 2)], ((0, 1), (2, 3))),
        ([(0, 1), (0, 1), (0, 1)], ((0,), (1,), (2,))),
        ([(0, 3), (1, 3), (2, 3)], ((0, 1, 2),)),
        ([(0, 2), (1, 2), (0, 1)], ((0, 1), (2,))),  # hosts of different sizes
    ],
    ids=["2x2", "3x1", "1x3", "2+1"],
)
def test_hosts_come_from_contiguous_local_ranks(
    places: list[tuple[int, int]], hosts: tuple[tuple[int, ...], ...]
) -> None:
    found = hosts_of(places)
    assert found.ranks == hosts
    assert found.leaders == tuple(h[0] for h in hosts)


@pytest.mark.parametrize(
    ("places", "message"),
    [
        ([(0, 2), (0, 2), (1, 2), (1, 2)], "rank 1 has LOCAL_RANK=0 of LOCAL_WORLD_SIZE=2, but"),
        ([(1, 2), (0, 2)], "rank 0 has LOCAL_RANK=1"),
        ([(0, 2), (1, 2), (0, 2)], "rank 2 has LOCAL_RANK=0 of LOCAL_WORLD_SIZE=2; a"),
        ([(0, 2), (1, 3)], "rank 1 has LOCAL_RANK=1 of LOCAL_WORLD_SIZE=3"),
    ],
    ids=["interleaved-hosts", "no-leader-first", "host-past-the-world", "sizes-disagree"],
)
def test_hosts_not_laid_out_contiguously_are_refused_naming_the_rank(
    places: list[tuple[int, int]], message: str
) -> None:
    with pytest.raises(MembershipError, match=message):
        hosts_of(places)


def test_backend_per_device_or_forced() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert select_backend(CommunicationImplementation.AUTO, cpu) == "gloo"
    assert select_backend(CommunicationImplementation.AUTO, gpu) == "nccl"
    assert select_backend(CommunicationImplementation.RING, gpu) == "gloo"
    assert select_backend(CommunicationImplementation.NCCL, gpu) == "nccl"
    with pytest.raises(CollectiveError, match="NCCL needs a CUDA device"):
        select_backend(CommunicationImplementation.NCCL, cpu)


def test_devices_must_list_one_per_local_replica() -> None:
    two = Membership(rank=1, world_size=2, local_rank=1, local_world_size=2)
    assert select_device(two, ["/cpu:0", "cpu"]) == torch.device("cpu")
    with pytest.raises(MembershipError, match="1 devices given"):
        select_device(two, ["/gpu:0"])


def test_collective_failures_are_told_from_user_errors() -> None:
    reset = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:4295: Connection reset by peer"
    )
    assert is_collective_failure(reset)
    assert is_collective_failure(RuntimeError("Timed out waiting 8000ms for recv operation"))
    wrapped = ValueError("in my step")
    wrapped.__cause__ = reset
    assert is_collective_failure(wrapped)
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(KeyError("x"))


# Liveness -----------------------------------------------------------------------------


class FakeStore:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.failure: Exception | None = None
        self.callers: set[threading.Thread] = set()
        self._added = threading.Condition()

    def add(self, key: str, value: int, /) -> int:
        if self.failure is not None:
            raise self.failure
        with self._added:
            self.callers.add(threading.current_thread())
            self.counts[key] = self.counts.get(key, 0) + value
            self._added.notify_all()
            return self.counts[key]

    def wait_for(self, key: str, count: int, timeout: float = 10.0) -> bool:
        with self._added:
            return self._added.wait_for(lambda: self.counts.get(key, 0) >= count, timeout)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_peer_whose_heartbeat_stopped_is_named() -> None:
    store, clock = FakeStore(), FakeClock()
    me = Liveness(store, rank=0, world_size=3, stale_s=2.0, clock=clock)
    for _ in range(3):
        store.add("beat/1", 1)
        store.add("beat/2", 1)
        me.beat()
        clock.now += 0.5
    assert me.diagnose(0).lost == ()
    for _ in range(6):  # rank 2 dies: only rank 1 keeps beating
        store.add("beat/1", 1)
        me.beat()
        clock.now += 0.5
    diagnosis = me.diagnose(0)
    assert diagnosis.lost == (2,)
    assert diagnosis.silent_s[0] > 2.0
    assert store.counts["beat/0"] == 9  # and we beat each time


def test_a_store_that_stops_answering_is_reported() -> None:
    store, clock = FakeStore(), FakeClock()
    me = Liveness(store, rank=1, world_size=2, clock=clock)
    me.beat()
    store.failure = RuntimeError("Connection reset by peer")
    me.beat()
    assert me.diagnose(0).store_error == "Connection reset by peer"


def test_heartbeat_thread_starts_and_stops() -> None:
    store = FakeStore()
    me = Liveness(store, rank=0, world_size=2, interval_s=0.01)
    me.start()
    try:
        assert store.wait_for("beat/0", 3)
    finally:
        me.stop()
    (beater,) = store.callers - {threading.current_thread()}  # the heartbeat thread
    beater.join(10)  # stop() waits a few intervals for it; a loaded machine may need more
    assert not beater.is_alive()
    stopped = store.counts["beat/0"]
    me.beat()  # a beat by hand still counts: only the thread has stopped
    assert store.counts["beat/0"] == stopped + 1


# Naming the lost peer ---------------------------------------------------------------------

RESET = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")


def _group(
    store: FakeStore, clock: FakeClock, rank: int, store_host: int | None
) -> CollectiveGroup:
    membership = Membership(
        rank=rank,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=2220,
        store_host=store_host,
        tasks=(TaskId("worker", 0), TaskId("worker", 1)),
    )
    liveness = Liveness(store, rank=rank, world_size=2, clock=clock)
    return CollectiveGroup(membership, torch.device("cpu"), liveness=liveness, diagnose_wait_s=0)


def test_a_silent_peer_becomes_peer_lost_naming_rank_and_task() -> None:
    store, clock = FakeStore(), FakeClock()
    group = _group(store, clock, rank=0, store_host=None)
    group._liveness.beat()  # type: ignore[union-attr]
    clock.now += 5
    error = group.translate(RESET, "an all-reduce")
    assert isinstance(error, PeerLost)
    assert (error.ranks, error.tasks) == ((1,), (TaskId("worker", 1),))
    assert str(error).startswith("lost peer rank 1 (worker:1), silent for 5.0 s")
    assert "Connection reset by peer" in str(error)
    assert group.translate(ValueError("not ours")) is None


def test_a_vanished_store_names_the_rank_that_hosted_it() -> None:
    store, clock = FakeStore(), FakeClock()
    group = _group(store, clock, rank=1, store_host=0)
    store.failure = RuntimeError("Broken pipe")
    group._liveness.beat()  # type: ignore[union-attr]
    error = group.translate(RESET)
    assert isinstance(error, PeerLost) and error.ranks == (0,)
    assert "rank 0 (worker:0), which hosts the rendezvous store at 127.0.0.1:2220" in str(error)


def test_a_failure_while_every_peer_beats_is_a_plain_collective_error() -> None:
    store, clock = FakeStore(), FakeClock()
    group = _group(store, clock, rank=0, store_host=None)
    store.add("beat/1", 1)
    group._liveness.beat()  # type: ignore[union-attr]
    error = group.translate(RESET)
    assert type(error) is CollectiveError
    assert "every peer still beats" in str(error)
