"""A whole restart fences every killed incarnation at the dispatcher, as a respawn does.

A restart kills every task, resets the data cursor to the checkpoint's and relaunches
them all. A request a killed task sent just before it died can still be waiting in the
manager's queue. Its new incarnation's first request raises the bar (``FenceBook``),
but before that nothing refused the old one's: served against the restored cursor, a
lease lent splits to a process that no longer runs and an ack acted on a cursor it
never saw. The manager therefore raises each task's data fence to its next incarnation
before it touches the cursor (``Recovery._fence_data``; docs/failure-semantics.md,
"Fencing"). A worker a resizing restart drops keeps that bar: a namesake a later grow
brings back starts at it, not under it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_manager import fake_backend, fake_manager

from clusterflow.cluster import TaskId
from clusterflow.data.api import DatasetSpec, Lease
from clusterflow.data.messages import LeaseReply
from clusterflow.manager.config import RunConfig
from clusterflow.manager.controller import Controller
from clusterflow.manager.restore import RestorePoint
from clusterflow.rpc import Credentials, RpcClient
from clusterflow.rpc.fencing import Fence, TaskFenced, stamp

pytestmark = pytest.mark.timeout(60)

CREDENTIALS = Credentials.generate()
SPEC = DatasetSpec(name="d", source="s", num_records=40, split_size=4)  # 10 splits


class _Supervisor:
    """A launched task's supervisor, as the manager sees it; killed when told."""

    pid = 4242
    output = None
    memory_kill = False

    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float) -> int | None:
        return self.code

    def signal(self, signum: int) -> None:
        self.code = -signum


def _controller(tmp_path: Path, config: RunConfig) -> Controller:
    """A manager over supervisors that only exist in its table (``_Supervisor``)."""
    backend = fake_backend(
        lambda launch: _Supervisor(), reserve=lambda tasks: None, release=lambda task: None
    )
    return fake_manager(tmp_path, config, backend, CREDENTIALS)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    """Two workers, its dispatcher served on its RPC server."""
    controller = _controller(tmp_path, RunConfig(command=("true",), workers=2, max_restarts=2))
    controller._rpc.start()
    try:
        yield controller
    finally:
        controller._rpc.stop()
        controller.standby.close()
        controller.output.close()


class _Worker:
    """One incarnation of a worker task talking to the manager's dispatcher: its fence
    (the manager's count of its launches) and its process identity, as
    ``DispatcherClient`` sends them."""

    def __init__(self, client: RpcClient, task: str, fence: int, process: str) -> None:
        self.client, self.task, self.process = client, task, process
        self.fence = Fence(task, fence)

    def call(self, method: str, body: dict[str, Any]) -> Any:
        return self.client.call(method, stamp(body, self.fence)).body

    def register(self) -> None:
        self.call("data.register", {"spec": SPEC.to_wire(), "locations": []})

    def lease(self, acks: list[int] | None = None) -> LeaseReply:
        body: dict[str, Any] = {"name": "d", "worker": self.task, "incarnation": self.process}
        if acks:
            body["acks"] = acks
        return LeaseReply.from_wire(self.call("data.lease", body))


def _records(leases: list[Lease]) -> Counter[int]:
    return Counter(r for lease in leases for r in range(lease.start, lease.stop))


def test_a_killed_incarnations_request_is_refused_after_a_whole_restart(
    controller: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zombie's calls come after the restart and before the new incarnations say
    anything (so no request of theirs has raised the bar yet): refused, and nothing is
    lent to it; the restored run then reads every record once."""
    for task in controller.tasks.values():
        controller._launch(task, None)
    with RpcClient(controller._rpc.address, CREDENTIALS, deadline=10) as client:
        zombie = _Worker(client, "worker:0", 0, "old-0")
        zombie.register()
        checkpointed = zombie.lease()
        zombie.lease([checkpointed.leases[0].lease_id])  # acked, and the next one lent
        cursor = controller.data.state_dict()  # the checkpoint: one split done
        lost = zombie.lease()  # trained after it: its update dies with the run
        monkeypatch.setattr(
            controller.restore_points, "newest", lambda with_cursor: RestorePoint("1", cursor)
        )

        controller._relaunch_all("a test's restart")
        assert controller.tasks[TaskId.parse("worker:0")].restarts == 1
        with pytest.raises(TaskFenced):
            zombie.lease()
        with pytest.raises(TaskFenced):
            zombie.call("data.ack", {"name": "d", "leases": [x.lease_id for x in lost.leases]})
        assert controller.data.status("d")["workers"] == {}  # nothing lent to the dead

        # Both new incarnations read to the end: every record once, with the checkpoint's.
        done = list(checkpointed.leases)
        workers = [_Worker(client, f"worker:{i}", 1, f"new-{i}") for i in range(2)]
        for worker in workers:
            worker.register()
        acks: dict[str, list[int]] = {}
        while len(acks) < 2 or any(acks.values()):
            for worker in workers:
                reply = worker.lease(acks.get(worker.task))
                acks[worker.task] = [x.lease_id for x in reply.leases]
                done.extend(reply.leases)
    assert _records(done) == Counter(range(40))
    assert controller.data.fences.counts("worker:0")["refused"] == {0: 2}


def test_a_worker_that_left_at_a_resizing_restart_comes_back_above_its_fence(
    tmp_path: Path,
) -> None:
    """A resizing restart fences the killed launch of a worker it then drops; a later
    grow that brings a worker of that name back launches it at that bar, so the
    dispatcher admits it (under the bar it would be refused as a zombie)."""
    config = RunConfig(command=("true",), workers=2, workers_max=2, max_restarts=2)
    controller = _controller(tmp_path, config)
    try:
        for task in controller.tasks.values():
            controller._launch(task, None)
        controller._restart_resized(1)  # worker:1's launch is killed, fenced, dropped
        assert [str(t) for t in controller.tasks.workers()] == ["worker:0"]
        bar = controller.data.fences.highest("worker:1")
        assert bar == 1

        controller._scale_pending = (2, False)  # a live grow brings worker:1 back
        controller._apply_scale()
        back = controller.tasks[TaskId.parse("worker:1")]
        assert back.restarts >= bar  # its launch's incarnation (CLUSTERFLOW_INCARNATION)
        controller.data.fences.admit("worker:1", back.restarts)  # not refused
    finally:
        controller.standby.close()
        controller.output.close()
