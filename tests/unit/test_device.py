"""Behaviour of DeviceSpec: TensorFlow device strings in, canonical strings out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import clusterflow.cluster
from clusterflow.cluster import DeviceSpec, DeviceSpecError, TaskId
from clusterflow.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected", "canonical"),
    [
        (
            "/job:ps/task:1/device:cpu:0",
            DeviceSpec(job="ps", task=1, device_type="cpu", device_index=0),
            "/job:ps/task:1/device:CPU:0",
        ),
        (
            "/job:ps/replica:0/task:1/device:GPU:0",
            DeviceSpec(job="ps", replica=0, task=1, device_type="gpu", device_index=0),
            "/job:ps/replica:0/task:1/device:GPU:0",
        ),
        ("/job:worker", DeviceSpec(job="worker"), "/job:worker"),
        ("/device:CPU:0", DeviceSpec(device_type="cpu", device_index=0), "/device:CPU:0"),
        ("/cpu:0", DeviceSpec(device_type="cpu", device_index=0), "/device:CPU:0"),
        ("/gpu:1", DeviceSpec(device_type="gpu", device_index=1), "/device:GPU:1"),
        ("/GPU:1", DeviceSpec(device_type="gpu", device_index=1), "/device:GPU:1"),
        ("/cpu", DeviceSpec(device_type="cpu"), "/device:CPU:*"),
        ("/device:GPU:*", DeviceSpec(device_type="gpu"), "/device:GPU:*"),
        ("/gpu:*", DeviceSpec(device_type="gpu"), "/device:GPU:*"),
        ("/device:cuda:2", DeviceSpec(device_type="gpu", device_index=2), "/device:GPU:2"),
        ("/task:1/job:ps", DeviceSpec(job="ps", task=1), "/job:ps/task:1"),
        (
            "/job:worker/task:3/gpu:0",
            DeviceSpec(job="worker", task=3, device_type="gpu", device_index=0),
            "/job:worker/task:3/device:GPU:0",
        ),
        ("/replica:2", DeviceSpec(replica=2), "/replica:2"),
        ("", DeviceSpec(), ""),
    ],
)
def test_parse_and_canonical_form(text: str, expected: DeviceSpec, canonical: str) -> None:
    spec = DeviceSpec.parse(text)
    assert spec == expected
    assert spec.to_string() == canonical
    assert str(spec) == canonical
    assert DeviceSpec.parse(canonical) == spec


@pytest.mark.parametrize(
    "text",
    [
        "/job:",
        "/task:x",
        "/task:-1",
        "/task:",
        "/replica:y",
        "/foo:1",
        "job:ps",
        "cpu:0",
        "/job:a/job:b",
        "/task:1/task:1",
        "/cpu:0/device:GPU:0",
        "/gpu:0/cpu:0",
        "/device:GPU",
        "/device:GPU:0:1",
        "/device:tpu:0",
        "/device::0",
        "/device:GPU:x",
        "/gpu:",
        "/cpu:0:1",
        "/job:1ps",
        "/job:bad-name",
        "/job:ps:1",
        "/job:ps/",
        "//job:ps",
        "/",
        "/task:*",
    ],
)
def test_parse_rejects_and_names_the_string(text: str) -> None:
    with pytest.raises(DeviceSpecError) as info:
        DeviceSpec.parse(text)
    assert repr(text) in str(info.value)


def test_parse_rejects_non_string() -> None:
    with pytest.raises(DeviceSpecError, match="42"):
        DeviceSpec.parse(42)  # type: ignore[arg-type]


def test_error_is_config_and_value_error() -> None:
    with pytest.raises(ConfigError):
        DeviceSpec.parse("/foo:1")
    with pytest.raises(ValueError, match="foo"):
        DeviceSpec.parse("/foo:1")


@pytest.mark.parametrize(
    ("kwargs", "offending"),
    [
        ({"job": "bad-name"}, "'bad-name'"),
        ({"task": -1}, "-1"),
        ({"replica": True}, "True"),
        ({"device_index": 0}, "0"),
        ({"device_type": "tpu"}, "'tpu'"),
        ({"device_type": "gpu", "device_index": 1.5}, "1.5"),
    ],
)
def test_constructor_validates(kwargs: dict[str, object], offending: str) -> None:
    with pytest.raises(DeviceSpecError) as info:
        DeviceSpec(**kwargs)  # type: ignore[arg-type]
    assert offending in str(info.value)


@pytest.mark.parametrize(("given", "stored"), [("CPU", "cpu"), ("GPU", "gpu"), ("cuda", "gpu")])
def test_device_type_is_normalised(given: str, stored: str) -> None:
    spec = DeviceSpec(device_type=given, device_index=0)
    assert spec.device_type == stored
    assert spec == DeviceSpec(device_type=stored, device_index=0)


def test_is_frozen() -> None:
    spec = DeviceSpec(job="ps")
    with pytest.raises(AttributeError):
        spec.job = "worker"  # type: ignore[misc]
    assert hash(spec) == hash(DeviceSpec.parse("/job:ps"))


def test_merge_other_takes_precedence_field_by_field() -> None:
    outer = DeviceSpec.parse("/job:ps/task:0/device:CPU:0")
    inner = DeviceSpec.parse("/task:1/device:GPU:*")
    assert outer.merge(inner) == DeviceSpec(job="ps", task=1, device_type="gpu", device_index=0)
    assert inner.merge(outer) == DeviceSpec(job="ps", task=0, device_type="cpu", device_index=0)


def test_merge_with_empty_is_identity() -> None:
    spec = DeviceSpec.parse("/job:worker/replica:0/task:2/gpu:1")
    assert spec.merge(DeviceSpec()) == spec
    assert DeviceSpec().merge(spec) == spec


@pytest.mark.parametrize(
    ("text", "task"),
    [
        ("/job:ps/task:1/device:CPU:0", TaskId("ps", 1)),
        ("/job:worker/replica:0/task:0", TaskId("worker", 0)),
        ("/job:worker", None),
        ("/task:1", None),
        ("/cpu:0", None),
    ],
)
def test_task_id(text: str, task: TaskId | None) -> None:
    assert DeviceSpec.parse(text).task_id == task


@pytest.mark.parametrize(
    ("text", "device"),
    [
        ("/cpu:0", "cpu"),
        ("/job:ps/task:0/device:CPU:3", "cpu"),
        ("/gpu:1", "cuda:1"),
        ("/device:GPU:0", "cuda:0"),
        ("/device:GPU:*", "cuda"),
    ],
)
def test_torch_device(text: str, device: str) -> None:
    assert DeviceSpec.parse(text).torch_device() == device


def test_torch_device_needs_a_device_type() -> None:
    with pytest.raises(DeviceSpecError, match="'/job:ps/task:0'"):
        DeviceSpec.parse("/job:ps/task:0").torch_device()


def test_cluster_package_does_not_import_torch() -> None:
    # Importing the cluster model must stay cheap: a launcher parses specs before any
    # training framework is loaded (and a TensorFlow task never loads torch at all).
    code = "import sys, clusterflow.cluster; print('torch' in sys.modules)"
    src = Path(clusterflow.cluster.__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert result.stdout.strip() == "False"
