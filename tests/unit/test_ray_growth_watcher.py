"""Growth on Ray (``manager/ray_growth.py``): how many workers a joined node's free room
takes, and the watcher that asks for them through ``manager.scale``.

No Ray here: the nodes are values, ``grow`` records what it was asked, the clock is a
number the test moves. ``NodeReader``'s deadline runs against a stand-in read that
blocks until the test releases it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from clusterflow.backends.ray_placement import TaskRequest
from clusterflow.cluster import TaskId
from clusterflow.manager import ray_growth
from clusterflow.manager.ray_growth import (
    BACKOFF_S,
    GrowthWatcher,
    NodeReader,
    NodeRoom,
    ReadTimeout,
    fits_on,
    workers_to_add,
)

pytestmark = pytest.mark.timeout(30)

WORKER = TaskRequest(
    task=TaskId("worker", 0), resources={"CPU": 2.0, "memory": 1e9}, labels={"pool": "spot"}
)


def _node(cpus: float, memory: float = 8e9, **labels: str) -> NodeRoom:
    return NodeRoom(
        node_id=f"n{cpus}", labels=labels or {"pool": "spot"}, free={"CPU": cpus, "memory": memory}
    )


def test_a_node_takes_as_many_workers_as_its_free_room_holds_of_each_resource() -> None:
    assert fits_on(WORKER, _node(4.0)) == 2
    assert fits_on(WORKER, _node(5.9)) == 2
    assert fits_on(WORKER, _node(8.0, memory=1.5e9)) == 1  # memory is the limit
    assert fits_on(WORKER, _node(1.0)) == 0
    assert fits_on(WORKER, _node(16.0, pool="reserved")) == 0  # labels differ


def test_growth_takes_the_room_of_every_node_up_to_max_and_none_at_max() -> None:
    nodes = [_node(2.0), _node(4.0), _node(8.0, pool="other")]
    assert workers_to_add(nodes, WORKER, workers=2, high=8) == 3
    assert workers_to_add(nodes, WORKER, workers=2, high=4) == 2
    assert workers_to_add(nodes, WORKER, workers=4, high=4) == 0
    assert workers_to_add([], WORKER, workers=2, high=4) == 0


class _Cluster:
    """What the watcher sees and asks: the size, the nodes, the grows."""

    def __init__(self) -> None:
        self.workers, self.high = 2, 4
        self.running = True
        self.nodes: list[NodeRoom] = []
        self.reads = 0
        self.asked: list[int] = []
        self.refuse: Exception | None = None
        self.now = 0.0
        self.grown = threading.Event()

    def size(self) -> tuple[int, int] | None:
        return (self.workers, self.high) if self.running else None

    def read(self) -> list[NodeRoom]:
        self.reads += 1
        return list(self.nodes)

    def grow(self, workers: int) -> None:
        self.asked.append(workers)
        self.grown.set()
        if self.refuse is not None:
            raise self.refuse
        self.workers = workers
        self.nodes = []  # the change's placement group took the room

    def watcher(self) -> GrowthWatcher:
        return GrowthWatcher(
            request=WORKER, size=self.size, grow=self.grow, nodes=self.read, clock=lambda: self.now
        )


def test_a_node_that_joins_is_asked_for_once_and_the_cluster_grows_onto_it() -> None:
    c = _Cluster()
    w = c.watcher()
    assert w.poll() == 0 and c.asked == []  # no room yet
    c.nodes = [_node(2.0)]  # a fourth host joins with room for one worker
    assert w.poll() == 1 and c.asked == [3]
    assert w.poll() == 0 and c.asked == [3]  # its room is taken: nothing more
    c.nodes = [_node(8.0)]  # room for four, one left below MAX
    assert w.poll() == 1 and c.asked == [3, 4]
    reads = c.reads
    c.nodes = [_node(8.0)]
    assert w.poll() == 0 and c.reads == reads  # at MAX: Ray is not even read


def test_a_failed_grow_backs_off_before_asking_again() -> None:
    c = _Cluster()
    w = c.watcher()
    c.nodes, c.refuse = [_node(2.0)], RuntimeError("placement timed out")
    assert w.poll() == 0 and c.asked == [3]
    c.now = BACKOFF_S - 0.1
    assert w.poll() == 0 and c.asked == [3]
    c.now, c.refuse = BACKOFF_S, None
    assert w.poll() == 1 and c.asked == [3, 3]


def test_a_cluster_not_running_or_a_failed_read_asks_for_nothing() -> None:
    c = _Cluster()
    c.nodes, c.running = [_node(8.0)], False
    assert c.watcher().poll() == 0 and c.asked == [] and c.reads == 0

    def broken() -> list[NodeRoom]:
        raise ReadTimeout("Ray's nodes were not read within 5s")

    c.running = True
    w = GrowthWatcher(request=WORKER, size=c.size, grow=c.grow, nodes=broken)
    assert w.poll() == 0 and c.asked == []


@pytest.fixture
def stuck(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Ray's read blocks until the event is set (set at the end, so no thread stays)."""
    release = threading.Event()
    calls: list[Any] = []

    def read() -> list[NodeRoom]:
        calls.append(1)
        release.wait(20)
        return [_node(2.0)]

    monkeypatch.setattr(ray_growth, "_ray_nodes", read)
    try:
        yield release
    finally:
        release.set()


def test_a_read_has_a_deadline_and_a_late_one_blocks_the_next(stuck: threading.Event) -> None:
    reader = NodeReader(timeout_s=0.2)
    with pytest.raises(ReadTimeout, match=r"not read within 0\.2s"):
        reader()
    with pytest.raises(ReadTimeout, match="an earlier read of Ray's nodes still runs"):
        reader()
    stuck.set()  # the late read ends: the next starts, and returns what Ray said
    late = reader._late
    assert late is not None
    late.join(5)
    assert [n.free["CPU"] for n in reader()] == [2.0]


def test_the_watcher_polls_on_a_daemon_thread_until_stopped() -> None:
    c = _Cluster()
    c.nodes = [_node(2.0)]
    w = c.watcher()
    w.start()
    try:
        assert w._thread is not None and w._thread.daemon
        assert c.grown.wait(20), "the watcher never asked"  # its first poll: after POLL_S
        assert c.asked == [3]
    finally:
        w.stop()
    assert w._thread is not None and not w._thread.is_alive()


def test_the_grow_is_asked_through_manager_scale_as_the_cli_asks_it() -> None:
    """``scale_asker`` sends ``manager.scale`` with a ``ScaleRequest``; a refusal comes
    back typed (``ScaleRefused``), so the watcher backs off instead of growing."""
    from clusterflow.cluster.contract import ManagerMethod
    from clusterflow.manager.elastic import ScaleRefused
    from clusterflow.rpc import Credentials, Request, RpcServer
    from clusterflow.server.manager_messages import ScaleReply, ScaleRequest

    credentials = Credentials.generate()
    seen: list[int] = []

    def scale(request: Request) -> dict[str, Any]:
        workers = ScaleRequest.from_wire(request.body).workers
        if workers > 4:
            raise ScaleRefused(f"--workers {workers} is outside the range 2:4 of cluster c")
        seen.append(workers)
        return ScaleReply(workers=workers, spec_version=2, joined=("worker:2",)).to_wire()

    server = RpcServer(credentials, name="growth-test")
    server.register(ManagerMethod.SCALE, scale, blocking=True)
    server.start()
    try:
        grow = ray_growth.scale_asker(server.address, credentials)
        assert grow(3) == ScaleReply(workers=3, spec_version=2, joined=("worker:2",))
        with pytest.raises(ScaleRefused, match="outside the range 2:4"):
            grow(5)
        assert seen == [3]
    finally:
        server.stop()
