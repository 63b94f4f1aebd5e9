"""``RunConfig``: what ``clusterflow start`` asked for validates itself and round-trips."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import pytest

from clusterflow.cluster import TaskId
from clusterflow.errors import ConfigError
from clusterflow.manager.config import BUILTIN_PS_COMMAND, RunConfig

CMD = ("python", "train.py", "--epochs", "3")


def test_defaults_are_one_worker_and_an_untracked_ps_job() -> None:
    config = RunConfig(command=CMD)
    assert config.tasks() == [TaskId("worker", 0)]
    assert config.untracked == frozenset({"ps"})
    assert config.host == "127.0.0.1"


def test_tasks_come_in_canonical_order() -> None:
    config = RunConfig(command=CMD, chief=True, ps=2, workers=2, evaluator=True)
    assert [str(t) for t in config.tasks()] == [
        "chief:0",
        "ps:0",
        "ps:1",
        "worker:0",
        "worker:1",
        "evaluator:0",
    ]


def test_ps_tasks_run_the_builtin_server_unless_told_otherwise() -> None:
    config = RunConfig(command=CMD, ps=1)
    assert config.command_for(TaskId("ps", 0)) == BUILTIN_PS_COMMAND
    assert BUILTIN_PS_COMMAND[0] == sys.executable
    assert config.command_for(TaskId("worker", 0)) == CMD
    custom = dataclasses.replace(config, ps_command=("my-ps", "--port", "0"))
    assert custom.command_for(TaskId("ps", 0)) == ("my-ps", "--port", "0")
    assert custom.command_for(TaskId("worker", 0)) == CMD


def test_tracked_and_untracked() -> None:
    config = RunConfig(
        command=CMD, chief=True, ps=1, workers=1, untracked=frozenset({"ps", "worker"})
    )
    assert config.is_tracked(TaskId("chief", 0))
    assert not config.is_tracked(TaskId("ps", 0))
    assert not config.is_tracked(TaskId("worker", 0))


def test_describe_command_quotes_like_a_shell() -> None:
    assert RunConfig(command=("python", "-c", "print('a b')")).describe_command() == (
        "python -c 'print('\"'\"'a b'\"'\"')'"
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"command": ()}, "no job command"),
        ({"workers": -1}, "^workers must be a non-negative integer, got -1"),
        ({"workers": "2"}, "^workers must be a non-negative integer, got '2'"),
        ({"workers": True}, "^workers"),
        ({"workers": 1.5}, "^workers"),
        ({"ps": -2}, "^ps must be a non-negative integer"),
        ({"untracked": frozenset({"foo"})}, "unknown job 'foo'"),
        ({"workers": 0}, "no task"),
        ({"untracked": frozenset({"worker"})}, "every job is untracked"),
        ({"ps": 1, "workers": 0}, "every job is untracked"),
        ({"grace_s": 0}, "grace_s must be a positive number, got 0"),
        ({"grace_s": "soon"}, "grace_s must be a positive number"),
        ({"heartbeat_s": -1.0}, "heartbeat_s"),
        ({"heartbeat_timeout_s": 0.0}, "heartbeat_timeout_s"),
        ({"register_timeout_s": True}, "register_timeout_s"),
        ({"chief": "yes"}, "chief must be true or false"),
        ({"evaluator": 1}, "evaluator must be true or false"),
        ({"command": ("python", 3)}, "command must be a list of strings"),
        ({"ps_command": ()}, "ps_command is empty"),
        ({"env": {"A": 1}}, "env must map names to strings"),
    ],
)
def test_invalid_values_are_config_errors_naming_them(fields: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {"command": CMD, **fields}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        RunConfig(**values)


def test_a_chief_alone_is_a_cluster() -> None:
    assert RunConfig(command=CMD, chief=True, workers=0).tasks() == [TaskId("chief", 0)]


def test_round_trip_through_json() -> None:
    config = RunConfig(
        command=CMD,
        chief=True,
        ps=2,
        workers=3,
        evaluator=True,
        ps_command=("python", "-m", "my.ps"),
        untracked=frozenset({"ps", "evaluator"}),
        env={"OMP_NUM_THREADS": "1"},
        grace_s=2.5,
        register_timeout_s=30.0,
        heartbeat_s=0.5,
        heartbeat_timeout_s=5.0,
    )
    data = json.loads(json.dumps(config.to_dict()))
    assert data["command"] == list(CMD)
    assert data["untracked"] == ["evaluator", "ps"]
    assert RunConfig.from_dict(data) == config


def test_round_trip_of_defaults() -> None:
    config = RunConfig(command=CMD)
    data = config.to_dict()
    assert data["ps_command"] is None
    assert RunConfig.from_dict(json.loads(json.dumps(data))) == config


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"command": ["x"], "wrokers": 2}, "invalid cluster configuration"),
        ({"command": "python train.py"}, "command must be a list"),
        ({"command": ["x"], "untracked": "ps"}, "untracked must be a list"),
        ({"command": ["x"], "env": ["A=1"]}, "env must be a mapping"),
        ({}, "no job command"),
    ],
)
def test_from_dict_rejects_bad_documents(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(data)


def test_config_is_frozen() -> None:
    config = RunConfig(command=CMD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.workers = 2  # type: ignore[misc]


# Elastic worker jobs (issue 32): --workers MIN:MAX ---------------------------------------


@pytest.mark.parametrize(
    ("layers", "low", "high"),
    [
        ([{"workers": "2:8"}], 2, 8),
        ([{"workers": {"min": 2, "max": 8}}], 2, 8),
        ([{"workers": "3:3"}], 3, 3),
        ([{"workers": 4}], 4, None),
        # a later layer's fixed size replaces an earlier layer's range, and back
        ([{"workers": {"min": 2, "max": 8}}, {"workers": 4}], 4, None),
        ([{"workers": 4}, {"workers": "1:5"}], 1, 5),
        # a resumed cluster's settings (config.json) keep their range
        ([RunConfig(command=CMD, workers=2, workers_max=6).to_dict()], 2, 6),
    ],
)
def test_a_worker_range_starts_at_min_and_may_grow_to_max(
    layers: list[dict[str, Any]], low: int, high: int | None
) -> None:
    """Pins ``parse_workers`` and the layers: the cluster starts MIN workers (the local
    backend's choice, docs/concepts.md), MAX is kept for ``clusterflow scale``."""
    config = RunConfig.merge(*layers, {"command": CMD})
    assert (config.workers, config.workers_max) == (low, high)
    assert [t.index for t in config.tasks() if t.job == "worker"] == list(range(low))
    assert config.elastic == (high is not None)
    assert config.most_workers == (high if high is not None else low)


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ("5:2", "workers 5:2: MAX must be at least MIN"),
        ("0:3", "workers 0:3: MIN must be at least 1"),
        ("a:b", "workers must be N or MIN:MAX with whole numbers, got 'a:b'"),
        ("2:", "workers must be N or MIN:MAX with whole numbers, got '2:'"),
        ({"min": 2}, "workers as a range must be {min: MIN, max: MAX}, got {'min': 2}"),
        ({"min": 2, "max": "many"}, "workers MAX must be a whole number, got 'many'"),
        ({"min": -1, "max": 2}, "workers must be a non-negative integer, got -1"),
    ],
)
def test_a_bad_worker_range_is_refused_naming_it(workers: Any, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        RunConfig.merge({"command": CMD, "workers": workers})
    assert str(raised.value) == message


def test_a_worker_range_needs_a_resizable_backend_and_counts_max_against_the_limit() -> None:
    with pytest.raises(ConfigError, match="a range needs backend local or ray"):
        RunConfig(command=CMD, workers=1, workers_max=3, backend="hosts")
    assert RunConfig(command=CMD, workers=1, workers_max=3, backend="ray").workers_max == 3
    from clusterflow.manager.limits import MAX_PROCESSES

    with pytest.raises(ConfigError, match=f"workers {MAX_PROCESSES + 1} .* at most"):
        RunConfig(command=CMD, workers=1, workers_max=MAX_PROCESSES + 1)
