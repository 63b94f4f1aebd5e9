"""Errors a caller must act on travel typed, by their wire code (rpc/errors.py).

A handler raising a ``CodedError`` (``TaskFenced``, ``VersionTimeout``) answers with
its ``wire_code``; the client raises a ``RemoteError`` that is also the registered class,
so callers decide by ``except TaskFenced`` / ``except VersionTimeout`` and never by the
remote class's name or message. A code the client does not know is a plain
``RemoteError``. Each test runs a real in-process ``RpcServer`` on loopback and stops
it, failure or not.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from clusterflow.cluster import ClusterSpec
from clusterflow.ps.api import PSError, VersionTimeout
from clusterflow.ps.client import RemotePS
from clusterflow.rpc import CodedError, Credentials, RemoteError, Request, RpcClient, RpcError
from clusterflow.rpc import errors as rpc_errors
from clusterflow.rpc.fencing import TaskFenced, raise_if_fenced
from clusterflow.rpc.server import RpcServer
from clusterflow.strategies.parameter_server.shards import wait_for_version

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def credentials() -> Credentials:
    return Credentials.generate()


@pytest.fixture
def serve(
    credentials: Credentials,
) -> Iterator[Callable[[dict[str, Callable[[Request], Any]]], RpcServer]]:
    """Starts servers with the given handlers; stops each when the test ends."""
    servers: list[RpcServer] = []

    def start(handlers: dict[str, Callable[[Request], Any]]) -> RpcServer:
        server = RpcServer(credentials, name="err-codes")
        for method, handler in handlers.items():
            server.register(method, handler)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


def _call(server: RpcServer, method: str, credentials: Credentials) -> RemoteError:
    with RpcClient(server.address, credentials, deadline=10) as client:
        with pytest.raises(RemoteError) as info:
            client.call(method)
        assert client.call("ok").body == "served on"  # an error reply keeps the connection
    return info.value


def _ok(request: Request) -> str:
    return "served on"


def _fenced(request: Request) -> None:
    raise TaskFenced("worker:1 incarnation 0 is fenced: incarnation 1 replaced it")


def test_a_handlers_task_fenced_reaches_the_client_as_task_fenced(
    serve: Any, credentials: Credentials
) -> None:
    error = _call(serve({"ok": _ok, "svc.work": _fenced}), "svc.work", credentials)
    assert isinstance(error, TaskFenced) and isinstance(error, RemoteError), type(error).__mro__
    assert error.code == "app" and error.method == "svc.work"
    assert error.error_type == "TaskFenced"  # still sent, for messages and logs
    assert "incarnation 1 replaced it" in str(error)


def test_a_handlers_version_timeout_reaches_the_client_as_a_ps_error(
    serve: Any, credentials: Credentials
) -> None:
    def wait(request: Request) -> None:
        raise VersionTimeout("version 3 did not come within 1s")

    error = _call(serve({"ok": _ok, "ps.wait_version": wait}), "ps.wait_version", credentials)
    assert isinstance(error, VersionTimeout) and isinstance(error, PSError)
    assert isinstance(error, RemoteError) and not isinstance(error, TaskFenced)


def test_an_unknown_wire_code_reaches_the_client_as_a_plain_remote_error(
    serve: Any, credentials: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that never imported the class (or a newer peer's code) still gets the
    answer, as the ``RemoteError`` every caller already catches."""
    monkeypatch.delitem(rpc_errors._REMOTE_TYPES, TaskFenced.wire_code)
    error = _call(serve({"ok": _ok, "svc.work": _fenced}), "svc.work", credentials)
    assert type(error) is RemoteError, type(error)
    assert error.code == "app" and "replaced it" in str(error)


def test_an_error_without_a_wire_code_stays_a_plain_remote_error(
    serve: Any, credentials: Credentials
) -> None:
    def refuse(request: Request) -> None:
        raise PSError("no variable 'w'")

    error = _call(serve({"ok": _ok, "ps.pull": refuse}), "ps.pull", credentials)
    assert type(error) is RemoteError and error.error_type == "PSError"


def test_raise_if_fenced_acts_on_the_type_and_raises_no_rpc_error(
    serve: Any, credentials: Credentials
) -> None:
    """The zombie's clients turn the answer into a plain ``TaskFenced``: no ``RpcError``,
    so a caller that retries failed calls lets it through to the training loop."""
    error = _call(serve({"ok": _ok, "svc.work": _fenced}), "svc.work", credentials)
    with pytest.raises(TaskFenced) as info:
        raise_if_fenced(error)
    assert not isinstance(info.value, RpcError)
    # A refusal of another kind is left to the caller, whatever its message says.
    raise_if_fenced(RemoteError("app", "TaskFenced: fenced", error_type="PSError"))


def test_typed_remote_errors_survive_pickling() -> None:
    """Ray and the coordinator pickle errors; the typed one comes back typed."""
    error = rpc_errors.remote_error(
        "app", "fenced", error_type="TaskFenced", method="ps.push", wire_code="fenced"
    )
    back = pickle.loads(pickle.dumps(error))
    assert isinstance(back, TaskFenced) and isinstance(back, RemoteError)
    assert (back.code, str(back), back.error_type, back.method) == (
        "app",
        "fenced",
        "TaskFenced",
        "ps.push",
    )
    plain = pickle.loads(pickle.dumps(RemoteError("not_found", "no method", method="x")))
    assert type(plain) is RemoteError and plain.code == "not_found" and plain.method == "x"


@pytest.mark.parametrize("code", ["", "app", "not_found", "fenced"])
def test_a_wire_code_must_be_new_and_not_a_reason(code: str) -> None:
    with pytest.raises(TypeError, match="wire_code"):
        type("Clash", (CodedError,), {"wire_code": code})


def _ps(serve: Any, credentials: Credentials, handler: Callable[[Request], Any]) -> RemotePS:
    server = serve({"ps.wait_version": handler})
    return RemotePS(ClusterSpec({"ps": [server.address]}), credentials, deadline=10)


def test_wait_for_version_retries_a_ps_round_that_ran_out(
    serve: Any, credentials: Credentials
) -> None:
    rounds: list[Any] = []

    def wait_version(request: Request) -> dict[str, int]:
        rounds.append(request.body)
        if len(rounds) < 3:
            raise VersionTimeout(f"version 5 did not come within {request.body['timeout']}s")
        return {"version": 5}

    ps = _ps(serve, credentials, wait_version)
    try:
        wait_for_version(ps, 5, deadline=4.0)
    finally:
        ps.close()
    assert rounds == [{"version": 5, "timeout": 2.0}] * 3


def test_wait_for_version_raises_a_ps_failure_at_once(serve: Any, credentials: Credentials) -> None:
    """A refusal that merely names the type in its message is no round that ran out."""
    rounds: list[Any] = []

    def wait_version(request: Request) -> dict[str, int]:
        rounds.append(request.body)
        if len(rounds) == 1:
            raise PSError("VersionTimeout? no: the ps has no variables yet")
        return {"version": 5}  # a caller that retried would return without an error

    ps = _ps(serve, credentials, wait_version)
    try:
        with pytest.raises(RemoteError, match="no variables yet") as info:
            wait_for_version(ps, 5, deadline=4.0)
    finally:
        ps.close()
    assert not isinstance(info.value, VersionTimeout)
    assert len(rounds) == 1


def _report(body: Any) -> Any:
    from clusterflow.manager.trial_reports import line

    return line(body)


def _declare(body: Any) -> Any:
    from clusterflow.server.manager_messages import DeclareRequest

    return DeclareRequest.from_wire(body)


def _lease(body: Any) -> Any:
    from clusterflow.data.dispatcher import DispatcherService

    return DispatcherService()._on_lease(Request("data.lease", body, {}, b""))


def _cache_read(body: Any) -> Any:
    from clusterflow.data.cache_wire import ReadRequest

    return ReadRequest.from_wire(body)


def _ps_pull(body: Any) -> Any:
    from clusterflow.ps.protocol import PullRequest

    return PullRequest.from_wire(body, {})


def _worker_run(body: Any) -> Any:
    from clusterflow.strategies.coordinator.protocol import RunRequest

    return RunRequest.from_wire(body)


@pytest.mark.parametrize(
    ("parse", "kind", "what"),
    [
        (_ps_pull, "MalformedRequest", "ps.pull request body"),
        (_worker_run, "MalformedMessage", "worker.run"),
        (_lease, "MalformedBody", "data.lease body"),
        (_cache_read, "MalformedBody", "cache.read body"),
        (_report, "MalformedBody", "trial.report body"),
        (_declare, "MalformedBody", "manager.declare body"),
    ],
)
def test_a_body_that_is_not_a_map_is_one_error_whichever_contract_reads_it(
    parse: Callable[[Any], Any], kind: str, what: str
) -> None:
    """Pins ``rpc.message.body_map`` as every contract's first check (issue 29: four
    services raised four unrelated errors for it): each raises a ``MalformedBody``, of
    its service's kind, naming the message and the value."""
    with pytest.raises(
        rpc_errors.MalformedBody, match=f"{what}.* must be a map, got \\[1, 2\\]"
    ) as info:
        parse([1, 2])
    assert type(info.value).__name__ == kind


def test_a_malformed_body_reaches_the_client_as_malformed_body(
    serve: Any, credentials: Credentials
) -> None:
    """By its wire code: a caller tells a request it got wrong (never worth a retry)
    from the service's other refusals by type."""
    from clusterflow.ps.protocol import PullRequest

    def pull(request: Request) -> None:
        PullRequest.from_wire(request.body, request.tensors)

    server = serve({"ps.pull": pull})
    with (
        RpcClient(server.address, credentials, deadline=10) as client,
        pytest.raises(RemoteError) as info,
    ):
        client.call("ps.pull", [1, 2])
    error = info.value
    assert isinstance(error, rpc_errors.MalformedBody) and isinstance(error, RemoteError)
    assert (error.code, error.error_type) == ("app", "MalformedRequest")
