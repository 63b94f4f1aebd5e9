"""The local mirror of a Ray-hosted manager's folder (``ray_host.ManagerHandle.refresh``):
the CLI that started a run and a ``describe`` beside it both bring it up to date, and
every byte of the manager's files must land in it once."""

from __future__ import annotations

import fcntl
import threading
from typing import Any

import pytest

from clusterflow.manager import ray_host, registry

pytestmark = pytest.mark.usefixtures("home")

EVENTS = b'{"event": "starting"}\n{"event": "task_exited", "exit_code": -9}\n'
OUTPUT = b"[worker:0] holding 1\n[worker:0] held 1\n"


class _Manager:
    """Answers ``pull`` as ``ManagerHost.pull`` does: each file's bytes after the offset
    asked. ``during_pull`` runs inside the first call, before it answers."""

    def __init__(self, status: str, during_pull: Any = None) -> None:
        self.files = {"events.jsonl": EVENTS, "output.log": OUTPUT}
        self.status = status
        self.during_pull = during_pull
        self.pulls = 0
        self.ended = 0

    def call(self, method: str, offsets: dict[str, int], deadline: float) -> dict[str, Any]:
        assert method == "pull" and deadline > 0
        self.pulls += 1
        files = {name: data[offsets.get(name, 0) :] for name, data in self.files.items()}
        if self.pulls == 1 and self.during_pull is not None:
            self.during_pull()
        return {"state": {"id": "m", "status": self.status}, "files": files}

    def end(self) -> None:
        self.ended += 1


def _two_refreshes(status: str) -> tuple[registry.ClusterDir, _Manager, list[Any]]:
    """One refresh; while its pull is on the wire, a second (another process's
    ``describe``) starts. It is given two seconds: time enough to pull and append when
    nothing holds it back."""
    cluster = registry.create("mirror-abcd")
    results: list[Any] = []

    def second() -> None:
        results.append(ray_host.ManagerHandle(cluster, manager).refresh())  # type: ignore[arg-type]

    thread = threading.Thread(target=second, daemon=True)

    def start_second() -> None:
        thread.start()
        thread.join(2.0)

    manager = _Manager(status, start_second)
    results.append(ray_host.ManagerHandle(cluster, manager).refresh())  # type: ignore[arg-type]
    thread.join(30.0)
    assert not thread.is_alive()
    return cluster, manager, results


def test_two_refreshes_at_once_append_each_byte_once() -> None:
    cluster, manager, results = _two_refreshes("running")

    assert cluster.events_file.read_bytes() == EVENTS
    assert cluster.output_file.read_bytes() == OUTPUT
    assert [r.status for r in results] == ["running", "running"]
    assert manager.pulls == 2 and manager.ended == 0


def test_a_refresh_that_waited_for_the_final_state_takes_it_and_ends_nothing_again() -> None:
    cluster, manager, results = _two_refreshes("succeeded")

    assert cluster.output_file.read_bytes() == OUTPUT
    assert [r.status for r in results] == ["succeeded", "succeeded"]
    # The first collected the final state and let the manager end; the second, which
    # waited for it, neither pulled from a manager that may be gone nor ended it twice.
    assert manager.pulls == 1 and manager.ended == 1


@pytest.mark.timeout(30)
def test_a_refresh_behind_a_stopped_holder_returns_the_last_mirrored_state(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder stopped mid-pull (Ctrl-Z on a foreground ``start``) keeps the lock: a
    ``describe`` beside it shows what the mirror last knew instead of hanging."""
    cluster = registry.create("mirror-held")
    cluster.write_state(registry.ClusterState(id=cluster.id, status="running"))
    manager = _Manager("succeeded")
    monkeypatch.setattr(ray_host, "MIRROR_WAIT_S", 0.5)
    with open(cluster.path / ".mirror.lock", "a") as held:  # the stopped holder's
        fcntl.flock(held, fcntl.LOCK_EX)
        state = ray_host.ManagerHandle(cluster, manager).refresh()  # type: ignore[arg-type]

    assert state is not None and state.status == "running"
    assert manager.pulls == 0 and manager.ended == 0
    assert "held the mirror's lock for 0.5s" in caplog.text
    # Once the holder lets go, the next refresh pulls as usual.
    state = ray_host.ManagerHandle(cluster, manager).refresh()  # type: ignore[arg-type]
    assert state is not None and state.status == "succeeded"
    assert manager.pulls == 1 and cluster.output_file.read_bytes() == OUTPUT
