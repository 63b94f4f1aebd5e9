"""A standby handed a task is the task's process before it can learn of the task.

The standby registers the moment its held ``manager.standby`` call returns, and the
manager refuses a registration whose pid is not the task's current process. On Ray the
backend's ``adopt`` (after the hand) took long enough that the standby registered first
and was refused; the run then waited out its respawn.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from clusterflow.backends.api import TaskLaunch, TaskProcess
from clusterflow.cluster import TaskId
from clusterflow.manager.output import OutputRouter
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.standby import StandbyPool
from clusterflow.server.manager_messages import StandbyReply


class _Process:
    pid = 4242
    output = None

    def poll(self) -> int | None:
        return None


class _SlowAdopt:
    """A backend whose ``adopt`` blocks until the test lets it go (Ray's is slow)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def launch(self, launch: TaskLaunch) -> Any:
        return _Process()

    def adopt(self, process: TaskProcess, task: TaskId) -> None:
        assert self.release.wait(30)


def test_the_task_owns_the_standby_before_the_standby_hears_of_it(tmp_path: Path) -> None:
    backend = _SlowAdopt()
    (tmp_path / "cluster").mkdir()
    pool = StandbyPool(
        backend,  # type: ignore[arg-type]
        OutputRouter(tmp_path / "out.log", echo=False),
        ClusterDir(tmp_path / "cluster"),
        stopping=lambda: False,
    )
    pool.keep(lambda: TaskLaunch(task=TaskId.parse("worker:1"), env={}))
    owner: dict[str, Any] = {}
    seen: dict[str, Any] = {}

    def standby() -> None:  # the standby's held call, as the RPC handler makes it
        answer = pool.wait(4242, 10)
        seen["answer"] = answer
        seen["owner_then"] = owner.get("process")  # what _on_register would check

    waiter = threading.Thread(target=standby, daemon=True)
    waiter.start()
    hander = threading.Thread(
        target=lambda: pool.hand("worker:1", lambda p: owner.__setitem__("process", p)),
        daemon=True,
    )
    hander.start()
    waiter.join(30)
    backend.release.set()
    hander.join(30)
    assert seen["answer"] == StandbyReply(task="worker:1")
    assert seen["owner_then"] is not None and seen["owner_then"].pid == 4242
