"""``Controller.state`` never shows a respawned task running at an address its spec lacks.

A respawned task's registration (on an RPC thread) publishes its new address in the
spec, then marks the task running. ``state`` runs on another thread; a read of the spec
before that registration and of the tasks after it showed the task running at the new
address beside a spec naming the old one (seen once in CI, in ``test_ray``'s standby
test). Here the registration runs exactly between the two reads, whichever comes first.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from clusterflow.cluster import TaskId
from clusterflow.manager.controller import Controller
from clusterflow.manager.rendezvous import Rendezvous
from clusterflow.manager.state import TaskState

WORKERS = [TaskId("worker", 0), TaskId("worker", 1)]
OLD, NEW = "10.0.0.7:4000", "10.0.0.2:5000"


def test_a_task_read_running_at_an_address_is_in_the_spec_read_with_it() -> None:
    rendezvous = Rendezvous(WORKERS, timeout_s=10)
    rendezvous.register(WORKERS[0], "10.0.0.1:4000", respawned=False)
    rendezvous.register(WORKERS[1], OLD, respawned=False)
    task = {"status": "restarting", "address": OLD}
    reads: list[str] = []

    def between_the_reads(what: str) -> None:
        reads.append(what)
        if len(reads) == 1:  # the respawned task registers, as _on_register does
            rendezvous.register(WORKERS[1], NEW, respawned=True)
            task.update(status="running", address=NEW)

    class Tasks:
        def states(self) -> tuple[TaskState, ...]:
            states = (
                TaskState(task="worker:0", status="running", address="10.0.0.1:4000"),
                TaskState(task="worker:1", status=task["status"], address=task["address"]),
            )
            between_the_reads("tasks")
            return states

    current = rendezvous.current

    def spec_read() -> Any:
        got = current()
        between_the_reads("spec")
        return got

    rendezvous.current = spec_read  # type: ignore[method-assign]
    fake: Any = SimpleNamespace(
        cluster=SimpleNamespace(id="c1"),
        _status="running",
        _created=0.0,
        backend=SimpleNamespace(name="local"),
        config=SimpleNamespace(command=("job",), max_restarts=1),
        _rpc=SimpleNamespace(address="127.0.0.1:1"),
        _restarts=1,
        _memory_restarts=0,
        standby=SimpleNamespace(state=lambda: None),
        restore_points=SimpleNamespace(url=None),
        tasks=Tasks(),
        rendezvous=rendezvous,
        workers_range=lambda: None,
        membership=lambda: (),
    )
    state = Controller.state(fake)
    assert len(reads) == 2
    spec = state.spec
    assert spec is not None
    for shown in state.tasks:
        if shown.status == "running":
            index = int(shown.task.split(":")[1])
            assert spec["worker"][index] == shown.address, (reads, shown, spec)
