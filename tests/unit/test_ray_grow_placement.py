"""Growth on Ray, the placing side (issue 32): a grow's newcomers are placed as one
placement group of their own before the cluster changes, that group goes once its
tasks left, and a grow that cannot be placed is a refused scale with the cluster
untouched.

No Ray here: ``ray_placement.reserve`` and Ray's ``remove_placement_group`` are
stand-ins that record what they were asked; the manager's side is ``Elastic`` on
stand-in collaborators.
"""

from __future__ import annotations

import importlib
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from clusterflow.backends import ray_placement
from clusterflow.backends.ray_backend import RayBackend
from clusterflow.backends.ray_placement import PlacementError, TaskRequest
from clusterflow.cluster import TaskId
from clusterflow.manager.elastic import Elastic, ScaleRefused
from clusterflow.rpc.message import Request

pytestmark = pytest.mark.timeout(30)

W = [TaskId("worker", i) for i in range(4)]
START = [TaskRequest(task=TaskId("chief", 0)), *(TaskRequest(task=t) for t in W[:2])]


class Ray:
    """What the backend asked of Ray: groups reserved (their requests) and removed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, room: bool = True) -> None:
        self.reserved: list[list[TaskRequest]] = []
        self.removed: list[Any] = []
        self.room = room
        monkeypatch.setattr(ray_placement, "reserve", self.reserve)
        # ``ray.util.placement_group`` the attribute is the function: take the module.
        groups = importlib.import_module("ray.util.placement_group")
        monkeypatch.setattr(groups, "remove_placement_group", self.removed.append)

    def reserve(self, requests: list[TaskRequest], name: str, timeout_s: float) -> Any:
        if not self.room:
            raise PlacementError(f"job worker needs CPU=1: not free within {timeout_s:g}s")
        self.reserved.append(list(requests))
        return SimpleNamespace(name=name)


def _backend() -> RayBackend:
    return RayBackend(START, SimpleNamespace(name="start"), name="cf-x", placement_timeout_s=5)


def test_a_grow_is_placed_as_one_group_of_its_own_released_once_its_tasks_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ray = Ray(monkeypatch)
    backend = _backend()
    backend.reserve(W[2:4])
    assert [[r.task for r in group] for group in ray.reserved] == [W[2:4]]  # per change
    grow = backend._unplaced[W[2]][0]
    assert grow.name == "cf-x-grow-1" and backend._unplaced[W[3]] == (grow, 1)
    backend._take_reserved(W[3])
    assert backend._bundles[W[3]] == 1 and backend._grown_groups[W[3]] is grow
    backend.release(W[3])
    assert ray.removed == []  # worker:2 still holds its bundle of the change
    backend.release(W[2])
    assert ray.removed == [grow]
    backend.release(W[1])  # a task of the start: its bundle is the start group's
    assert ray.removed == [grow]
    backend.reserve([W[1]])  # taken again, nothing more asked of Ray
    assert len(ray.reserved) == 1


def test_closing_releases_every_grow_group(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = Ray(monkeypatch)
    backend = _backend()
    backend.reserve(W[2:3])
    backend.reserve(W[3:4])
    backend.close()
    assert sorted(g.name for g in ray.removed) == ["cf-x-grow-1", "cf-x-grow-2", "start"]


class Cluster(Elastic):
    """``Elastic`` on stand-ins: two resizable workers of 2:4, running."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.cluster = SimpleNamespace(id="c0ffee")
        self.config = SimpleNamespace(workers=2, workers_max=4)
        records = [SimpleNamespace(id=t, resizable=True, declared=True) for t in W[:2]]
        self.tasks = SimpleNamespace(
            values=lambda: records, workers=lambda: [r.id for r in records]
        )
        self._status = "running"
        self._wake = threading.Event()
        self.rendezvous = SimpleNamespace(version=1)
        self._init_elastic()


def test_a_grow_that_cannot_be_placed_is_refused_and_the_cluster_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ray = Ray(monkeypatch, room=False)
    cluster = Cluster(_backend())
    with pytest.raises(ScaleRefused, match="job worker needs CPU=1: not free within 5s"):
        cluster._on_scale(Request("manager.scale", {"workers": 3}, {}, b""))
    assert cluster._scale_pending is None and not cluster._wake.is_set()  # nothing to do
    assert ray.reserved == [] and cluster.backend._unplaced == {}
    assert cluster.growth_size() == (2, 4)  # a refused grow sets no ceiling for the watcher


def test_a_grown_worker_is_launched_in_its_room_never_handed_the_standby() -> None:
    """On Ray the warm standby holds no room and sits on any node: a worker a grow adds
    must start in the bundle its change reserved. It is not respawnable until it says
    so at its first step, so ``_launch`` never hands it the standby."""
    from clusterflow.manager.config import RunConfig
    from clusterflow.manager.recovery import Recovery
    from clusterflow.manager.tasks import TaskTable

    record = TaskTable(RunConfig(command=("true",), workers=2)).add(W[2], tracked=True)
    launched: list[TaskId] = []
    handed: list[str] = []

    def launch(spec: Any) -> Any:
        launched.append(spec.task)
        return SimpleNamespace(output=None)

    host = SimpleNamespace(
        standby=SimpleNamespace(hand=lambda task, assign: handed.append(task) or object()),
        backend=SimpleNamespace(launch=launch),
        _task_env=lambda task: {},
    )
    Recovery._launch(host, record, None)  # type: ignore[arg-type]
    assert launched == [W[2]] and handed == []


def test_a_users_scale_caps_what_the_watcher_grows_to_and_the_watchers_own_does_not() -> None:
    """A shrink by hand must not be undone by the next free node: a user's ``scale``
    sets the ceiling the growth watcher reads (``growth_size``); the watcher's own
    requests (``automatic``) leave it. Sizes equal to the current one change nothing
    else, so no loop is needed."""
    cluster = Cluster(_backend())
    assert cluster.growth_size() == (2, 4)  # MAX until a user asks
    cluster._on_scale(Request("manager.scale", {"workers": 2, "automatic": True}, {}, b""))
    assert cluster.growth_size() == (2, 4)
    cluster._on_scale(Request("manager.scale", {"workers": 2}, {}, b""))
    assert cluster.growth_size() == (2, 2)
    with pytest.raises(ScaleRefused):  # refused: the ceiling stays the last granted one
        cluster._on_scale(Request("manager.scale", {"workers": 5}, {}, b""))
    assert cluster.growth_size() == (2, 2)
