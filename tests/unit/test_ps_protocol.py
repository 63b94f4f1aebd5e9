"""The ``ps.*`` contract (ps/protocol.py): one set of types, one handler, both connections."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from clusterflow.cluster import ClusterSpec
from clusterflow.ps.api import MalformedRequest, PSConfig, PSError
from clusterflow.ps.client import PSConnection
from clusterflow.ps.handler import PSHandler
from clusterflow.ps.local import LocalPS
from clusterflow.ps.membership import LeaveRequest, MembersRequest
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.protocol import (
    METHODS,
    ApplyRequest,
    CreateRequest,
    OptimizerRequest,
    PSState,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
    QuiesceRequest,
    WaitVersionRequest,
)
from clusterflow.ps.rows_protocol import RowsPullRequest, RowsPushReply, RowsPushRequest
from clusterflow.ps.service import PSService
from clusterflow.ps.store import VariableStore
from clusterflow.rpc import Credentials, RemoteError
from clusterflow.server import create_local_server


def _setup(connection: PSConnection, **config: Any) -> None:
    create = CreateRequest(
        config=PSConfig(num_replicas=2, **config),
        variables=[{"name": "w", "shape": [2], "dtype": "float32"}],
        values={"w": torch.zeros(2)},
    )
    connection.call(0, create.METHOD, *create.to_wire())
    optimizer = OptimizerRequest(
        spec=OptimizerSpec.from_dict({"name": "SGD", "groups": [{"lr": 1.0}]}), group_of={"w": 0}
    )
    connection.call(0, optimizer.METHOD, *optimizer.to_wire())


REQUESTS = [
    CreateRequest(
        config=PSConfig(mode="sync", num_replicas=3),
        variables=[{"name": "w", "shape": [2], "dtype": "float32", "trainable": True}],
        values={"w": torch.ones(2)},
    ),
    OptimizerRequest(spec=OptimizerSpec.from_dict({"name": "SGD", "groups": []}), group_of={}),
    PullRequest(names=["w"], min_version=3, timeout=1.5, dtype="bfloat16"),
    PullRequest(),
    PushRequest(
        worker="worker:1",
        version=4,
        grads={"w": torch.ones(2)},
        buffers={"bn": torch.zeros(1)},
        keys=(("records", 1, 7), ("records", 1, 8)),
        hyper=[{"lr": 0.1}],
        commit=True,
        want_values=True,
        values_dtype="float32",
        timeout=2.0,
    ),
    ApplyRequest(version=2, workers=["worker:0", "chief:0"]),
    WaitVersionRequest(version=9, timeout=0.5),
    QuiesceRequest(timeout=3.0),
    LeaveRequest(worker="worker:2"),
    MembersRequest(workers=("chief:0", "worker:0", "worker:3"), version=7, previous=("w",)),
    MembersRequest(workers=("worker:0",)),
    PSState(meta={"version": 1, "trainable": {"w": True}}, tensors={"var/w": torch.ones(1)}),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_every_request_travels_and_comes_back_equal(request_: Any) -> None:
    back = type(request_).from_wire(*request_.to_wire())
    for name in request_.__dataclass_fields__:
        mine, theirs = getattr(request_, name), getattr(back, name)
        if isinstance(mine, dict) and mine and isinstance(next(iter(mine.values())), torch.Tensor):
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        else:
            assert mine == theirs, name


def test_replies_travel_and_come_back_equal() -> None:
    push = PushReply(applied=False, version=3, reason="stale", staleness=2, values={})
    assert PushReply.from_wire(*push.to_wire()) == push
    dup = PushReply(applied=False, version=3, reason="duplicate", duplicates=(("d", 0, 4),))
    assert PushReply.from_wire(*dup.to_wire()) == dup
    pull = PullReply.from_wire(*PullReply(version=5, values={}).to_wire())
    assert pull.version == 5 and pull.values == {}


@pytest.mark.parametrize(
    ("method", "body", "tensors", "match"),
    [
        ("push", {"version": 0}, {}, "ps.push request lacks 'worker'"),
        ("push", {"worker": "w", "version": "0"}, {}, "'version' must be int"),
        ("push", {"worker": "w", "version": 0}, {"w": torch.ones(2)}, "neither a gradient"),
        ("push", {"worker": "w", "version": 0, "keys": ["7"]}, {}, "'keys' must be"),
        ("push", {"worker": "w", "version": 0, "keys": [["d", "0", 1]]}, {}, "'keys' must be"),
        # The row push decodes its keys with the same decoder (it once took these).
        ("rows_push", {"worker": "w", "keys": [["d", "0", 1]]}, {}, "'keys' must be"),
        ("rows_push", {"worker": "w", "keys": [["d", True, 1]]}, {}, "'keys' must be"),
        ("rows_push", {"worker": "w", "keys": [["d", 0.5, 1]]}, {}, "'keys' must be"),
        ("pull", {"dtype": "int8"}, {}, "no floating wire dtype 'int8'"),
        ("pull", {"dtype": "__class__"}, {}, "no floating wire dtype"),
        ("pull", [1, 2], {}, "body must be a map"),
        ("apply", {"version": 1}, {}, "lacks 'workers'"),
        ("leave", {}, {}, "'worker' must be a task name"),
        ("members", {}, {}, "'workers' must list task names"),
        ("members", {"workers": "worker:0"}, {}, "'workers' must list task names"),
        ("members", {"workers": []}, {}, "'workers' names no replica"),
        ("members", {"workers": ["w", "w"]}, {}, "'workers' repeats a name"),
        ("members", {"workers": ["w", 3]}, {}, "'workers' must be a task name"),
        ("members", {"workers": ["w"], "version": "3"}, {}, "'version' must be int"),
        ("members", {"workers": ["w"], "version": True}, {}, "'version' must be int"),
        ("members", {"workers": ["w"], "version": 2**63}, {}, "'version' must be in"),
        ("members", {"workers": ["w"], "previous": "w"}, {}, "'previous' must list task"),
        ("teleport", {}, {}, "unknown ps method 'teleport'"),
    ],
)
def test_a_malformed_request_is_refused_by_name(
    method: str, body: Any, tensors: dict[str, torch.Tensor], match: str
) -> None:
    with pytest.raises(MalformedRequest, match=match):
        PSHandler(VariableStore(0)).dispatch(method, body, tensors)


def test_local_pull_and_push_keep_their_timeout() -> None:
    """The in-process path once dropped both timeouts and waited 60 s instead."""
    connection = LocalPS()
    _setup(connection)
    with pytest.raises(PSError, match=r"version 5 did not come within 0\.05s"):
        connection.pull(0, PullRequest(min_version=5, timeout=0.05))
    connection.store.quiesce()
    with pytest.raises(PSError, match=r"0\.05s"):
        connection.push(0, PushRequest(worker="chief:0", version=0, timeout=0.05))


@pytest.fixture
def remote() -> Iterator[PSConnection]:
    from clusterflow.ps.client import RemotePS

    credentials = Credentials.generate()
    server = create_local_server(credentials=credentials)
    PSService(server)
    spec = ClusterSpec({"ps": [server.target.removeprefix("tcp://")]})
    connection = RemotePS(spec, credentials, deadline=10)
    yield connection
    connection.close()
    server.stop()


def test_local_and_remote_connections_answer_alike(remote: PSConnection) -> None:
    """The same requests through ``LocalPS`` and over RPC give the same replies."""
    local = LocalPS()
    replies = []
    for connection in (local, remote):
        _setup(connection, max_staleness=1)
        push = PushRequest(
            worker="worker:0", version=0, grads={"w": torch.ones(2)}, want_values=True
        )
        first = connection.push(0, push)
        stale = connection.push(0, PushRequest(worker="worker:1", version=-5, grads={}))
        pulled = connection.pull(0, PullRequest(names=["w"], dtype="bfloat16"))
        stats, _ = connection.call(0, "stats")
        state, tensors = connection.call(0, "state")
        replies.append((first, stale, pulled, stats, state, tensors))
    (l_first, l_stale, l_pull, l_stats, l_state, l_t) = replies[0]
    (r_first, r_stale, r_pull, r_stats, r_state, r_t) = replies[1]
    assert (l_first.applied, l_first.version) == (r_first.applied, r_first.version) == (True, 1)
    assert torch.equal(l_first.values["w"], r_first.values["w"])
    assert not l_stale.applied and l_stale.reason
    assert (l_stale.applied, l_stale.reason) == (r_stale.applied, r_stale.reason)
    assert l_pull.version == r_pull.version == 1
    assert l_pull.values["w"].dtype == r_pull.values["w"].dtype == torch.bfloat16
    assert l_stats == r_stats
    assert l_state == r_state and l_t.keys() == r_t.keys()
    with pytest.raises(RemoteError, match="lacks 'worker'") as info:
        remote.call(0, "push", {"version": 0})
    assert info.value.error_type == "MalformedRequest" and info.value.code == "app"


def test_the_service_serves_every_method_of_the_contract(remote: PSConnection) -> None:
    for method in METHODS:
        try:
            remote.call(0, method, {"worker": "worker:9", "version": 0, "timeout": 0.01})
        except RemoteError as exc:
            assert exc.code == "app", (method, exc)  # the handler refused, not the server


@pytest.mark.parametrize(
    ("request_type", "body"),
    [
        (PullRequest, {"timeout": float("nan")}),
        (RowsPullRequest, {"timeout": float("nan")}),
        (RowsPullRequest, {"timeout": float("inf")}),
        (RowsPullRequest, {"timeout": -1.0}),
        (RowsPullRequest, {"timeout": 1e9}),
        (RowsPullRequest, {"min_version": 2.0**63}),
        (RowsPushRequest, {"worker": "w", "timeout": float("nan")}),
        (RowsPushRequest, {"worker": "w", "version": float("inf")}),
    ],
)
def test_both_halves_refuse_unbounded_waits_and_versions(request_type: Any, body: Any) -> None:
    """A NaN, infinite or year-long wait would hold a ps handler thread for good; the sparse
    half of the contract bounds it as the dense half does (ps/wire.py ``BOUNDED``)."""
    with pytest.raises(MalformedRequest, match="must be in"):
        request_type.from_wire(body, {})


@pytest.mark.parametrize("reply", [PushReply, RowsPushReply])
def test_a_push_replys_duplicates_are_decoded_as_strictly_as_a_pushs_keys(reply: Any) -> None:
    ok = reply.from_wire({"applied": True, "version": 1, "duplicates": [["d", 0, 3]]}, {})
    assert ok.duplicates == (("d", 0, 3),)
    with pytest.raises(MalformedRequest, match="'duplicates' must be"):
        reply.from_wire({"applied": True, "version": 1, "duplicates": [["d", False, 3]]}, {})


def test_the_request_types_load_nothing_of_the_server_side() -> None:
    """Issue 29: a worker that needs the ``ps.*`` types must not load the ps (its store,
    its tables, its handler); ``ps/protocol.py`` once imported all three."""
    import subprocess
    import sys

    probe = (
        "import sys, clusterflow.ps.protocol, clusterflow.ps.rows_protocol, clusterflow.ps.client;"
        "print(sorted(m for m in sys.modules if m in ("
        "'clusterflow.ps.store', 'clusterflow.ps.tables', 'clusterflow.ps.handler',"
        "'clusterflow.ps.engine', 'clusterflow.ps.loans')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("method", "body"),
    [("wait_version", {"version": 5}), ("pull", {"min_version": 5})],
)
def test_a_wait_sent_without_its_own_timeout_waits_the_ps_default_then_refuses(
    monkeypatch: pytest.MonkeyPatch, method: str, body: dict[str, Any]
) -> None:
    """A well-formed wait with no ``timeout`` key waits ``DEFAULT_TIMEOUT_S`` (60 s, shortened
    here to see it end), then refuses: it neither returns at once nor waits forever. The
    hostile-wire fuzz met this path only by chance (docs/testing.md, "Eleventh session")."""
    from clusterflow.ps import protocol
    from clusterflow.ps.wire import DEFAULT_TIMEOUT_S

    assert DEFAULT_TIMEOUT_S == 60.0
    monkeypatch.setattr(protocol, "DEFAULT_TIMEOUT_S", 0.05)
    with pytest.raises(PSError, match=r"version 5 did not come within 0\.05s"):
        PSHandler(VariableStore(0)).dispatch(method, body, {})
