"""TensorFlow's own answers, asked of clusterflow.

The cases of TensorFlow's ``ClusterSpecTest`` (tensorflow/python/training/server_lib_test.py)
and ``TFConfigClusterResolverTest``
(tensorflow/python/distribute/cluster_resolver/tfconfig_cluster_resolver_test.py), and the
behaviour of ``SimpleClusterResolver`` and ``tf.DeviceSpec``, written in our words: a user
moving from TensorFlow must meet the same answers. Where clusterflow deliberately answers
otherwise, the test says so and docs/tensorflow-mapping.md says why.
"""

from __future__ import annotations

import json

import pytest

from clusterflow.cluster import (
    ClusterSpec,
    ClusterSpecError,
    DeviceSpec,
    TaskId,
    TFConfig,
    TFConfigError,
)
from clusterflow.errors import ConfigError
from clusterflow.strategies import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)

PS_WORKER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}


def tf_config(**doc: object) -> dict[str, str]:
    """An environment whose TF_CONFIG is ``doc``, spread over lines as people write it."""
    return {"TF_CONFIG": json.dumps(doc, indent=2)}


# --- ClusterSpec -------------------------------------------------------------------------


def test_dict_spec_and_as_dict_are_equivalent() -> None:
    spec = ClusterSpec(PS_WORKER)
    assert spec.as_dict() == PS_WORKER
    assert ClusterSpec(spec) == spec
    assert ClusterSpec(spec.as_dict()) == spec


def test_accessors_of_dense_and_sparse_jobs() -> None:
    original = {**PS_WORKER, "sparse": {0: "sparse0:2222", 3: "sparse3:2222"}}
    spec = ClusterSpec(original)
    assert spec.as_dict() == original
    assert [spec.num_tasks(j) for j in ("ps", "worker", "sparse")] == [2, 3, 2]
    assert spec.task_address("ps", 0) == "ps0:2222"
    assert spec.task_address("sparse", 0) == "sparse0:2222"
    assert spec.task_indices("ps") == [0, 1]
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.task_indices("sparse") == [0, 3]
    assert spec.job_tasks("ps") == ["ps0:2222", "ps1:2222"]
    assert spec.job_tasks("worker") == ["worker0:2222", "worker1:2222", "worker2:2222"]
    assert spec.job_tasks("sparse") == ["sparse0:2222", None, None, "sparse3:2222"]
    # Every accessor refuses an unknown job, and task_address a hole, with a ValueError.
    for call in (
        lambda: spec.num_tasks("unknown"),
        lambda: spec.task_address("unknown", 0),
        lambda: spec.task_address("sparse", 2),
        lambda: spec.task_indices("unknown"),
        lambda: spec.job_tasks("unknown"),
    ):
        with pytest.raises(ValueError, match=r"unknown|2"):
            call()


def test_empty_spec_is_false_and_a_non_empty_one_true() -> None:
    assert not ClusterSpec({})
    assert ClusterSpec({"job": ["host:2222"]})


def test_equality_follows_content_not_spelling() -> None:
    assert ClusterSpec({}) == ClusterSpec({})
    assert ClusterSpec({"job": ["host:2222"]}) == ClusterSpec({"job": ["host:2222"]})
    assert ClusterSpec({"job": {0: "host:2222"}}) == ClusterSpec({"job": ["host:2222"]})
    assert ClusterSpec({}) != ClusterSpec({"job": ["host:2223"]})
    assert ClusterSpec({"job1": ["host:2222"]}) != ClusterSpec({"job2": ["host:2222"]})
    assert ClusterSpec({"job": ["host:2222"]}) != ClusterSpec({"job": ["host:2223"]})
    two = ClusterSpec({"job": ["host:2222", "host:2223"]})
    assert two != ClusterSpec({"job": ["host:2223", "host:2222"]})


@pytest.mark.parametrize("empty", [[], {}])
def test_a_job_with_zero_tasks_is_accepted(empty: list[str] | dict[int, str]) -> None:
    # A real TF_CONFIG may list a job before any of its tasks exist.
    spec = ClusterSpec({"ps": ["ps0:2222", "ps1:2222"], "worker": empty})
    assert spec.jobs == ["ps", "worker"]
    assert spec.num_tasks("worker") == 0
    assert spec.task_indices("worker") == []
    assert spec.job_tasks("worker") == []
    assert spec.as_dict() == {"ps": ["ps0:2222", "ps1:2222"], "worker": []}
    assert ClusterSpec(spec.as_dict()) == spec
    assert [str(t) for t in spec.tasks()] == ["ps:0", "ps:1"]
    assert spec.chief is None  # no worker 0 to coordinate
    with pytest.raises(ClusterSpecError, match="no task 0 in job 'worker'"):
        spec.task_address("worker", 0)
    config = TFConfig(spec)
    assert TFConfig.from_json(config.to_json()) == config
    assert json.loads(config.to_json())["cluster"]["worker"] == []


def test_an_empty_chief_job_is_accepted_but_two_chiefs_are_not() -> None:
    assert ClusterSpec({"chief": [], "worker": ["w:1"]}).chief == TaskId("worker", 0)
    with pytest.raises(ClusterSpecError, match="'chief'"):
        ClusterSpec({"chief": ["c:1", "c:2"]})


def test_addresses_are_validated_where_tensorflow_takes_any_string() -> None:
    # Deliberate difference (docs/tensorflow-mapping.md): TensorFlow accepts "host:port"
    # literally and fails later, at connect time; clusterflow refuses it when built.
    with pytest.raises(ClusterSpecError, match="'host:port'"):
        ClusterSpec({"job": ["host:port"]})


# --- TFConfigClusterResolver -----------------------------------------------------------


def test_cluster_spec_is_a_method_that_reads_tf_config() -> None:
    resolver = TFConfigClusterResolver(
        environ=tf_config(cluster=PS_WORKER, task={"type": "ps", "index": 0})
    )
    spec = resolver.cluster_spec()
    assert isinstance(spec, ClusterSpec)
    assert spec.as_dict() == PS_WORKER
    assert ClusterSpec(spec.as_dict()) == spec


def test_master_is_this_tasks_address() -> None:
    resolver = TFConfigClusterResolver(
        environ=tf_config(cluster=PS_WORKER, task={"type": "ps", "index": 0})
    )
    assert resolver.master() == "ps0:2222"
    assert resolver.master("worker", 1) == "worker1:2222"
    assert resolver.master("worker", 2, rpc_layer="grpc") == "grpc://worker2:2222"


def test_session_master_wins() -> None:
    env = tf_config(
        cluster=PS_WORKER, session_master="sessionmaster:2222", task={"type": "ps", "index": 0}
    )
    assert TFConfigClusterResolver(environ=env).master() == "sessionmaster:2222"


def test_rpc_layer_prefixes_master() -> None:
    env = tf_config(cluster=PS_WORKER, rpc_layer="grpc", task={"type": "ps", "index": 0})
    resolver = TFConfigClusterResolver(environ=env)
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, "grpc")


def test_arguments_override_tf_config_and_attributes_are_settable() -> None:
    env = tf_config(cluster=PS_WORKER, rpc_layer="grpc", task={"type": "ps", "index": 1})
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0, environ=env)
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)

    resolver.task_type = "worker"
    resolver.task_id = 1
    resolver.rpc_layer = "test"
    assert resolver.master() == "test://worker1:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "test")
    assert resolver.task == TaskId("worker", 1)
    assert not resolver.is_chief  # worker 1 is not worker 0


def test_task_id_override_alone() -> None:
    env = tf_config(
        cluster={"worker": ["worker0:2222", "worker1:2222"]}, task={"type": "worker", "index": "0"}
    )
    assert TFConfigClusterResolver(task_id=1, environ=env).task_id == 1


def test_a_string_task_index_is_cast_to_an_integer() -> None:
    env = tf_config(cluster=PS_WORKER, rpc_layer="grpc", task={"type": "ps", "index": "1"})
    resolver = TFConfigClusterResolver(environ=env)
    assert resolver.task_id == 1
    assert resolver.task == TaskId("ps", 1)
    resolver.task_id = "2"  # type: ignore[assignment]  # TensorFlow casts here too
    assert resolver.task_id == 2


@pytest.mark.parametrize("bad", ["01", "-1", "one", 1.0, True])
def test_a_task_index_that_is_no_integer_is_refused(bad: object) -> None:
    env = tf_config(cluster=PS_WORKER, task={"type": "ps", "index": bad})
    with pytest.raises(TFConfigError, match="index"):
        TFConfigClusterResolver(environ=env)


def test_a_numeric_task_type_is_refused() -> None:
    # Deliberate difference: TensorFlow casts {"type": 123456} to "123456"; such a job
    # name cannot appear in a device string (/job:123456), so clusterflow refuses it.
    env = tf_config(cluster={"123456": ["ps0:2222"]}, task={"type": 123456, "index": 0})
    with pytest.raises(TFConfigError, match="123456"):
        TFConfigClusterResolver(environ=env)


@pytest.mark.parametrize("environ", [{"TF_CONFIG": "{}"}, {"TF_CONFIG": "\n {}\n"}, {}])
def test_empty_or_unset_tf_config_is_an_empty_cluster_without_a_task(
    environ: dict[str, str],
) -> None:
    resolver = TFConfigClusterResolver(environ=environ)
    assert resolver.cluster_spec() == ClusterSpec({})
    assert resolver.task_type is None and resolver.task_id is None and resolver.task is None
    assert resolver.master() == ""
    assert resolver.num_workers() == 0
    assert TFConfig.from_json("{}") == TFConfig(ClusterSpec({}))


def test_one_task_cluster_has_no_master() -> None:
    env = tf_config(cluster={"worker": ["worker0:2222"]})
    assert TFConfigClusterResolver(environ=env).master() == ""


def test_master_without_any_task_says_what_is_missing() -> None:
    resolver = TFConfigClusterResolver(environ=tf_config(cluster=PS_WORKER))
    with pytest.raises(ConfigError, match="task_type and task_id"):
        resolver.master()


def test_tf_config_is_read_once_when_the_resolver_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Deliberate difference: TensorFlow re-reads the variable at every call.
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": PS_WORKER}))
    resolver = TFConfigClusterResolver()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["other:1"]}}))
    assert resolver.cluster_spec().as_dict() == PS_WORKER


def test_invalid_tf_config_fails_when_the_resolver_is_built() -> None:
    with pytest.raises(TFConfigError, match="not valid JSON"):
        TFConfigClusterResolver(environ={"TF_CONFIG": "{cluster"})


# --- SimpleClusterResolver ---------------------------------------------------------------


def test_simple_resolver_takes_tensorflows_arguments_in_tensorflows_order() -> None:
    resolver = SimpleClusterResolver(
        ClusterSpec(PS_WORKER), "grpc://master:2222", "worker", 1, rpc_layer=None
    )
    assert isinstance(resolver, ClusterResolver)
    assert resolver.cluster_spec() == ClusterSpec(PS_WORKER)
    assert resolver.master() == "grpc://master:2222"
    assert resolver.master("ps", 1) == "ps1:2222"
    assert resolver.master("ps", 1, rpc_layer="grpc") == "grpc://ps1:2222"
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "ps", 0, "grpc"
    assert resolver.task == TaskId("ps", 0)
    assert resolver.master("worker", 0) == "grpc://worker0:2222"


def test_simple_resolver_without_a_task_has_an_empty_master() -> None:
    resolver = SimpleClusterResolver(PS_WORKER)
    assert resolver.master() == ""
    assert resolver.task is None and resolver.is_chief  # one process outside any cluster
    assert resolver.num_workers() == 3


def test_simple_resolver_refuses_the_old_positional_order() -> None:
    # (spec, "worker", 0) reads as master="worker", task_type=0: refused, not misread.
    with pytest.raises(ConfigError, match="task_type must be a job name, got 0"):
        SimpleClusterResolver(PS_WORKER, "worker", 0)  # type: ignore[arg-type]


def test_simple_resolver_refuses_a_task_outside_the_cluster() -> None:
    with pytest.raises(ClusterSpecError, match="no task 5 in job 'worker'"):
        SimpleClusterResolver(PS_WORKER, task_type="worker", task_id=5)


# --- device strings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "tensorflows"),
    [
        ("/job:ps/task:1/device:CPU:0", "/job:ps/task:1/device:CPU:0"),
        ("/job:worker/replica:0/task:2/device:GPU:1", "/job:worker/replica:0/task:2/device:GPU:1"),
        ("/cpu:0", "/device:CPU:0"),
        ("/device:gpu:3", "/device:GPU:3"),
        ("/job:ps", "/job:ps"),
        ("/device:GPU:*", "/device:GPU:*"),
        ("/task:1/job:ps", "/job:ps/task:1"),
        ("", ""),
    ],
)
def test_device_strings_read_and_write_as_tensorflows(text: str, tensorflows: str) -> None:
    assert DeviceSpec.from_string(text).to_string() == tensorflows


def test_merged_device_spec_takes_the_other_sides_set_fields() -> None:
    outer = DeviceSpec.from_string("/job:ps/task:0/device:CPU:0")
    inner = DeviceSpec.from_string("/task:1")
    assert outer.make_merged_spec(inner).to_string() == "/job:ps/task:1/device:CPU:0"


def test_device_strings_name_the_task_of_the_cluster_spec() -> None:
    spec = ClusterSpec(PS_WORKER)
    device = DeviceSpec.from_string("/job:worker/replica:0/task:2/device:CPU:0")
    assert device.task_id == TaskId("worker", 2) == TaskId.parse("/job:worker/task:2")
    assert device.task_id in spec
    assert spec.task_address(device.task_id.job, device.task_id.index) == "worker2:2222"
