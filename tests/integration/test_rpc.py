"""RpcServer and RpcClient over real sockets on 127.0.0.1, and the credentials they use.

Every server a test starts is stopped by a fixture finalizer, failure or not. Elapsed
times are only checked against generous bounds, to tell "raised in time" from "hung".
"""

from __future__ import annotations

import os
import queue
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

import clusterflow
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.rpc import (
    PROTOCOL_VERSION,
    WHOLE_BYTES,
    AuthenticationError,
    ClientClosed,
    Credentials,
    DeadlineExceeded,
    ProtocolError,
    RemoteError,
    Request,
    Response,
    RpcClient,
    RpcServer,
    is_loopback,
    split_endpoint,
)
from clusterflow.rpc.auth import ENV_AUTH_MODE, ENV_SECRET, ENV_SECRET_FILE, stop_authenticators

integration = pytest.mark.integration


class Service:
    """The handlers every test server gets, with what they saw."""

    def __init__(self) -> None:
        self.notes: queue.Queue[Request] = queue.Queue()
        self.barrier = threading.Barrier(2, timeout=5)
        self._gates: dict[str, threading.Event] = {}
        self._gates_lock = threading.Lock()

    def gate(self, name: str) -> threading.Event:
        """An event tests and ``hold`` handlers share by name."""
        with self._gates_lock:
            return self._gates.setdefault(name, threading.Event())

    def register(self, server: RpcServer) -> None:
        server.register("echo", lambda request: request.body)
        server.register("scale", self.scale)
        server.register("note", self.notes.put)
        server.register("fail.app", self.fail_app)
        server.register("fail.internal", self.fail_internal)
        server.register("fail.reply", lambda request: object())
        server.register("fail.tensors", lambda request: Response(tensors={"x": [1, 2]}))
        server.register(
            "fail.dtype",
            lambda request: Response(tensors={"z": torch.zeros(2, dtype=torch.complex64)}),
        )
        server.register("hold", self.hold, blocking=True)
        server.register("meet", self.meet, blocking=True)

    @staticmethod
    def scale(request: Request) -> Response:
        factor = request.body["factor"]
        tensors = {name: t * factor for name, t in request.tensors.items()}
        return Response(body={"names": list(request.tensors)}, tensors=tensors)

    @staticmethod
    def fail_app(request: Request) -> None:
        raise ConfigError(f"bad value {request.body!r}")

    @staticmethod
    def fail_internal(request: Request) -> None:
        raise KeyError("lost")

    def hold(self, request: Request) -> Any:
        """Opens the gates named in ``open``, says it started (gate ``<tag>-started``),
        waits for gate ``<tag>``, then says it returned (gate ``<tag>-returned``)."""
        body = request.body
        for name in body.get("open", ()):
            self.gate(name).set()
        for name in body.get("after", ()):
            if not self.gate(name).wait(10):
                raise TimeoutError(f"gate {name!r} never opened")
        self.gate(f"{body['tag']}-started").set()
        if not self.gate(body["tag"]).wait(10):
            raise TimeoutError(f"gate {body['tag']!r} never opened")
        self.gate(f"{body['tag']}-returned").set()
        return body["tag"]

    def meet(self, request: Request) -> Any:
        return self.barrier.wait()


@pytest.fixture
def credentials() -> Credentials:
    return Credentials.generate()


@pytest.fixture
def service() -> Service:
    return Service()


@pytest.fixture
def make_server(credentials: Credentials, service: Service) -> Iterator[Callable[..., RpcServer]]:
    """Starts servers serving ``service``; stops each when the test ends."""
    servers: list[RpcServer] = []

    def make(creds: Credentials | None = None, **kwargs: Any) -> RpcServer:
        server = RpcServer(creds or credentials, **kwargs)
        servers.append(server)
        service.register(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def server(make_server: Callable[..., RpcServer]) -> RpcServer:
    return make_server()


@pytest.fixture
def connect(credentials: Credentials) -> Iterator[Callable[..., RpcClient]]:
    """Builds clients; closes each when the test ends."""
    clients: list[RpcClient] = []

    def make(
        target: RpcServer | str, creds: Credentials | None = None, deadline: float = 5.0
    ) -> RpcClient:
        address = target.address if isinstance(target, RpcServer) else target
        client = RpcClient(address, creds or credentials, deadline=deadline)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A context of the test's own for hand-built sockets."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    stop_authenticators(ctx)
    ctx.destroy(linger=0)


@pytest.fixture
def raw_dealer(
    zctx: zmq.Context[zmq.Socket[bytes]], credentials: Credentials
) -> Callable[..., zmq.Socket[bytes]]:
    """A bare pyzmq DEALER: with the right PLAIN credentials, or with none (NULL)."""

    def make(
        server: RpcServer, *, authenticated: bool = True, routing_id: bytes | None = None
    ) -> zmq.Socket[bytes]:
        dealer = zctx.socket(zmq.DEALER)
        dealer.linger = 0
        if routing_id is not None:
            dealer.routing_id = routing_id
        if authenticated:
            credentials.apply_client(dealer, "127.0.0.1")
        dealer.connect(server.endpoint)
        return dealer

    return make


@pytest.fixture
def silent() -> Iterator[str]:
    """An address nothing listens on: its port held by a bound socket that never listens."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{held.getsockname()[1]}"


def reuse_port_socket(port: int = 0) -> socket.socket:
    """A bound, non-listening socket with SO_REUSEPORT: many may share one port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def raw_request(method: str, request_id: int, body: Any = None, **extra: Any) -> bytes:
    header = {"v": PROTOCOL_VERSION, "k": "req", "id": request_id, "m": method, "b": body}
    header.update(extra)
    return msgpack.packb(header)


def raw_reply(dealer: zmq.Socket[bytes], timeout_ms: int = 5000) -> dict[str, Any]:
    assert dealer.poll(timeout_ms), "no reply from the server"
    frames = dealer.recv_multipart()
    header: dict[str, Any] = msgpack.unpackb(frames[0], raw=False)
    return header


def assert_serves(server: RpcServer, connect: Callable[..., RpcClient]) -> None:
    """A fresh client gets an answer: the server survived whatever came before."""
    assert connect(server).call("echo", "still here").body == "still here"


# Requests, replies and one-way messages -------------------------------------------------


@integration
def test_request_with_body_and_tensors_gets_its_reply(
    server: RpcServer, connect: Callable[..., RpcClient]
) -> None:
    tensors = {
        "w": torch.arange(12.0).reshape(3, 4),
        "big": torch.ones(WHOLE_BYTES // 4 + 10),  # cut into frames
        "half": torch.full((5,), 1.5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 2),
    }
    reply = connect(server).call("scale", {"factor": 2}, tensors)
    assert reply.body == {"names": list(tensors)}
    assert list(reply.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert reply.tensors[name].dtype == (tensor * 2).dtype
        assert torch.equal(reply.tensors[name], tensor * 2), name


@integration
def test_handler_return_value_is_the_reply_body(
    server: RpcServer, connect: Callable[..., RpcClient]
) -> None:
    body = {"a": [1, 2.5, "x", None, b"\x00"], "nested": {"k": True}}
    reply = connect(server).call("echo", body)
    assert reply.body == body
    assert reply.tensors == {}


@integration
def test_one_way_message_reaches_the_handler(
    server: RpcServer, service: Service, connect: Callable[..., RpcClient]
) -> None:
    connect(server).send("note", {"step": 4}, {"g": torch.arange(6.0)})
    request = service.notes.get(timeout=5)
    assert request.oneway
    assert request.method == "note"
    assert request.body == {"step": 4}
    assert torch.equal(request.tensors["g"], torch.arange(6.0))


@integration
def test_one_way_tensor_may_be_changed_as_soon_as_send_returns(
    server: RpcServer, service: Service, connect: Callable[..., RpcClient]
) -> None:
    tensor = torch.ones(4 * 1024 * 1024)  # 16 MiB: still being written out when send returns
    connect(server).send("note", None, {"g": tensor})
    tensor.zero_()
    request = service.notes.get(timeout=5)
    assert bool((request.tensors["g"] == 1).all())


@integration
def test_one_way_to_an_unknown_method_is_dropped_and_the_server_serves_on(
    server: RpcServer, connect: Callable[..., RpcClient]
) -> None:
    client = connect(server)
    client.send("no.such.method", {"x": 1})
    assert client.call("echo", 1).body == 1


@integration
def test_calls_from_many_threads_on_one_client_each_get_their_own_answer(
    server: RpcServer, connect: Callable[..., RpcClient]
) -> None:
    client = connect(server)
    wrong: list[tuple[int, Any]] = []

    def work(worker: int) -> None:
        for i in range(25):
            value = worker * 1000 + i
            got = client.call("echo", value).body
            if got != value:
                wrong.append((value, got))

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert wrong == []


# Error replies, and the server serving on after each --------------------------------------


@integration
def test_unknown_method_is_not_found(server: RpcServer, connect: Callable[..., RpcClient]) -> None:
    client = connect(server)
    with pytest.raises(RemoteError) as info:
        client.call("no.such.method")
    assert info.value.code == "not_found"
    assert info.value.method == "no.such.method"
    assert "no.such.method" in str(info.value)
    assert client.call("echo", 1).body == 1
    assert_serves(server, connect)


@integration
def test_handler_raising_a_clusterflow_error_is_app_with_its_message(
    server: RpcServer, connect: Callable[..., RpcClient]
) -> None:
    client = connect(server)
    with pytest.raises(RemoteError) as info:
        client.call("fail.app", "lr=-1")
    assert info.value.code == "app"
    assert info.value.error_type == "ConfigError"
    assert "bad value 'lr=-1'" in str(info.value)
    assert isinstance(info.value, ClusterflowError)
    assert client.call("echo", 2).body == 2
    assert_serves(server, connect)


@integration
def test_handler_raising_a_plain_exception_is_internal(
    server: RpcServer, connect: Callable[..., RpcClient]
) -> None:
    client = connect(server)
    with pytest.raises(RemoteError) as info:
        client.call("fail.internal")
    assert info.value.code == "internal"
    assert info.value.error_type == "KeyError"
    assert client.call("echo", 3).body == 3
    assert_serves(server, connect)


@integration
@pytest.mark.parametrize("method", ["fail.reply", "fail.tensors", "fail.dtype"])
def test_reply_that_cannot_be_encoded_is_internal(
    server: RpcServer, connect: Callable[..., RpcClient], method: str
) -> None:
    client = connect(server)
    with pytest.raises(RemoteError) as info:
        client.call(method)
    assert info.value.code == "internal"
    assert client.call("echo", 4).body == 4
    assert_serves(server, connect)


@integration
def test_message_over_the_size_limit_is_too_large_and_the_server_serves_on(
    make_server: Callable[..., RpcServer], connect: Callable[..., RpcClient]
) -> None:
    limit = 1024 * 1024
    server = make_server(max_message_bytes=limit)
    client = connect(server)
    # Each frame is under the limit (ZeroMQ itself would drop a single larger frame).
    parts = {f"p{i}": torch.zeros(limit // 2 // 4) for i in range(3)}
    with pytest.raises(RemoteError) as info:
        client.call("scale", {"factor": 1}, parts)
    assert info.value.code == "too_large"
    assert str(limit) in str(info.value)
    small = client.call("scale", {"factor": 3}, {"x": torch.ones(4)})
    assert torch.equal(small.tensors["x"], torch.full((4,), 3.0))
    assert_serves(server, connect)


@integration
@pytest.mark.parametrize(
    ("frames", "request_id"),
    [
        ([b"garbage, not msgpack \xc1\xff"], 0),
        ([b""], 0),
        ([msgpack.packb(["not", "a", "map"])], 0),
        ([msgpack.packb({"v": 99, "k": "req", "id": 42, "m": "echo"})], 42),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "k": "zzz", "id": 43, "m": "echo"})], 43),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "k": "rep", "id": 44, "m": "echo"})], 44),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "k": "req", "id": "x", "m": "echo"})], 0),
    ],
    ids=["garbage", "empty", "array", "version-99", "unknown-kind", "a-reply", "string-id"],
)
def test_malformed_header_gets_a_protocol_error_reply(
    server: RpcServer,
    raw_dealer: Callable[..., zmq.Socket[bytes]],
    connect: Callable[..., RpcClient],
    frames: list[bytes],
    request_id: int,
) -> None:
    dealer = raw_dealer(server)
    dealer.send_multipart(frames)
    reply = raw_reply(dealer)
    assert reply["k"] == "err"
    assert reply["c"] == "protocol"
    assert reply["id"] == request_id
    # The same connection, and everyone else, are still served.
    dealer.send_multipart([raw_request("echo", 5, "ok")])
    assert raw_reply(dealer) == {"v": PROTOCOL_VERSION, "k": "rep", "id": 5, "m": "echo", "b": "ok"}
    assert_serves(server, connect)


@integration
@pytest.mark.parametrize(
    ("descriptors", "frames"),
    [
        ([["x", "float32", [4], 16]], []),
        ([["x", "float32", [4], 16]], [b"\x00" * 12]),
        ([["x", "float32", [4], 16]], [b"\x00" * 16, b"\x00" * 16]),
        ([["x", "float32", [5], 16]], [b"\x00" * 16]),
        ([["x", "complex64", [2], 16]], [b"\x00" * 16]),
        ([["x", "float32"]], [b"\x00" * 16]),
        ("nonsense", [b"\x00" * 16]),
        (None, [b"\x00" * 16]),
    ],
    ids=[
        "missing-frame",
        "short-frame",
        "extra-frame",
        "shape-mismatch",
        "bad-dtype",
        "short-descriptor",
        "not-a-list",
        "frames-without-descriptors",
    ],
)
def test_descriptors_not_matching_the_frames_get_bad_request(
    server: RpcServer,
    raw_dealer: Callable[..., zmq.Socket[bytes]],
    connect: Callable[..., RpcClient],
    descriptors: Any,
    frames: list[bytes],
) -> None:
    dealer = raw_dealer(server)
    header = raw_request("scale", 9, {"factor": 1}, t=descriptors)
    dealer.send_multipart([header, *frames])
    reply = raw_reply(dealer)
    assert (reply["k"], reply["c"], reply["id"]) == ("err", "bad_request", 9)
    assert_serves(server, connect)


@integration
def test_a_server_that_takes_no_tensors_refuses_them_without_importing_torch() -> None:
    # The manager's server (``tensors=False``): a peer sending tensor frames must not make
    # a process that never moves tensors import torch, nor be served as if they were not there.
    result = run_python(
        """
        import sys
        import msgpack, zmq
        from clusterflow.rpc import PROTOCOL_VERSION, Credentials, RpcClient, RpcServer

        credentials = Credentials.generate()
        server = RpcServer(credentials, tensors=False, name="plain")
        server.register("echo", lambda request: request.body)
        server.start()
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.linger = 0
        credentials.apply_client(dealer, "127.0.0.1")
        dealer.connect(server.endpoint)
        header = {"v": PROTOCOL_VERSION, "k": "req", "id": 7, "m": "echo", "b": 1,
                  "t": [["x", "float32", [2], 8]]}
        dealer.send_multipart([msgpack.packb(header), bytes(8)])
        assert dealer.poll(10000)
        reply = msgpack.unpackb(dealer.recv_multipart()[0], raw=False)
        print(reply["c"], reply["id"], "takes no tensors" in reply["b"])
        with RpcClient(server.address, credentials, deadline=10) as client:
            print(client.call("echo", "served on").body)
        print("torch" in sys.modules)
        server.stop()
        """,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["bad_request 7 True", "served on", "False"]


@integration
def test_raw_peer_with_the_right_credentials_is_served(
    server: RpcServer, raw_dealer: Callable[..., zmq.Socket[bytes]]
) -> None:
    dealer = raw_dealer(server)
    dealer.send_multipart([raw_request("echo", 3, [1, 2])])
    assert raw_reply(dealer)["b"] == [1, 2]


@integration
def test_a_burst_is_answered_whole_beside_a_blocking_reply(
    server: RpcServer, raw_dealer: Callable[..., zmq.Socket[bytes]], service: Service
) -> None:
    """A burst of hundreds of requests, mixed with malformed headers, one-way messages,
    a tensor request and a blocking call whose reply comes back through the loop's own
    ROUTER meanwhile, is answered in full, each reply to its own id."""
    count = 320
    bad = [i for i in range(2, count) if i % 7 == 0]
    oneway = [i for i in range(2, count) if i % 11 == 0 and i % 7]
    dealer = raw_dealer(server)
    dealer.send_multipart([raw_request("meet", 1)])
    for i in range(2, count):
        if i in bad:
            dealer.send_multipart([b"\x93not a map"])
        elif i in oneway:
            header = {"v": PROTOCOL_VERSION, "k": "one", "id": i, "m": "note", "b": i}
            dealer.send_multipart([msgpack.packb(header)])
        else:
            dealer.send_multipart([raw_request("echo", i, [i])])
    tensor = torch.arange(4, dtype=torch.float32)
    header = {
        "v": PROTOCOL_VERSION,
        "k": "req",
        "id": count,
        "m": "scale",
        "b": {"factor": 2},
        "t": [["x", "float32", [4], 16]],
    }
    dealer.send_multipart([msgpack.packb(header), tensor.numpy().tobytes()])
    service.barrier.wait()  # the blocking call runs while the burst is served
    replies: dict[int, dict[str, Any]] = {}
    malformed = 0
    expected = count - len(oneway)
    while len(replies) + malformed < expected:
        assert dealer.poll(10_000), f"{len(replies) + malformed} of {expected} answered"
        frames = dealer.recv_multipart()
        reply = msgpack.unpackb(frames[0], raw=False)
        if reply["k"] == "err":
            assert reply["c"] == "protocol"
            malformed += 1
            continue
        replies[reply["id"]] = {"b": reply.get("b"), "frames": frames[1:]}
    assert malformed == len(bad)
    for i in set(range(2, count)) - set(bad) - set(oneway):
        assert replies[i]["b"] == [i]
    assert replies[1]["b"] in (0, 1)
    assert torch.frombuffer(
        bytearray(replies[count]["frames"][0]), dtype=torch.float32
    ).tolist() == [
        0.0,
        2.0,
        4.0,
        6.0,
    ]
    notes = sorted(service.notes.get(timeout=5).body for _ in oneway)
    assert notes == oneway


# Protocol versions ----------------------------------------------------------------------


@pytest.fixture
def other_version_server(
    zctx: zmq.Context[zmq.Socket[bytes]], credentials: Credentials
) -> Iterator[str]:
    """A hand-built ROUTER, with our credentials, that answers every request in v=99."""
    router = zctx.socket(zmq.ROUTER)
    router.linger = 0
    credentials.apply_server(router, "127.0.0.1")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if not router.poll(50):
                continue
            identity, header, *_ = router.recv_multipart()
            request = msgpack.unpackb(header, raw=False)
            reply = {"v": 99, "k": "rep", "id": request["id"], "m": request["m"], "b": "hi"}
            router.send_multipart([identity, msgpack.packb(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{port}"
    done.set()
    thread.join(5)
    router.close(linger=0)


@integration
def test_no_peer_speaks_as_the_loop(
    server: RpcServer,
    connect: Callable[..., RpcClient],
    raw_dealer: Callable[..., zmq.Socket[bytes]],
) -> None:
    """Pool handlers' replies and the stop signal reach the loop through its own ROUTER,
    from a DEALER with a reserved routing id (a private constant: the test plays a peer
    that learned it). A peer sending the stop signal as its message gets a protocol
    error; a peer claiming the loop's routing id is ignored by ZeroMQ, its stop signal
    and its forged reply to another caller unheard; the server serves on."""
    from clusterflow.rpc.server import _LOOP_ID, _STOP

    plain = raw_dealer(server)
    plain.send_multipart([_STOP])
    assert raw_reply(plain)["c"] == "protocol"
    victim = raw_dealer(server, routing_id=b"victim")
    victim.send_multipart([raw_request("echo", 9, "mine")])
    assert raw_reply(victim)["b"] == "mine"
    impostor = raw_dealer(server, routing_id=_LOOP_ID)
    forged = {"v": PROTOCOL_VERSION, "k": "rep", "id": 10, "m": "echo", "b": "forged"}
    impostor.send_multipart([b"victim", msgpack.packb(forged)])
    impostor.send_multipart([_STOP])
    assert_serves(server, connect)
    assert impostor.poll(200) == 0  # nothing for it: ZeroMQ never took its messages in
    assert victim.poll(0) == 0  # no forged reply reached the victim
    assert_serves(server, connect)


@integration
@pytest.mark.timeout(30)
def test_server_of_another_protocol_version_is_a_protocol_error(
    other_version_server: str, connect: Callable[..., RpcClient]
) -> None:
    # The deadline is far past the test's timeout: the error must come from the reply
    # itself, not from a client that dropped the reply and waited out its deadline.
    client = connect(other_version_server, deadline=600)
    with pytest.raises(ProtocolError, match="99"):
        client.call("echo", 1)


# Authentication ---------------------------------------------------------------------------


@integration
@pytest.mark.parametrize("mode", ["plain", "curve"])
def test_wrong_secret_is_refused(
    make_server: Callable[..., RpcServer], connect: Callable[..., RpcClient], mode: str
) -> None:
    server = make_server(Credentials.generate(mode))  # type: ignore[arg-type]
    intruder = connect(server, Credentials.generate(mode), deadline=5)  # type: ignore[arg-type]
    with pytest.raises(AuthenticationError):
        intruder.call("echo", 1)


@integration
@pytest.mark.parametrize("mode", ["plain", "curve"])
def test_right_secret_is_admitted(
    make_server: Callable[..., RpcServer], connect: Callable[..., RpcClient], mode: str
) -> None:
    creds = Credentials.generate(mode)  # type: ignore[arg-type]
    server = make_server(creds)
    assert server.auth_mode == mode
    reply = connect(server, creds).call("scale", {"factor": 2}, {"x": torch.arange(3.0)})
    assert torch.equal(reply.tensors["x"], torch.tensor([0.0, 2.0, 4.0]))


def test_loopback_defaults_to_plain_and_curve_can_be_forced() -> None:
    assert Credentials.generate().resolve_mode("127.0.0.1") == "plain"
    assert Credentials.generate().resolve_mode("10.1.2.3") == "curve"
    assert Credentials.generate("curve").resolve_mode("127.0.0.1") == "curve"


@integration
def test_curve_handshake_on_loopback_when_forced(
    make_server: Callable[..., RpcServer], connect: Callable[..., RpcClient]
) -> None:
    creds = Credentials.generate("curve")
    server = make_server(creds)
    assert server.auth_mode == "curve"
    big = torch.randn(WHOLE_BYTES // 4 + 3)
    reply = connect(server, creds).call("scale", {"factor": 1}, {"big": big})
    assert torch.equal(reply.tensors["big"], big)


@integration
def test_other_auth_mode_with_the_same_secret_is_refused(
    make_server: Callable[..., RpcServer], connect: Callable[..., RpcClient]
) -> None:
    creds = Credentials.generate("curve")
    server = make_server(creds)
    plain = Credentials(creds.secret, "plain")
    with pytest.raises(AuthenticationError):
        connect(server, plain).call("echo", 1)


@integration
def test_servers_of_two_clusters_in_one_process_admit_only_their_own(
    make_server: Callable[..., RpcServer], connect: Callable[..., RpcClient]
) -> None:
    first, second = Credentials.generate(), Credentials.generate()
    a, b = make_server(first), make_server(second)
    assert connect(a, first).call("echo", "a").body == "a"
    assert connect(b, second).call("echo", "b").body == "b"
    with pytest.raises(AuthenticationError):
        connect(a, second).call("echo", 1)


@integration
def test_client_without_credentials_gets_no_service(
    server: RpcServer,
    raw_dealer: Callable[..., zmq.Socket[bytes]],
    connect: Callable[..., RpcClient],
) -> None:
    dealer = raw_dealer(server, authenticated=False)  # the NULL mechanism
    dealer.send_multipart([raw_request("echo", 1, "let me in")])
    assert not dealer.poll(1000)
    assert_serves(server, connect)


# Deadlines and dead peers -------------------------------------------------------------------


@integration
def test_call_to_a_port_with_nothing_listening_exceeds_its_deadline(
    connect: Callable[..., RpcClient], silent: str
) -> None:
    client = connect(silent, deadline=600)
    # The call's own deadline ends it (the client's, far past the test's timeout, would
    # fail the test by its timeout) and the error names it.
    with pytest.raises(DeadlineExceeded, match=r"within 0\.5s"):
        client.call("echo", 1, deadline=0.5)


@integration
def test_deadline_exceeded_is_a_timeout_error(
    connect: Callable[..., RpcClient], silent: str
) -> None:
    with pytest.raises(TimeoutError):
        connect(silent, deadline=0.2).call("echo")


@integration
def test_stopped_server_exceeds_the_deadline_and_its_successor_is_reached(
    make_server: Callable[..., RpcServer], connect: Callable[..., RpcClient]
) -> None:
    # The port stays reserved by a socket that never listens, for the whole test: the
    # successor binds beside it (SO_REUSEPORT), and no one else can take the port.
    with reuse_port_socket() as held:
        port = held.getsockname()[1]
        server = make_server(listen_fd=reuse_port_socket(port).detach())
        client = connect(server, deadline=600)  # past the test's timeout: see above
        assert client.call("echo", "before", deadline=5).body == "before"
        server.stop()
        with pytest.raises(DeadlineExceeded, match=r"within 0\.5s"):
            client.call("echo", "while down", deadline=0.5)
        successor = make_server(listen_fd=reuse_port_socket(port).detach())
        assert successor.port == port
        assert client.call("echo", "after", deadline=5).body == "after"


@integration
def test_late_reply_never_answers_the_next_call(
    server: RpcServer, connect: Callable[..., RpcClient]
) -> None:
    client = connect(server)
    with pytest.raises(DeadlineExceeded):
        client.call("hold", {"tag": "first"}, deadline=0.3)  # held until the next call
    # The second call lets the first handler return, and answers only once it has: the
    # first reply comes back, late, while the second call waits for its own.
    second = {"tag": "second", "open": ["first", "second"], "after": ["first-returned"]}
    assert client.call("hold", second).body == "second"
    assert client.call("echo", "third").body == "third"


@integration
def test_blocking_handlers_run_concurrently(
    server: RpcServer, connect: Callable[..., RpcClient]
) -> None:
    results: queue.Queue[Any] = queue.Queue()

    def meet() -> None:
        try:
            results.put(connect(server).call("meet", deadline=8).body)
        except Exception as exc:
            results.put(exc)

    threads = [threading.Thread(target=meet, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    got = sorted(results.get_nowait() for _ in range(2))
    assert got == [0, 1]  # Barrier.wait's arrival indices: both got through


@integration
def test_quick_handlers_are_served_while_a_blocking_one_waits(
    server: RpcServer, connect: Callable[..., RpcClient], service: Service
) -> None:
    results: queue.Queue[Any] = queue.Queue()

    def slow() -> None:
        try:
            results.put(connect(server).call("hold", {"tag": "slow"}, deadline=20).body)
        except Exception as exc:
            results.put(exc)

    thread = threading.Thread(target=slow, daemon=True)
    thread.start()
    try:
        # The blocking handler runs, and stays blocked until the quick call was served.
        assert service.gate("slow-started").wait(10)
        assert connect(server).call("echo", "quick", deadline=10).body == "quick"
        assert not service.gate("slow-returned").is_set()
    finally:
        service.gate("slow").set()
        thread.join(10)
    assert results.get_nowait() == "slow"


@integration
def test_closed_client_refuses_calls(server: RpcServer, connect: Callable[..., RpcClient]) -> None:
    client = connect(server)
    client.close()
    with pytest.raises(ClientClosed):
        client.call("echo")
    with pytest.raises(ClientClosed):
        client.send("note")


# Ports -----------------------------------------------------------------------------------------


@integration
def test_server_adopts_a_pre_bound_socket(
    make_server: Callable[..., RpcServer], connect: Callable[..., RpcClient]
) -> None:
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.bind(("127.0.0.1", 0))
    port = reserved.getsockname()[1]
    server = make_server(listen_fd=reserved.detach())
    assert server.port == port
    assert server.address == f"127.0.0.1:{port}"
    assert connect(f"127.0.0.1:{port}").call("echo", "adopted").body == "adopted"


def test_split_endpoint_and_is_loopback() -> None:
    assert split_endpoint("127.0.0.1:5") == ("127.0.0.1", "tcp://127.0.0.1:5")
    assert split_endpoint("tcp://host:5") == ("host", "tcp://host:5")
    assert split_endpoint("[::1]:5") == ("::1", "tcp://[::1]:5")
    assert is_loopback("127.0.0.1")
    assert is_loopback("127.3.2.1")
    assert is_loopback("::1")
    assert is_loopback("[::1]")
    assert is_loopback("localhost")
    assert not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")


# Credentials -----------------------------------------------------------------------------------


def test_to_file_creates_an_owner_only_file_that_from_file_reads(tmp_path: Path) -> None:
    creds = Credentials.generate()
    path = tmp_path / "secret"
    creds.to_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Credentials.from_file(path)
    assert again.secret == creds.secret
    assert again.mode is None
    assert Credentials.from_file(path, "curve").mode == "curve"


def test_to_file_narrows_an_existing_wider_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("old")
    path.chmod(0o644)
    Credentials.generate().to_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_from_env_reads_a_file_or_hex_and_the_mode(tmp_path: Path) -> None:
    creds = Credentials.generate()
    path = tmp_path / "secret"
    creds.to_file(path)
    from_file = Credentials.from_env({ENV_SECRET_FILE: str(path), ENV_AUTH_MODE: "curve"})
    assert from_file is not None
    assert (from_file.secret, from_file.mode) == (creds.secret, "curve")
    from_hex = Credentials.from_env({ENV_SECRET: creds.to_hex()})
    assert from_hex is not None
    assert (from_hex.secret, from_hex.mode) == (creds.secret, None)
    assert Credentials.from_env({}) is None


def test_from_env_rejects_an_unknown_mode() -> None:
    with pytest.raises(ConfigError, match=ENV_AUTH_MODE):
        Credentials.from_env({ENV_SECRET: "00" * 32, ENV_AUTH_MODE: "none"})


def test_from_env_names_the_variable_of_a_bad_secret() -> None:
    with pytest.raises(ConfigError, match=ENV_SECRET):
        Credentials.from_env({ENV_SECRET: "zz"})


@pytest.mark.parametrize(
    "content",
    [b"not hex at all\n", b"\xff\xfe\x00garbage", b"abcd\n", b"", ("00" * 33).encode()],
    ids=["text", "binary", "too-short", "empty", "too-long"],
)
def test_from_file_on_garbage_is_a_config_error_naming_the_path(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "secret"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        Credentials.from_file(path)
    assert str(path) in str(info.value)


def test_from_file_on_a_missing_file_is_a_config_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "secret"
    with pytest.raises(ConfigError) as info:
        Credentials.from_file(path)
    assert str(path) in str(info.value)


def test_secret_of_the_wrong_length_or_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Credentials(b"short")
    with pytest.raises(ConfigError):
        Credentials(b"\x00" * 32, "none")  # type: ignore[arg-type]


def test_secret_never_shows_in_repr_or_domain() -> None:
    creds = Credentials.generate()
    assert creds.to_hex() not in repr(creds)
    assert creds.to_hex() not in creds.domain
    assert creds.to_hex() not in creds.password


# Interpreter exit -----------------------------------------------------------------------------


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    src = str(Path(clusterflow.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@integration
def test_exit_while_a_handler_runs_torch_ops_is_clean() -> None:
    # The server's loop thread is a daemon; were it still inside a torch op when the
    # interpreter finalizes, the process would abort with std::terminate's message.
    result = run_python(
        """
        import threading
        import torch
        from clusterflow.rpc import Credentials, RpcClient, RpcServer

        torch.set_num_threads(1)
        credentials = Credentials.generate()
        server = RpcServer(credentials)
        a = torch.randn(200, 200)
        inside = threading.Event()

        def work(request):
            inside.set()
            for _ in range(20):
                a @ a

        server.register("work", work)
        server.start()
        started = threading.Event()

        def hammer():
            client = RpcClient(server.address, credentials, deadline=60)
            while True:
                client.call("work")
                started.set()

        threading.Thread(target=hammer, daemon=True).start()
        assert started.wait(60)  # one whole round trip
        inside.clear()
        assert inside.wait(60)  # a handler has just begun its torch ops: exit now
        print("done")
        """,
        timeout=90,
    )
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"


@integration
def test_exit_is_not_held_up_by_a_blocking_handler_that_waits_forever() -> None:
    result = run_python(
        """
        import threading
        from clusterflow.rpc import Credentials, DeadlineExceeded, RpcClient, RpcServer

        credentials = Credentials.generate()
        server = RpcServer(credentials)
        never = threading.Event()
        server.register("wait", lambda request: never.wait(), blocking=True)
        server.start()
        client = RpcClient(server.address, credentials, deadline=0.3)
        try:
            client.call("wait")
        except DeadlineExceeded:
            print("deadline")
        """,
        timeout=30,
    )
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "deadline"


@integration
def test_exit_after_stop_and_close_is_clean() -> None:
    result = run_python(
        """
        from clusterflow.rpc import Credentials, RpcClient, RpcServer

        credentials = Credentials.generate()
        with RpcServer(credentials) as server:
            server.register("echo", lambda request: request.body)
            with RpcClient(server.address, credentials, deadline=5) as client:
                assert client.call("echo", b"x" * 1_000_000).body == b"x" * 1_000_000
                client.send("echo", 2)
        print("done")
        """
    )
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
