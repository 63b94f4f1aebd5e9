"""Behaviour of ClusterSpec, TaskId and the address helpers."""

from __future__ import annotations

from typing import Any

import pytest

from clusterflow.cluster import (
    JOB_ORDER,
    ClusterSpec,
    ClusterSpecError,
    TaskId,
    format_address,
    parse_address,
)
from clusterflow.errors import ConfigError

TF_EXAMPLE = {
    "chief": ["127.0.0.1:2000"],
    "ps": ["127.0.0.1:2001"],
    "worker": ["127.0.0.1:2002", "127.0.0.1:2003"],
}


@pytest.fixture
def spec() -> ClusterSpec:
    return ClusterSpec(TF_EXAMPLE)


# --- TaskId -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("worker:1", TaskId("worker", 1)),
        ("/job:worker/task:1", TaskId("worker", 1)),
        ("/job:ps/replica:0/task:3", TaskId("ps", 3)),
        ("my_job2:0", TaskId("my_job2", 0)),
    ],
)
def test_task_id_parse(text: str, expected: TaskId) -> None:
    assert TaskId.parse(text) == expected


def test_task_id_str_round_trips() -> None:
    task = TaskId("worker", 12)
    assert str(task) == "worker:12"
    assert TaskId.parse(str(task)) == task


@pytest.mark.parametrize(
    ("text", "offending"),
    [
        ("worker", "worker"),
        ("worker:", "worker:"),
        ("worker:x", "x"),
        ("worker:-1", "-1"),
        (":1", ":1"),
        ("1worker:0", "1worker"),
        ("/job:worker", "/job:worker"),
        ("/job:worker/task:", "/job:worker/task:"),
        ("worker:1:2", "worker:1:2"),
    ],
)
def test_task_id_parse_rejects(text: str, offending: str) -> None:
    with pytest.raises(ClusterSpecError, match="invalid task id") as info:
        TaskId.parse(text)
    assert repr(offending) in str(info.value)


@pytest.mark.parametrize(
    ("job", "index", "offending"),
    [("bad-job", 0, "'bad-job'"), ("", 0, "''"), ("w", -1, "-1"), ("w", True, "True")],
)
def test_task_id_validates(job: str, index: int, offending: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        TaskId(job, index)
    assert offending in str(info.value)


def test_task_id_is_frozen_and_hashable() -> None:
    task = TaskId("ps", 0)
    with pytest.raises(AttributeError):
        task.index = 1  # type: ignore[misc]
    assert {task, TaskId("ps", 0)} == {task}


def test_task_id_sorts_in_canonical_job_order() -> None:
    tasks = [
        TaskId("aux", 0),
        TaskId("evaluator", 0),
        TaskId("worker", 10),
        TaskId("worker", 2),
        TaskId("ps", 1),
        TaskId("chief", 0),
        TaskId("ps", 0),
        TaskId("alpha", 1),
    ]
    assert [str(t) for t in sorted(tasks)] == [
        "chief:0",
        "ps:0",
        "ps:1",
        "worker:2",
        "worker:10",
        "evaluator:0",
        "alpha:1",
        "aux:0",
    ]
    assert TaskId("chief", 0) < TaskId("worker", 0) <= TaskId("worker", 0)
    assert JOB_ORDER == ("chief", "ps", "worker", "evaluator")


# --- addresses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:2222", ("127.0.0.1", 2222)),
        ("localhost:1", ("localhost", 1)),
        ("worker-0.svc.cluster.local:65535", ("worker-0.svc.cluster.local", 65535)),
        ("[::1]:2222", ("::1", 2222)),
        ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
    ],
)
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    "address",
    [
        "localhost",
        "localhost:",
        "localhost:abc",
        "localhost:0",
        "localhost:70000",
        "localhost:-1",
        "localhost:+1",
        "localhost: 1",
        "localhost:1_000",
        ":2222",
        "::1:2222",
        "[::1]",
        "[::1]2222",
        "[not-ipv6]:2222",
        "[]:2222",
        "host name:2222",
        "host/x:2222",
        "",
    ],
)
def test_parse_address_rejects(address: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        parse_address(address)
    assert repr(address) in str(info.value)


def test_parse_address_rejects_non_string() -> None:
    with pytest.raises(ClusterSpecError, match="2222"):
        parse_address(2222)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("127.0.0.1", 2222, "127.0.0.1:2222"),
        ("::1", 2222, "[::1]:2222"),
        ("[::1]", 2222, "[::1]:2222"),
        ("example.com", 1, "example.com:1"),
    ],
)
def test_format_address_round_trips(host: str, port: int, expected: str) -> None:
    address = format_address(host, port)
    assert address == expected
    assert format_address(*parse_address(address)) == address


@pytest.mark.parametrize(
    ("host", "port", "offending"),
    [("h", 0, "0"), ("h", 65536, "65536"), ("", 1, "':1'"), ("h", True, "True")],
)
def test_format_address_rejects(host: str, port: int, offending: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        format_address(host, port)
    assert offending in str(info.value)


# --- ClusterSpec: reading -----------------------------------------------------------


def test_tf_methods(spec: ClusterSpec) -> None:
    assert spec.jobs == ["chief", "ps", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "127.0.0.1:2003"
    assert spec.job_tasks("worker") == ["127.0.0.1:2002", "127.0.0.1:2003"]
    assert spec.as_dict() == TF_EXAMPLE


def test_jobs_are_sorted_whatever_the_input_order() -> None:
    spec = ClusterSpec({"worker": ["h:2"], "chief": ["h:1"], "aux": ["h:3"]})
    assert spec.jobs == ["aux", "chief", "worker"]
    assert list(spec.as_dict()) == ["aux", "chief", "worker"]


def test_tuple_job_is_dense() -> None:
    spec = ClusterSpec({"worker": ("h:1", "h:2")})
    assert spec.as_dict() == {"worker": ["h:1", "h:2"]}


def test_sparse_job() -> None:
    spec = ClusterSpec({"worker": {3: "h:3", 1: "h:1"}, "ps": ["h:10"]})
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [1, 3]
    assert spec.task_address("worker", 3) == "h:3"
    assert spec.job_tasks("worker") == [None, "h:1", None, "h:3"]
    assert spec.as_dict() == {"ps": ["h:10"], "worker": {1: "h:1", 3: "h:3"}}
    assert ClusterSpec(spec.as_dict()) == spec


def test_dict_job_with_dense_indices_is_a_list_in_as_dict() -> None:
    spec = ClusterSpec({"worker": {1: "h:2", 0: "h:1"}})
    assert spec.as_dict() == {"worker": ["h:1", "h:2"]}
    assert spec == ClusterSpec({"worker": ["h:1", "h:2"]})


def test_sparse_job_with_json_string_keys() -> None:
    spec = ClusterSpec({"worker": {"1": "h:1", "4": "h:4"}})
    assert spec.task_indices("worker") == [1, 4]
    assert spec == ClusterSpec({"worker": {1: "h:1", 4: "h:4"}})


def test_unknown_job_names_it_and_lists_jobs(spec: ClusterSpec) -> None:
    for call in (
        lambda: spec.num_tasks("psx"),
        lambda: spec.task_indices("psx"),
        lambda: spec.task_address("psx", 0),
        lambda: spec.job_tasks("psx"),
    ):
        with pytest.raises(ClusterSpecError) as info:
            call()
        assert str(info.value) == "unknown job 'psx'; the cluster has jobs: chief, ps, worker"


def test_unknown_job_is_a_value_error(spec: ClusterSpec) -> None:
    # Code written against tf.train.ClusterSpec catches ValueError.
    with pytest.raises(ValueError, match="psx"):
        spec.num_tasks("psx")
    assert issubclass(ClusterSpecError, ConfigError)


@pytest.mark.parametrize("index", [2, -1, 7, True])
def test_unknown_index_names_it_and_lists_tasks(spec: ClusterSpec, index: int) -> None:
    with pytest.raises(ClusterSpecError) as info:
        spec.task_address("worker", index)
    message = str(info.value)
    assert repr(index) in message
    assert "'worker'" in message
    assert "0, 1" in message


def test_empty_spec() -> None:
    spec = ClusterSpec({})
    assert not spec
    assert spec.jobs == []
    assert list(spec.tasks()) == []
    assert spec.chief is None
    with pytest.raises(ClusterSpecError, match=r"unknown job 'worker'.*\(none\)"):
        spec.num_tasks("worker")


def test_bool(spec: ClusterSpec) -> None:
    assert spec


def test_tasks_in_canonical_order() -> None:
    spec = ClusterSpec(
        {
            "zeta": ["h:1"],
            "worker": {2: "h:2", 0: "h:3"},
            "evaluator": ["h:4"],
            "ps": ["h:5", "h:6"],
            "chief": ["h:7"],
            "alpha": ["h:8"],
        }
    )
    assert [str(t) for t in spec.tasks()] == [
        "chief:0",
        "ps:0",
        "ps:1",
        "worker:0",
        "worker:2",
        "evaluator:0",
        "alpha:0",
        "zeta:0",
    ]
    assert list(spec.tasks()) == sorted(spec.tasks())


def test_contains(spec: ClusterSpec) -> None:
    assert TaskId("worker", 1) in spec
    assert TaskId("worker", 2) not in spec
    assert TaskId("evaluator", 0) not in spec
    assert "worker:1" not in spec


# --- chief ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "chief"),
    [
        (TF_EXAMPLE, TaskId("chief", 0)),
        ({"worker": ["h:1", "h:2"], "ps": ["h:3"]}, TaskId("worker", 0)),
        ({"ps": ["h:3"]}, None),
        ({"worker": {1: "h:1"}}, None),
        ({"evaluator": ["h:1"]}, None),
    ],
)
def test_chief_resolution(cluster: dict[str, Any], chief: TaskId | None) -> None:
    spec = ClusterSpec(cluster)
    assert spec.chief == chief
    for task in spec.tasks():
        assert spec.is_chief(task) == (task == chief)


def test_worker_zero_is_not_chief_when_a_chief_job_exists(spec: ClusterSpec) -> None:
    assert not spec.is_chief(TaskId("worker", 0))
    assert spec.is_chief(TaskId("chief", 0))


# --- ClusterSpec: validation --------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "offending"),
    [
        ({"bad-name": ["h:1"]}, "'bad-name'"),
        ({"1worker": ["h:1"]}, "'1worker'"),
        ({"": ["h:1"]}, "''"),
        ({3: ["h:1"]}, "3"),
        ({"worker": "h:1"}, "'h:1'"),
        ({"worker": None}, "None"),
        ({"worker": ["h:abc"]}, "'h:abc'"),
        ({"worker": ["h:70000"]}, "'h:70000'"),
        ({"worker": ["h:-1"]}, "'h:-1'"),
        ({"worker": ["h:0"]}, "'h:0'"),
        ({"worker": ["h"]}, "'h'"),
        ({"worker": [":1"]}, "':1'"),
        ({"worker": [None]}, "None"),
        ({"worker": {-1: "h:1"}}, "-1"),
        ({"worker": {"x": "h:1"}}, "'x'"),
        ({"worker": {"01": "h:1"}}, "'01'"),
        ({"worker": {1.0: "h:1"}}, "1.0"),
        ({"worker": {True: "h:1"}}, "True"),
        ({"worker": {1: "h:1", "1": "h:2"}}, "index 1"),
        ({"chief": ["h:1", "h:2"]}, "'chief'"),
        ({"chief": {1: "h:1"}}, "'chief'"),
        ({"evaluator": ["h:1", "h:2"]}, "'evaluator'"),
    ],
)
def test_invalid_spec(cluster: Any, offending: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec(cluster)
    assert offending in str(info.value)


def test_bad_address_names_the_task() -> None:
    with pytest.raises(ClusterSpecError, match=r"task worker:1: .*'h:abc'"):
        ClusterSpec({"worker": ["h:1", "h:abc"]})


@pytest.mark.parametrize(
    "cluster",
    [
        {"worker": ["h:1", "h:1"]},
        {"worker": ["h:1"], "ps": ["h:1"]},
        {"worker": ["HOST:1"], "ps": ["host:1"]},
        {"worker": ["[::1]:1"], "ps": ["[0:0::1]:1"]},
    ],
)
def test_duplicate_address_names_address_and_both_tasks(cluster: dict[str, list[str]]) -> None:
    with pytest.raises(ClusterSpecError, match="also used by") as info:
        ClusterSpec(cluster)
    message = str(info.value)
    tasks = [str(TaskId(job, i)) for job, addrs in cluster.items() for i in range(len(addrs))]
    assert all(task in message for task in tasks)
    assert any(repr(address) in message for addrs in cluster.values() for address in addrs)


def test_not_a_mapping() -> None:
    with pytest.raises(ClusterSpecError, match=r"\['h:1'\]"):
        ClusterSpec(["h:1"])  # type: ignore[arg-type]


# --- ClusterSpec: value semantics ---------------------------------------------------


def test_equality_and_hash(spec: ClusterSpec) -> None:
    same = ClusterSpec(dict(reversed(TF_EXAMPLE.items())))
    assert spec == same
    assert hash(spec) == hash(same)
    assert spec != ClusterSpec({"worker": ["127.0.0.1:2002"]})
    assert spec != TF_EXAMPLE
    assert len({spec, same, ClusterSpec(spec)}) == 1


def test_copy_from_spec(spec: ClusterSpec) -> None:
    copy = ClusterSpec(spec)
    assert copy == spec
    assert copy.as_dict() == spec.as_dict()


def test_as_dict_is_a_copy(spec: ClusterSpec) -> None:
    data = spec.as_dict()
    worker = data["worker"]
    assert isinstance(worker, list)
    worker.append("h:9")
    assert spec.num_tasks("worker") == 2


def test_input_mutation_does_not_leak() -> None:
    source = {"worker": ["h:1"]}
    spec = ClusterSpec(source)
    source["worker"].append("h:2")
    assert spec.num_tasks("worker") == 1


def test_repr_round_trips(spec: ClusterSpec) -> None:
    assert repr(spec) == (
        "ClusterSpec({'chief': ['127.0.0.1:2000'], 'ps': ['127.0.0.1:2001'], "
        "'worker': ['127.0.0.1:2002', '127.0.0.1:2003']})"
    )
    assert eval(repr(spec), {"ClusterSpec": ClusterSpec}) == spec


def test_with_address_returns_a_new_spec(spec: ClusterSpec) -> None:
    moved = spec.with_address(TaskId("worker", 1), "127.0.0.1:3003")
    assert moved.task_address("worker", 1) == "127.0.0.1:3003"
    assert spec.task_address("worker", 1) == "127.0.0.1:2003"
    assert moved != spec
    assert spec.with_address(TaskId("worker", 1), "127.0.0.1:2003") == spec


def test_with_address_keeps_sparse_jobs_sparse() -> None:
    spec = ClusterSpec({"worker": {2: "h:2"}})
    assert spec.with_address(TaskId("worker", 2), "h:5").as_dict() == {"worker": {2: "h:5"}}


@pytest.mark.parametrize(
    ("task", "address", "offending"),
    [
        (TaskId("worker", 5), "h:1", "5"),
        (TaskId("psx", 0), "h:1", "'psx'"),
        (TaskId("worker", 1), "h:bad", "'h:bad'"),
        (TaskId("worker", 1), "127.0.0.1:2000", "'127.0.0.1:2000'"),
    ],
)
def test_with_address_rejects(
    spec: ClusterSpec, task: TaskId, address: str, offending: str
) -> None:
    with pytest.raises(ClusterSpecError) as info:
        spec.with_address(task, address)
    assert offending in str(info.value)
