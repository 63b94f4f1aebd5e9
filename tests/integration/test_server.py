"""``Server`` and ``create_local_server`` from Python, and ``clusterflow server`` by hand."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.errors import ConfigError
from clusterflow.rpc import (
    AuthenticationError,
    Credentials,
    DeadlineExceeded,
    Request,
    RpcClient,
)
from clusterflow.server import Server, create_local_server

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration


@pytest.fixture
def creds() -> Credentials:
    return Credentials.generate()


@pytest.fixture
def spec(reserve: Callable[[], str]) -> dict[str, list[str]]:
    return {"ps": [reserve()], "worker": [reserve(), reserve()]}


@pytest.fixture
def no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("CLUSTERFLOW_SECRET_FILE", "CLUSTERFLOW_SECRET", "CLUSTERFLOW_AUTH"):
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.mark.timeout(30)
def test_server_serves_its_task_and_registered_methods(
    spec: dict[str, list[str]], creds: Credentials
) -> None:
    server = Server(spec, "worker", 1, credentials=creds)
    try:
        assert server.target == f"tcp://{spec['worker'][1]}"
        assert server.task == TaskId("worker", 1)
        assert server.cluster_spec == ClusterSpec(spec)
        assert server.auth_mode == "plain"  # loopback
        server.register("echo.twice", lambda request: {"x": request.body["x"] * 2})

        def fail(request: Request) -> None:
            raise ConfigError("no such thing")

        server.register_service("svc", {"fail": fail})
        with RpcClient(server.target, creds, deadline=10) as client:
            pong = client.call("health.ping").body
            assert pong["task"] == "worker:1" and pong["pid"] == os.getpid()
            assert client.call("echo.twice", {"x": 21}).body == {"x": 42}
            with pytest.raises(Exception, match="no such thing"):
                client.call("svc.fail")
        assert server.join(timeout=0.05) is False  # still serving
    finally:
        server.stop()
    assert server.join(timeout=5) is True
    # stop() closed the listening socket (only the test's reservation, which never
    # listens, holds the port), and the same task can be served again at once.
    host, port = spec["worker"][1].rsplit(":", 1)
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect((host, int(port)))
    Server(spec, "worker", 1, credentials=creds).stop()


@pytest.mark.timeout(30)
def test_server_refuses_another_clusters_secret(
    spec: dict[str, list[str]], creds: Credentials
) -> None:
    with Server(spec, "ps", 0, credentials=creds) as server:
        with (
            RpcClient(server.target, Credentials.generate(), deadline=10) as stranger,
            pytest.raises(AuthenticationError),
        ):
            stranger.call("health.ping")
        with RpcClient(server.target, creds, deadline=10) as member:
            assert member.call("health.ping").body["task"] == "ps:0"


@pytest.mark.timeout(30)
def test_server_reads_credentials_and_defaults_from_the_environment(
    tmp_path: os.PathLike[str],
    monkeypatch: pytest.MonkeyPatch,
    creds: Credentials,
    reserve: Callable[[], str],
) -> None:
    secret = os.path.join(tmp_path, "secret")
    creds.to_file(secret)
    monkeypatch.setenv("CLUSTERFLOW_SECRET_FILE", secret)
    monkeypatch.delenv("CLUSTERFLOW_AUTH", raising=False)
    address = reserve()
    # One job of one task: job_name and task_index may be left out, as in TensorFlow.
    with Server({"ps": [address]}) as server:
        assert server.task == TaskId("ps", 0)
        with RpcClient(address, creds, deadline=10) as client:
            assert client.call("health.ping").body["task"] == "ps:0"


@pytest.mark.timeout(30)
def test_create_local_server() -> None:
    server = create_local_server()
    try:
        assert server.cluster_spec.jobs == ["localhost"]
        address = server.cluster_spec.task_address("localhost", 0)
        assert address.startswith("127.0.0.1:")
        assert server.target == f"tcp://{address}"
        assert server.task == TaskId("localhost", 0)
        assert server.credentials is not None
        server.register("add", lambda request: sum(request.body))
        with RpcClient(server.target, server.credentials, deadline=10) as client:
            assert client.call("health.ping").body["task"] == "localhost:0"
            assert client.call("add", [1, 2, 3]).body == 6
        assert server.join(timeout=0.05) is False
    finally:
        server.stop()
    assert server.join(timeout=5) is True


@pytest.mark.timeout(30)
def test_create_local_server_not_started_serves_after_start() -> None:
    server = create_local_server(start=False)
    try:
        assert server.credentials is not None
        with RpcClient(server.target, server.credentials, deadline=0.3) as client:
            with pytest.raises(DeadlineExceeded):
                client.call("health.ping")
            server.start()
            assert client.call("health.ping", deadline=10).body["task"] == "localhost:0"
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("job", "index", "named"),
    [
        ("chief", 0, "'chief'"),
        ("worker", 2, "2"),
        ("worker", -1, "-1"),
        (None, 0, "job_name is required"),
        ("worker", None, "task_index is required"),
    ],
)
def test_server_bad_job_or_index_is_a_config_error_naming_it(
    spec: dict[str, list[str]], creds: Credentials, job: str | None, index: int | None, named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        Server(spec, job, index, credentials=creds)


def test_server_without_credentials_is_a_config_error(
    spec: dict[str, list[str]], no_env_credentials: None
) -> None:
    with pytest.raises(ConfigError, match="credentials"):
        Server(spec, "ps", 0)


@pytest.mark.timeout(30)
def test_server_on_a_taken_port_is_a_config_error_naming_the_address(creds: Credentials) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ConfigError, match=address):
            Server({"ps": [address]}, "ps", 0, credentials=creds)


# Manual mode: `clusterflow secret` and `clusterflow server` --------------------------------


@pytest.mark.timeout(60)
def test_manual_mode_server_from_the_cli(cf: Clusterflow, reserve: Callable[[], str]) -> None:
    secret = cf.workdir / "cluster.secret"
    made = cf.run("secret", str(secret))
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    ps_address = reserve()
    spec_file = cf.workdir / "spec.json"
    spec_file.write_text(json.dumps({"ps": [ps_address], "worker": ["127.0.0.1:1"]}))

    server = cf.popen(
        "server",
        "--cluster-spec",
        str(spec_file),
        "--job",
        "ps",
        "--task",
        "0",
        "--secret-file",
        str(secret),
    )
    assert server.stdout is not None
    reader = cf.LineReader(server.stdout)
    reader.wait_for(f"serving /job:ps/task:0 at tcp://{ps_address} (plain auth)")

    with RpcClient(ps_address, Credentials.from_file(secret), deadline=10) as member:
        assert member.call("health.ping").body["task"] == "ps:0"
    with (
        RpcClient(ps_address, Credentials.generate(), deadline=10) as stranger,
        pytest.raises(AuthenticationError),
    ):
        stranger.call("health.ping")

    server.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0
