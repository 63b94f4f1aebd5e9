"""state.json as one typed value (manager/state.py): written by the manager, read by the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusterflow.cluster.contract import ENV_HOME
from clusterflow.errors import ConfigError
from clusterflow.manager import registry
from clusterflow.manager.state import ClusterState, ManagerProcess, StandbyState, TaskState

STATE = ClusterState(
    id="abc",
    status="running",
    created=1000.0,
    backend="local",
    command=("python", "train.py"),
    manager=ManagerProcess(pid=42, create_time=999.5, address="127.0.0.1:5000"),
    spec={"worker": ["127.0.0.1:1"]},
    spec_version=2,
    restarts=1,
    max_restarts=3,
    standby=StandbyState(pid=77, ready=True, kept=2, ready_count=1),
    checkpoint_dir="memory://c",
    tasks=(
        TaskState(task="worker:0", status="running", pid=43, step=12, loss=0.5),
        TaskState(task="ps:0", tracked=False, exit_code=0, status="succeeded"),
    ),
)


def test_a_state_survives_the_file() -> None:
    assert ClusterState.from_dict(json.loads(json.dumps(STATE.to_dict()))) == STATE


def test_the_file_keeps_its_keys() -> None:
    data = STATE.to_dict()
    assert data["tasks"][0] == {
        "task": "worker:0",
        "tracked": True,
        "status": "running",
        "address": None,
        "pid": 43,
        "exit_code": None,
        "restarts": 0,
        "step": 12,
        "loss": 0.5,
    }
    assert "exit_code" not in data and "summary" not in data  # only once the run ended
    ended = STATE.finished(exit_code=3, summary="task worker:0 exited with code 3", ended=2.0)
    assert ended.to_dict()["exit_code"] == 3 and ended.to_dict()["ended"] == 2.0


def test_reading_skips_what_it_does_not_know_and_what_has_the_wrong_type() -> None:
    state = ClusterState.from_dict(
        {
            "id": "abc",
            "status": "running",
            "future_field": {"x": 1},
            "restarts": "two",
            "tasks": [{"task": "worker:0", "step": True, "loss": "nan"}, "junk"],
            "manager": {"pid": "12"},
        }
    )
    assert state.restarts == 0 and state.manager == ManagerProcess()
    assert state.tasks == (TaskState(task="worker:0", status="?"),)  # the CLI shows "?"


def test_a_state_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        ClusterState.from_dict([1, 2])  # type: ignore[arg-type]


def test_the_registry_writes_and_reads_the_typed_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_HOME, str(tmp_path))
    cluster = registry.create("abc")
    cluster.write_state(STATE)
    assert cluster.read_state() == STATE
    assert registry.effective_status(STATE) == "stale"  # pid 42 is not this manager
