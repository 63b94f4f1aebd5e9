"""A grow whose newcomer cannot be launched leaves the cluster at the size it reached.

``Elastic._apply_scale`` runs on the manager's loop. A launch that raised there (a
backend refusing a process for a reason other than placement, which ``reserve`` checks
before anything changes) used to escape into the loop and end the whole job ("the
manager failed"). Now the newcomer leaves again (``lost``), the newcomers after it are
never added, the running tasks go on, and the ``scale`` caller is answered with a
``GrowFailed`` naming the task, the cause and the size the cluster runs at.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_manager import fake_backend, fake_manager

from clusterflow.cluster import TaskId
from clusterflow.manager import elastic
from clusterflow.manager.config import RunConfig
from clusterflow.manager.controller import Controller
from clusterflow.manager.elastic import GrowFailed
from clusterflow.rpc import Credentials
from clusterflow.rpc.message import Request
from clusterflow.server.manager_messages import ScaleRequest

pytestmark = pytest.mark.timeout(60)


class _Process:
    pid = 4242
    output = None
    memory_kill = False

    def poll(self) -> int | None:
        return None

    def wait(self, timeout: float) -> int | None:
        return None

    def signal(self, signum: int) -> None:
        pass


def _controller(tmp_path: Path, refused: set[str]) -> Controller:
    released: list[TaskId] = []

    def launch(launch: Any) -> _Process:
        if str(launch.task) in refused:
            raise OSError(f"[Errno 11] Resource temporarily unavailable: {launch.task}")
        return _Process()

    backend = fake_backend(
        launch, reserve=lambda tasks: None, release=released.append, released=released
    )
    config = RunConfig(command=("true",), workers=2, workers_max=4, max_restarts=0)
    return fake_manager(tmp_path, config, backend, Credentials.generate())


@pytest.mark.parametrize(
    ("refused", "kept", "added"),
    [({"worker:2"}, 2, []), ({"worker:3"}, 3, ["worker:2"])],
    ids=["first_newcomer", "second_newcomer"],
)
def test_a_newcomer_that_cannot_be_launched_leaves_and_the_cluster_runs_on(
    tmp_path: Path, refused: set[str], kept: int, added: list[str]
) -> None:
    controller = _controller(tmp_path, refused)
    try:
        for task in controller.tasks.values():
            task.process = _Process()  # type: ignore[assignment]
        controller._scale_pending = (4, False)
        controller._apply_scale()  # raised OSError into the loop before

        assert [str(t) for t in controller.tasks.workers()] == [f"worker:{i}" for i in range(kept)]
        assert controller.config.workers == kept
        assert controller._scale_result == ([TaskId.parse(t) for t in added], [])
        (bad,) = refused
        failure = controller._scale_failure
        assert failure is not None
        assert f"{bad} could not be launched ([Errno 11]" in failure
        assert f"it runs {kept} workers" in failure
        # the refused newcomer left as lost; one never added was released all the same
        lost = [m for m in controller.membership() if m.change == "lost"]
        assert [str(m.task) for m in lost] == [bad]
        assert {str(t) for t in controller.backend.released} == {
            f"worker:{i}" for i in range(int(bad[-1]), 4)
        }
        failed = [e for e in controller.cluster.read_events() if e["event"] == "launch_failed"]
        assert [e["task"] for e in failed] == [bad]
    finally:
        controller.standby.close()
        controller.output.close()


def test_the_scale_request_of_a_grow_cut_short_is_answered_with_grow_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller learns it: ``manager.scale`` raises ``GrowFailed`` (its own wire code)
    with the task, the cause and the size, once the change took effect."""
    controller = _controller(tmp_path, {"worker:3"})
    try:
        for task in controller.tasks.values():
            task.process = _Process()  # type: ignore[assignment]
        # The checks of a running, resizable cluster, and the loop's side done at once
        monkeypatch.setattr(elastic, "check_scale", lambda view, wanted: None)
        monkeypatch.setattr(controller, "_scale_view", lambda: SimpleNamespace(resizable=True))

        def applied() -> Any:
            controller._apply_scale()
            return controller._scale_result

        monkeypatch.setattr(controller, "_await_scale", applied)
        request = Request("manager.scale", ScaleRequest(workers=4).to_wire(), {}, b"cli")
        with pytest.raises(GrowFailed) as caught:
            controller._on_scale(request)
        assert GrowFailed.wire_code == "grow_failed"
        assert str(caught.value) == (
            f"cluster {controller.cluster.id}: worker:3 could not be launched ([Errno 11] "
            "Resource temporarily unavailable: worker:3); it runs 3 workers (added worker:2)"
        )
        assert controller._scale_failure is None  # said once
    finally:
        controller.standby.close()
        controller.output.close()
