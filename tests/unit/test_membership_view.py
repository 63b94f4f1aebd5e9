"""The membership history of an elastic cluster (issue 32): what the manager records
for each change, and what the dashboard's view makes of a state holding it.

The recording runs on a real ``TaskTable`` and ``Rendezvous`` (no processes): a grow of
two adds both newcomers to the table at once, and each registers later; the size a row
records is the one its own registration published.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from clusterflow.cluster import TaskId
from clusterflow.manager.config import RunConfig
from clusterflow.manager.elastic import Elastic
from clusterflow.manager.rendezvous import Arrival, Rendezvous
from clusterflow.manager.state import ClusterState, MembershipChange, TaskState
from clusterflow.manager.tasks import TaskTable
from clusterflow.ui import views

PS = TaskId("ps", 0)
W = [TaskId("worker", i) for i in range(4)]


class _Manager(Elastic):
    """The elastic side of a controller over a real table and rendezvous."""

    def __init__(self) -> None:
        self.config = RunConfig(command=("job",), ps=1, workers=2, workers_max=4)
        self.tasks = TaskTable(self.config)
        self.rendezvous = Rendezvous([PS, W[0], W[1]], timeout_s=5)
        self.events: list[dict[str, Any]] = []
        self.cluster: Any = SimpleNamespace(
            id="c", append_event=lambda kind, **kw: self.events.append({"event": kind, **kw})
        )
        self._init_elastic()

    def arrive(self, task: TaskId) -> None:
        """What ``Controller._on_register`` does for a task a grow added."""
        assert self.rendezvous.register(task, f"h:{task.index}", respawned=True) == (Arrival.JOINED)
        self.tasks.registered(self.tasks[task], f"h:{task.index}", running=True)
        self._record_membership(task, "joined", self.rendezvous.version)


def test_two_newcomers_of_one_grow_record_3_then_4_workers_and_a_leaver_3() -> None:
    m = _Manager()
    for port, task in enumerate((PS, W[0], W[1]), start=100):
        m.rendezvous.register(task, f"h:{port}", respawned=False)
    for task in (W[2], W[3]):  # `scale --workers 4`: both in the table before either runs
        m.tasks.add(task, tracked=True)
        m.rendezvous.admit(task)
    m.arrive(W[3])  # either may register first
    m.arrive(W[2])
    m._record_membership(W[3], "left", m.rendezvous.dismiss(W[3]))
    rows = [(c.task, c.change, c.spec_version, c.workers) for c in m.membership()]
    assert rows == [
        ("worker:3", "joined", 2, 3),
        ("worker:2", "joined", 3, 4),
        ("worker:3", "left", 4, 3),
    ]
    assert [e["workers"] for e in m.events] == [3, 4, 3]


def test_the_rendezvous_counts_the_members_while_a_barrier_is_open() -> None:
    rdv = Rendezvous([PS, W[0], W[1]], timeout_s=5)
    assert rdv.size("worker") == 2 and rdv.size("chief") == 0
    for port, task in enumerate((PS, W[0], W[1]), start=100):
        rdv.register(task, f"h:{port}", respawned=False)
    rdv.admit(W[2])
    assert rdv.size("worker") == 2  # admitted, not registered: not in the spec yet


def _state(**kw: Any) -> ClusterState:
    tasks = tuple(
        TaskState(task=name, status="running") for name in ("ps:0", "worker:0", "worker:1")
    )
    return ClusterState(id="c", status="running", tasks=tasks, **kw)


def test_the_view_holds_the_size_the_range_and_the_history_newest_first() -> None:
    history = (
        MembershipChange(time=10.0, task="worker:2", change="joined", spec_version=2, workers=3),
        MembershipChange(
            time=11.0, task="worker:2", change="left", spec_version=3, step=40, workers=2
        ),
    )
    view = views.membership(_state(workers_range=(2, 4), membership=history))
    assert view["workers"] == 2 and view["range"] == [2, 4]
    assert view["history"] == [
        {
            "time": 11.0,
            "task": "worker:2",
            "change": "left",
            "step": 40,
            "spec_version": 3,
            "workers": 2,
        },
        {
            "time": 10.0,
            "task": "worker:2",
            "change": "joined",
            "step": None,
            "spec_version": 2,
            "workers": 3,
        },
    ]


def test_a_fixed_size_cluster_has_no_range_and_no_history() -> None:
    assert views.membership(_state()) == {"workers": 2, "range": None, "history": []}
