"""``RunConfig.merge``: a resumed cluster's settings, a cluster file, then the flags."""

from __future__ import annotations

import dataclasses

import pytest

from clusterflow.errors import ConfigError
from clusterflow.manager.config import FILE_KEYS, RunConfig

RESUMED = RunConfig(
    command=("python", "train.py"),
    ps=1,
    workers=2,
    max_restarts=3,
    checkpoint_dir="/old/checkpoints",
    env={"A": "1"},
).to_dict()


def test_later_layers_win_and_earlier_ones_fill_the_rest() -> None:
    config = RunConfig.merge(
        RESUMED,
        {"workers": 4, "env": {"B": 2}, "untracked": "ps, evaluator"},
        {"max_restarts": 5, "grace_s": 3.0},
    )
    assert config.command == ("python", "train.py")  # from the resumed cluster
    assert (config.ps, config.workers) == (1, 4)  # the file over the resumed cluster
    assert config.max_restarts == 5 and config.grace_s == 3.0  # the flags over both
    assert config.env == {"B": "2"}  # a layer's env replaces, its values as strings
    assert config.untracked == frozenset({"ps", "evaluator"})
    assert config.checkpoint_dir == "/old/checkpoints"


def test_commands_may_be_strings_or_lists_and_flags_give_tuples() -> None:
    file = {"command": "python -m job --lr 0.1", "ps_command": ["my-ps", "--port", "0"]}
    config = RunConfig.merge(file, {"ps": 1})
    assert config.command == ("python", "-m", "job", "--lr", "0.1")
    assert config.ps_command == ("my-ps", "--port", "0")
    assert RunConfig.merge(file, {"command": ("python", "x.py")}).command == ("python", "x.py")


def test_the_file_form_of_resources_is_read_as_bytes() -> None:
    config = RunConfig.merge(
        {"command": "x", "backend": "ray", "resources": {"worker": {"memory": "1G", "CPU": 2}}}
    )
    assert config.resources == {"worker": {"memory": 2**30, "CPU": 2}}


@pytest.mark.parametrize(
    ("layer", "match"),
    [
        ({"command": 5}, "command must be a string or a list of strings, got 5"),
        ({"command": "x", "untracked": 3}, "untracked must be a list or a comma-separated"),
        ({"command": "x", "env": ["A=1"]}, "env must be a mapping"),
        ({"command": "x", "colour": "red"}, "invalid cluster configuration"),
        ({"command": "x", "workers": -1}, "^workers must be a non-negative integer"),
        ({}, "no job command given"),
    ],
)
def test_a_bad_layer_is_one_clear_error(layer: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig.merge(layer)


def test_every_key_a_cluster_file_may_hold_is_a_setting() -> None:
    assert {f.name for f in dataclasses.fields(RunConfig)} >= FILE_KEYS
