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
