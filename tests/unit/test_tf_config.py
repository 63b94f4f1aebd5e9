"""Behaviour of TFConfig: TensorFlow's TF_CONFIG JSON, byte for byte."""

from __future__ import annotations

import json

import pytest

from clusterflow.cluster import ClusterSpec, TaskId, TFConfig, TFConfigError
from clusterflow.errors import ConfigError

# The example of TensorFlow's multi-worker guide, in the compact form we write.
TF_EXAMPLE = (
    '{"cluster":{"chief":["127.0.0.1:2000"],"ps":["127.0.0.1:2001"],'
    '"worker":["127.0.0.1:2002","127.0.0.1:2003"]},"task":{"type":"worker","index":1}}'
)
CLUSTER = {
    "chief": ["127.0.0.1:2000"],
    "ps": ["127.0.0.1:2001"],
    "worker": ["127.0.0.1:2002", "127.0.0.1:2003"],
}


@pytest.fixture
def config() -> TFConfig:
    return TFConfig(ClusterSpec(CLUSTER), TaskId("worker", 1))


def test_to_json_is_exactly_tensorflows_format(config: TFConfig) -> None:
    assert config.to_json() == TF_EXAMPLE


def test_from_json_of_tensorflow_example(config: TFConfig) -> None:
    parsed = TFConfig.from_json(TF_EXAMPLE)
    assert parsed == config
    assert parsed.task == TaskId("worker", 1)
    assert parsed.cluster.as_dict() == CLUSTER
    assert parsed.environment is None
    assert parsed.rpc_layer is None


def test_from_json_accepts_whitespace_and_any_key_order() -> None:
    text = json.dumps({"task": {"index": 1, "type": "worker"}, "cluster": CLUSTER}, indent=2)
    parsed = TFConfig.from_json(text)
    assert parsed.to_json() == TF_EXAMPLE


def test_optional_keys_round_trip_in_stable_order() -> None:
    config = TFConfig(
        ClusterSpec({"worker": ["h:1"]}),
        TaskId("worker", 0),
        environment="cloud",
        rpc_layer="grpc",
    )
    text = config.to_json()
    assert text == (
        '{"cluster":{"worker":["h:1"]},"task":{"type":"worker","index":0},'
        '"environment":"cloud","rpc_layer":"grpc"}'
    )
    assert TFConfig.from_json(text) == config


def test_no_task_omits_the_key() -> None:
    config = TFConfig(ClusterSpec({"worker": ["h:1"]}))
    assert config.to_json() == '{"cluster":{"worker":["h:1"]}}'
    assert TFConfig.from_json(config.to_json()) == config
    assert TFConfig.from_json('{"cluster":{"worker":["h:1"]},"task":null}') == config


def test_sparse_cluster_round_trips() -> None:
    config = TFConfig(ClusterSpec({"worker": {1: "h:1", 3: "h:3"}}), TaskId("worker", 3))
    text = config.to_json()
    assert text == '{"cluster":{"worker":{"1":"h:1","3":"h:3"}},"task":{"type":"worker","index":3}}'
    assert TFConfig.from_json(text) == config


def test_unknown_keys_are_ignored_as_tensorflow_does() -> None:
    text = '{"cluster":{"worker":["h:1"]},"task":{"type":"worker","index":0,"trial":"7"},"x":1}'
    assert TFConfig.from_json(text) == TFConfig(
        ClusterSpec({"worker": ["h:1"]}), TaskId("worker", 0)
    )


def test_evaluator_may_sit_outside_the_cluster() -> None:
    # TensorFlow's side-car evaluator gets the training cluster and task type evaluator.
    text = '{"cluster":{"chief":["h:1"],"worker":["h:2"]},"task":{"type":"evaluator","index":0}}'
    config = TFConfig.from_json(text)
    assert config.task == TaskId("evaluator", 0)
    assert config.to_json() == text


def test_env_round_trip(config: TFConfig) -> None:
    env = config.to_env()
    assert env == {"TF_CONFIG": TF_EXAMPLE}
    assert TFConfig.from_env(env) == config


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  \n"}, {"X": "1"}])
def test_from_env_unset_or_empty_is_none(environ: dict[str, str]) -> None:
    assert TFConfig.from_env(environ) is None


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch, config: TFConfig) -> None:
    monkeypatch.setenv("TF_CONFIG", TF_EXAMPLE)
    assert TFConfig.from_env() == config
    monkeypatch.delenv("TF_CONFIG")
    assert TFConfig.from_env() is None


def test_from_env_invalid_raises() -> None:
    with pytest.raises(TFConfigError, match="not valid JSON"):
        TFConfig.from_env({"TF_CONFIG": "{"})


def test_malformed_json_gives_position_and_text() -> None:
    text = '{"cluster": {"worker": ["h:1"]},}'
    with pytest.raises(TFConfigError) as info:
        TFConfig.from_json(text)
    message = str(info.value)
    assert "line 1 column 33" in message
    assert "char 32" in message
    assert repr(text) in message


def test_long_malformed_json_is_shortened() -> None:
    text = "[" + "1," * 500
    with pytest.raises(TFConfigError) as info:
        TFConfig.from_json(text)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    ("text", "offending"),
    [
        ("[]", "[]"),
        ('"cluster"', "'\"cluster\"'"),
        ('{"task":{"type":"worker","index":0}}', "'worker' is not a job of the cluster"),
        ('{"cluster":["h:1"]}', "['h:1']"),
        ('{"cluster":null}', "None"),
        ('{"cluster":{"worker":["h:1"]},"task":[]}', "[]"),
        ('{"cluster":{"worker":["h:1"]},"task":"worker:0"}', "'worker:0'"),
        ('{"cluster":{"worker":["h:1"]},"task":{"index":0}}', "None"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":3,"index":0}}', "3"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"psx","index":0}}', "'psx'"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"bad-job","index":0}}', "'bad-job'"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"worker","index":1}}', "1"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"worker","index":-1}}', "-1"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"worker","index":"01"}}', "'01'"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"worker","index":"-1"}}', "'-1'"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"worker","index":true}}', "True"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"worker","index":0.0}}', "0.0"),
        ('{"cluster":{"worker":["h:1"]},"task":{"type":"worker"}}', "None"),
        ('{"cluster":{"worker":["h:1"]},"environment":5}', "5"),
        ('{"cluster":{"worker":["h:1"]},"rpc_layer":["grpc"]}', "['grpc']"),
        ('{"cluster":{"worker":["h:bad"]}}', "'h:bad'"),
        ('{"cluster":{"worker":["h:1","h:1"]}}', "'h:1'"),
        ('{"cluster":{"bad-job":["h:1"]}}', "'bad-job'"),
        ('{"cluster":{"chief":["h:1","h:2"]}}', "'chief'"),
    ],
)
def test_invalid_tf_config(text: str, offending: str) -> None:
    with pytest.raises(TFConfigError) as info:
        TFConfig.from_json(text)
    assert offending in str(info.value)
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value, ValueError)


def test_task_not_in_cluster_lists_what_exists() -> None:
    with pytest.raises(TFConfigError) as info:
        TFConfig.from_json(
            '{"cluster":{"chief":["h:1"],"worker":["h:2"]},"task":{"type":"ps","index":0}}'
        )
    assert str(info.value) == (
        "TF_CONFIG task type 'ps' is not a job of the cluster; it has jobs: chief, worker"
    )


def test_constructor_validates_task_against_cluster() -> None:
    with pytest.raises(TFConfigError, match="index 2"):
        TFConfig(ClusterSpec({"worker": ["h:1"]}), TaskId("worker", 2))


def test_from_json_rejects_non_string() -> None:
    with pytest.raises(TFConfigError, match="None"):
        TFConfig.from_json(None)  # type: ignore[arg-type]


def test_from_dict(config: TFConfig) -> None:
    assert TFConfig.from_dict(json.loads(TF_EXAMPLE)) == config
    assert TFConfig.from_dict(config.to_dict()) == config
