"""The ps's side channel (``rpc/side.py``, issue 28): pushes and pulls over a plain TCP
socket, received straight into tensor memory, on loopback where ZeroMQ carries the
bytes in clear anyway.

These tests hold it to the ZeroMQ path bit for bit (float32 and bfloat16 gradients,
two optimizers, embedding rows) and pin its rules: a push cut off mid-transfer leaves no
trace and its retry applies once; bad input (an unknown token, a malformed header,
descriptors that do not fill their bytes, a message that is no request, too many
bytes) is answered with an error naming it and the ps serves on; a fence voids a push
still arriving; a call past its deadline fails and the next one works; a server without
a channel, or a CURVE one, is served over ZeroMQ.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch

from clusterflow.ps.api import PSConfig
from clusterflow.ps.rows import RowOptimizerSpec, TableSpec
from clusterflow.ps.rows_protocol import RowsPullRequest, RowsPushRequest
from clusterflow.ps.service import PSService
from clusterflow.rpc import Credentials, DeadlineExceeded, RemoteError, RpcClient, RpcServer, codec
from clusterflow.rpc import side as side_module
from clusterflow.rpc.client import split_endpoint
from clusterflow.server import Server, create_local_server

pytestmark = pytest.mark.timeout(120)

N = 2 * 1024 * 1024 + 12_345
"""8 MiB of float32 and some: 17 chunks on the ps, 9 pieces on the side channel."""
OPTIMIZERS = {
    "sgd": {"name": "SGD", "groups": [{"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}]},
    "adam": {"name": "Adam", "groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}]},
}


def _bits(t: Any) -> torch.Tensor:
    t = t.join() if isinstance(t, codec.Framed) else t
    return t.contiguous().view(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _wait(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


class _PS:
    def __init__(self, credentials: Credentials | None = None) -> None:
        self.credentials = credentials or Credentials.generate()
        self.server: Server = create_local_server(credentials=self.credentials)
        self.service = PSService(self.server)
        self.client = RpcClient(self.server.target, self.credentials, deadline=60)

    def setup(self, spec: dict[str, Any]) -> None:
        decl = [
            {"name": "w", "shape": [N], "dtype": "float32"},
            {"name": "b", "shape": [7], "dtype": "float32"},
        ]
        values = {"w": torch.linspace(-1, 1, N), "b": torch.arange(7.0)}
        config = {"mode": "async", "num_replicas": 1}
        self.client.call("ps.create", {"config": config, "vars": decl}, values)
        self.client.call("ps.optimizer", {"spec": spec, "group_of": {"w": 0, "b": 0}})

    def push(self, version: int, grads: dict[str, torch.Tensor], *, side: bool, **body: Any) -> Any:
        return self.client.call(
            "ps.push",
            {"worker": "w", "version": version, "want_values": True, **body},
            {f"g/{n}": g for n, g in grads.items()},
            framed=True,
            part_bytes=codec.PART_BYTES,
            streamed=True,
            side=side,
        )

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def one() -> Iterator[_PS]:
    ps = _PS()
    ps.setup(OPTIMIZERS["sgd"])
    try:
        yield ps
    finally:
        ps.close()


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the requests whose tensors came over the side channel."""
    seen: list[int] = []
    recv = side_module.recv_tensors

    def spy(sock: Any, descriptors: Any, *rest: Any) -> Any:
        if rest and rest[-1] is not None:  # the server's receive (it checks pieces)
            seen.append(1)
        return recv(sock, descriptors, *rest)

    monkeypatch.setattr(side_module, "recv_tensors", spy)
    return seen


def _grads(steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        {"w": torch.randn(N, generator=gen) * 1e-2, "b": torch.randn(7, generator=gen)}
        for _ in range(steps)
    ]


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_a_push_and_pull_over_the_side_channel_equal_zeromq_bit_for_bit(
    opt: str, wire: str, received: list[int]
) -> None:
    over_side, over_zmq = _PS(), _PS()
    try:
        for ps in (over_side, over_zmq):
            ps.setup(OPTIMIZERS[opt])
        dtype = getattr(torch, wire)
        for version, grads in enumerate(_grads(3)):
            sent = {n: g.to(dtype) for n, g in grads.items()}
            body = {"values_dtype": wire}
            a = over_side.push(version, sent, side=True, **body)
            b = over_zmq.push(version, sent, side=False, **body)
            assert a.body == b.body and a.body["applied"]
            assert sorted(a.tensors) == sorted(b.tensors) == ["b", "w"]
            for name in a.tensors:
                assert _same(a.tensors[name], b.tensors[name]), name
        assert len(received) == 3  # every push came over the side channel
        pulls = [
            ps.client.call("ps.pull", {"dtype": wire}, framed=True, side=side).tensors
            for ps, side in ((over_side, True), (over_zmq, False))
        ]
        for name in ("w", "b"):
            assert _same(pulls[0][name], pulls[1][name])
        states = [ps.service.store.state()[1] for ps in (over_side, over_zmq)]
        assert sorted(states[0]) == sorted(states[1])
        for key in states[0]:
            assert _same(states[0][key], states[1][key]), key
    finally:
        over_side.close()
        over_zmq.close()


def test_embedding_rows_over_the_side_channel_equal_zeromq_bit_for_bit(
    received: list[int],
) -> None:
    rows, dim = 40_000, 64  # 10 MiB of rows a push
    table = TableSpec(name="t", rows=rows, dim=dim, num_shards=1, init="zeros")
    config = PSConfig(mode="async", num_replicas=1)
    optimizer = RowOptimizerSpec(name="Adagrad", hyper={"lr": 0.1, "eps": 1e-10})
    pss = [_PS(), _PS()]
    try:
        for ps in pss:
            ps.client.call(
                "ps.rows_create",
                {"config": config.to_dict(), "tables": [table.to_dict()], "shard": None},
            )
            ps.client.call("ps.rows_optimizer", {"optimizers": {"t": optimizer.to_dict()}})
        gen = torch.Generator().manual_seed(3)
        for version in range(3):
            ids = torch.randint(0, rows, (rows,), generator=gen)
            grads = torch.randn(rows, dim, generator=gen)
            push = RowsPushRequest(worker="w", version=version, ids={"t": ids}, grads={"t": grads})
            for ps, side in zip(pss, (True, False), strict=True):
                assert ps.client.call("ps.rows_push", *push.to_wire(), side=side).body["applied"]
        assert len(received) == 3
        pull = RowsPullRequest(ids={"t": torch.arange(rows)})
        got = [
            ps.client.call("ps.rows_pull", *pull.to_wire(), side=side).tensors["r/t"]
            for ps, side in zip(pss, (True, False), strict=True)
        ]
        assert _same(got[0], got[1])
    finally:
        for ps in pss:
            ps.close()


# -- cut off mid-transfer --------------------------------------------------------------


def _side_socket(ps: _PS) -> socket.socket:
    """A connection to the ps's side channel past its hello, as a client's."""
    offer = ps.client.call("rpc.side").body
    host, _ = split_endpoint(ps.server.target)
    sock = socket.create_connection((host, offer["port"]), timeout=30)
    _send(
        sock,
        {
            "v": codec.PROTOCOL_VERSION,
            "k": "req",
            "id": 0,
            "m": "side.hello",
            "b": {"token": offer["token"]},
        },
    )
    assert _answer(sock)["k"] == "rep"
    return sock


def _send(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    raw = msgpack.packb(header)
    sock.sendall(struct.pack(">I", len(raw)) + raw + payload)


def _answer(sock: socket.socket) -> dict[str, Any]:
    """The next message's header; {} when the server cut the connection."""
    got = b""
    while len(got) < 4:
        chunk = sock.recv(4 - len(got))
        if not chunk:
            return {}
        got += chunk
    (size,) = struct.unpack(">I", got)
    raw = b""
    while len(raw) < size:
        chunk = sock.recv(size - len(raw))
        if not chunk:
            return {}
        raw += chunk
    header: dict[str, Any] = msgpack.unpackb(raw)
    return header


def _cut(sock: socket.socket) -> bool:
    """Whether the server closed the connection (EOF once its answers were read) within
    30 s."""
    sock.settimeout(30)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def _push_header(grad: torch.Tensor, request_id: int = 1, **body: Any) -> dict[str, Any]:
    return {
        "v": codec.PROTOCOL_VERSION,
        "k": "req",
        "id": request_id,
        "m": "ps.push",
        "b": {"worker": "w", "version": 0, "want_values": True, **body},
        "t": [codec.descriptor("g/w", grad)],
        "dl": 60,
    }


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_a_client_cut_off_mid_push_leaves_no_trace_and_its_retry_applies_once(one: _PS) -> None:
    grad = torch.full((N,), 0.5)
    before = one.service.store.vars["w"].clone()
    sock = _side_socket(one)
    keys = [["d", 0, 1]]
    _send(sock, _push_header(grad, keys=keys), _raw(grad)[: 5 * 1024 * 1024])
    _wait(lambda: one.server.partials() == 1)  # its bytes are arriving
    sock.close()  # the client dies mid-push
    _wait(lambda: one.server.partials() == 0)
    store = one.service.store
    assert store.version == 0 and store.stats["pushes"] == 0
    assert _same(store.vars["w"], before)
    # The worker retries (its split went back): applied once, then a duplicate.
    first = one.push(0, {"w": grad}, side=True, keys=keys)
    again = one.push(1, {"w": grad}, side=True, keys=keys)
    assert first.body["applied"] and first.body["version"] == 1
    assert again.body["duplicates"] == keys and store.version == 1
    # SGD, lr 0.1, weight decay 1e-4; momentum's first step is the gradient itself.
    expected = before - 0.1 * (grad + 1e-4 * before)
    assert torch.allclose(store.vars["w"], expected)


def test_a_fence_voids_a_push_still_arriving_on_the_side_channel(one: _PS) -> None:
    grad = torch.ones(N)
    sock = _side_socket(one)
    _send(sock, _push_header(grad, fence=["worker:0", 0]), _raw(grad)[:4096])
    _wait(lambda: one.server.partials() == 1)
    one.client.call("ps.fence", {"fence": ["worker:0", 1]})  # worker 0 relaunched
    assert one.server.partials() == 0
    sock.sendall(_raw(grad)[4096:])
    answer = _answer(sock)
    assert answer["k"] == "err" and answer["c"] == "protocol" and "dropped" in answer["b"]
    assert one.service.store.version == 0
    sock.close()


# -- bad input -------------------------------------------------------------------------


def _serves_on(ps: _PS) -> None:
    grad = torch.full((N,), 1e-3)
    version = ps.service.store.version
    assert ps.push(version, {"w": grad}, side=True).body["applied"]


def test_an_unknown_token_is_refused_and_the_connection_cut(one: _PS) -> None:
    offer = one.client.call("rpc.side").body
    host, _ = split_endpoint(one.server.target)
    with socket.create_connection((host, offer["port"]), timeout=30) as sock:
        _send(
            sock,
            {
                "v": codec.PROTOCOL_VERSION,
                "k": "req",
                "id": 0,
                "m": "side.hello",
                "b": {"token": "0" * 32},
            },
        )
        answer = _answer(sock)
        assert answer["k"] == "err" and "unknown or expired token" in answer["b"]
        assert _cut(sock)
    with socket.create_connection((host, offer["port"]), timeout=30) as sock:  # used once
        _send(
            sock,
            {
                "v": codec.PROTOCOL_VERSION,
                "k": "req",
                "id": 0,
                "m": "side.hello",
                "b": {"token": offer["token"]},
            },
        )
        assert _answer(sock)["k"] == "rep"
        _send(
            sock,
            {
                "v": codec.PROTOCOL_VERSION,
                "k": "req",
                "id": 0,
                "m": "side.hello",
                "b": {"token": offer["token"]},
            },
        )
        answer = _answer(sock)  # a hello again is a request with no method here
        assert answer["k"] == "err" and answer["c"] == "not_found"
    _serves_on(one)


@pytest.mark.parametrize(
    ("header", "code", "words"),
    [
        ({"t": [["g/w", "float32", [3], 999]]}, "bad_request", "does not fill"),
        ({"t": [["g/w", "complex64", [3], 24]]}, "bad_request", "descriptor"),
        ({"k": "mor", "s": 1}, "protocol", "as request"),
        ({"k": "prt", "s": 0}, "protocol", "as request"),
        ({"v": 99}, None, None),  # another protocol version: cut without a word
        ({"t": [["g/w", "float32", [2**40], 2**42]]}, "too_large", "exceeds the limit"),
    ],
    ids=["wrong-length", "bad-dtype", "a-part-of-no-request", "a-reply-part", "version", "huge"],
)
def test_a_malformed_request_is_refused_and_the_ps_serves_on(
    one: _PS, header: dict[str, Any], code: str | None, words: str | None
) -> None:
    sock = _side_socket(one)
    bad = {**_push_header(torch.ones(3)), **header}
    _send(sock, bad)
    answer = _answer(sock)
    if code is None:
        assert answer == {}
    else:
        assert answer["k"] == "err" and answer["c"] == code and words in answer["b"]
    assert _cut(sock)
    sock.close()
    assert one.service.store.version == 0
    _serves_on(one)


def test_a_header_longer_than_the_limit_is_refused_unread(one: _PS) -> None:
    sock = _side_socket(one)
    sock.sendall(struct.pack(">I", side_module.MAX_HEADER_BYTES + 1))
    assert _cut(sock)
    sock.close()
    _serves_on(one)


def test_a_refused_push_is_read_to_its_end_and_the_connection_serves_on(one: _PS) -> None:
    """A NaN in the first piece refuses the push; its later bytes are still read, so the
    connection stays in step: the next request on it is served."""
    grad = torch.ones(N)
    grad[5] = float("nan")
    sock = _side_socket(one)
    _send(sock, _push_header(grad), _raw(grad))
    answer = _answer(sock)
    assert answer["k"] == "err" and answer["c"] == "app" and "NaN" in answer["b"]
    good = torch.full((N,), 1e-3)
    _send(sock, _push_header(good, request_id=2), _raw(good))
    answer = _answer(sock)
    while answer["k"] == "prt":  # its values, streamed: not asked (no "sr"), so none
        answer = _answer(sock)
    assert answer["k"] == "rep" and answer["b"]["applied"]
    sock.close()


def test_a_request_for_no_such_method_is_read_to_its_end_and_the_connection_serves_on(
    one: _PS,
) -> None:
    grad = torch.ones(N)
    sock = _side_socket(one)
    _send(sock, {**_push_header(grad), "m": "ps.nothing"}, _raw(grad))
    answer = _answer(sock)
    assert answer["k"] == "err" and answer["c"] == "not_found" and "ps.nothing" in answer["b"]
    good = torch.full((N,), 1e-3)
    _send(sock, _push_header(good, request_id=2), _raw(good))
    answer = _answer(sock)
    assert answer["k"] == "rep" and answer["b"]["applied"]
    sock.close()


# -- deadlines and fallback ------------------------------------------------------------


def test_a_call_past_its_deadline_fails_and_the_next_is_served(
    one: _PS, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    check = one.service.store.check_piece

    def slow(name: str, piece: Any) -> None:
        release.wait(30)
        check(name, piece)

    monkeypatch.setattr(one.service.store, "check_piece", slow)
    grad = torch.full((N,), 1e-3)
    with pytest.raises(DeadlineExceeded):
        one.client.call("ps.push", *_body(grad), framed=True, side=True, deadline=0.5)
    release.set()
    monkeypatch.setattr(one.service.store, "check_piece", check)
    _wait(lambda: one.server.partials() == 0)
    version = one.service.store.version
    assert one.push(version, {"w": grad}, side=True).body["applied"]


def test_every_send_and_receive_has_a_deadline() -> None:
    writer, idle = socket.socketpair()  # a peer that never reads, nor writes
    try:
        with pytest.raises(DeadlineExceeded):
            end = time.monotonic() + 0.2
            side_module.send_message(writer, b"h", [bytes(64 * 1024 * 1024)], end, "a send")
        with pytest.raises(DeadlineExceeded):
            end = time.monotonic() + 0.2
            side_module.recv_into(writer, memoryview(bytearray(16)), end, "a receive")
    finally:
        writer.close()
        idle.close()


def test_a_connection_that_never_says_hello_is_cut(
    one: _PS, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(side_module, "HELLO_S", 0.2)
    offer = one.client.call("rpc.side").body
    host, _ = split_endpoint(one.server.target)
    with socket.create_connection((host, offer["port"]), timeout=30) as sock:
        assert _cut(sock)
    _serves_on(one)


def test_a_server_restarted_on_its_port_serves_the_next_side_call() -> None:
    """The link to the old server is dead: the client sees it before sending and opens
    one to the new server, instead of losing the call to the dead socket."""
    credentials = Credentials.generate()
    tensor = torch.arange(10.0)

    def serve(port: int) -> RpcServer:
        server = RpcServer(credentials, port=port)
        server.register("echo", _echo)
        assert server.enable_side_channel()
        return server.start()

    first = serve(0)
    port = first.port
    client = RpcClient(first.address, credentials, deadline=30)
    try:
        assert torch.equal(client.call("echo", None, {"x": tensor}, side=True).tensors["x"], tensor)
        first.stop()
        second = serve(port)

        def over_zeromq() -> bool:
            # A request written to the old connection before ZeroMQ saw it die is lost
            # (rpc/client.py): ZeroMQ's own reconnection is waited for first.
            try:
                client.call("echo", None, {"x": tensor}, deadline=1.0)
            except DeadlineExceeded:
                return False
            return True

        try:
            _wait(over_zeromq)
            reply = client.call("echo", None, {"x": tensor}, side=True)
            assert torch.equal(reply.tensors["x"], tensor)
        finally:
            second.stop()
    finally:
        client.close()
        first.stop()


def _body(grad: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return {"worker": "w", "version": 0, "want_values": True}, {"g/w": grad}


def test_a_server_without_a_side_channel_is_called_over_zeromq(
    caplog: pytest.LogCaptureFixture,
) -> None:
    credentials = Credentials.generate()
    with RpcServer(credentials) as server:
        server.register("echo", _echo)
        with RpcClient(server.address, credentials) as client, caplog.at_level(logging.INFO):
            tensor = torch.arange(10.0)
            for _ in range(2):
                reply = client.call("echo", None, {"x": tensor}, side=True)
                assert torch.equal(reply.tensors["x"], tensor)
    lines = [r for r in caplog.records if "no side channel" in r.getMessage()]
    assert len(lines) == 1  # one line, then ZeroMQ until it is worth trying again


def _echo(request: Any) -> Any:
    from clusterflow.rpc import Response

    return Response(None, {"x": request.tensors["x"].clone()})


def test_under_curve_the_ps_keeps_its_tensors_on_zeromq(
    received: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    ps = _PS(Credentials.generate(mode="curve"))
    try:
        ps.setup(OPTIMIZERS["sgd"])
        with caplog.at_level(logging.INFO):
            assert ps.push(0, _grads(1)[0], side=True).body["applied"]
        assert received == []
        # The client never even asks: its bytes must stay encrypted whatever a server offers.
        assert not [r for r in caplog.records if "no side channel" in r.getMessage()]
        with pytest.raises(RemoteError) as refused:
            ps.client.call("rpc.side")
        assert refused.value.code == "not_found"
    finally:
        ps.close()
