"""Calls without tensors, the common ones: the client reads every reply to one as it
must, the odd ones too, and the server's short path for them (``RpcServer._serve_small``)
answers as its general path does.

The client tests talk to a hand-built ROUTER that answers as a faulty or a busy server
would; the server tests use a real ``RpcServer``. Every socket, client and server is
closed by a fixture finalizer, failure or not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

from clusterflow.rpc import (
    PROTOCOL_VERSION,
    Credentials,
    ProtocolError,
    RemoteError,
    Request,
    Response,
    RpcClient,
    RpcServer,
)
from clusterflow.rpc.auth import stop_authenticators

integration = pytest.mark.integration
pytestmark = [integration, pytest.mark.timeout(60)]

Answer = Callable[[dict[str, Any]], list[list[bytes]]]
"""What the hand-built server sends for one request header: a list of messages."""


def _packed(kind: str, request_id: int, body: Any = None, **extra: Any) -> bytes:
    header = {"v": PROTOCOL_VERSION, "k": kind, "id": request_id, "m": "m", "b": body}
    header.update(extra)
    return msgpack.packb(header)


@pytest.fixture
def credentials() -> Credentials:
    return Credentials.generate()


@pytest.fixture
def answering(credentials: Credentials) -> Iterator[Callable[[Answer], RpcClient]]:
    """A client of a ROUTER that answers each request with ``answer(header)``'s messages."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    credentials.apply_server(router, "127.0.0.1")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    answers: list[Answer] = []
    clients: list[RpcClient] = []

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, request = router.recv_multipart()
            header = msgpack.unpackb(request, raw=False)
            for message in answers[0](header):
                router.send_multipart([identity, *message])

    thread = threading.Thread(target=serve, name="answering-router", daemon=True)

    def make(answer: Answer) -> RpcClient:
        answers.append(answer)
        thread.start()
        client = RpcClient(f"127.0.0.1:{port}", credentials, deadline=5.0)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
    stop.set()
    if thread.is_alive():
        thread.join(5)
    router.close(linger=0)
    stop_authenticators(ctx)
    ctx.destroy(linger=0)


def test_a_reply_to_another_request_is_passed_over_for_its_own(
    answering: Callable[[Answer], RpcClient],
) -> None:
    client = answering(
        lambda header: [
            [_packed("rep", header["id"] + 1000, "someone else's")],
            [_packed("rep", header["id"], header.get("b"))],
        ]
    )
    for turn in range(3):
        assert client.call("m", turn).body == turn


def test_an_error_reply_raises_its_remote_error(
    answering: Callable[[Answer], RpcClient],
) -> None:
    client = answering(
        lambda header: [[_packed("err", header["id"], "no such thing", c="not_found", e="")]]
    )
    for _ in range(3):  # an error reply keeps the socket
        with pytest.raises(RemoteError) as info:
            client.call("m")
        assert info.value.code == "not_found"


def _bad_unless_ok(bad: Callable[[int], list[bytes]]) -> Answer:
    """Answers a request whose body is "ok" rightly, any other with ``bad(its id)``.

    A failed call drops the client's socket: a good call before each bad one shows the
    client serves on after it.
    """

    def answer(header: dict[str, Any]) -> list[list[bytes]]:
        if header.get("b") == "ok":
            return [[_packed("rep", header["id"], "ok")]]
        return [bad(header["id"])]

    return answer


def test_a_reply_naming_tensors_it_does_not_carry_is_a_protocol_error(
    answering: Callable[[Answer], RpcClient],
) -> None:
    client = answering(
        _bad_unless_ok(lambda at: [_packed("rep", at, t=[["x", "float32", [1], 4]])])
    )
    for _ in range(3):
        assert client.call("m", "ok").body == "ok"
        with pytest.raises(ProtocolError, match="frames hold 0 of 4 bytes"):
            client.call("m")


def test_a_reply_carrying_frames_its_header_does_not_name_is_a_protocol_error(
    answering: Callable[[Answer], RpcClient],
) -> None:
    client = answering(_bad_unless_ok(lambda at: [_packed("rep", at), b"\x00" * 4]))
    for _ in range(3):
        assert client.call("m", "ok").body == "ok"
        with pytest.raises(ProtocolError, match="unexpected frames"):
            client.call("m")


@pytest.fixture
def server(credentials: Credentials) -> Iterator[RpcServer]:
    server = RpcServer(credentials)
    yield server
    server.stop()


@pytest.fixture
def client(server: RpcServer, credentials: Credentials) -> Iterator[RpcClient]:
    client = RpcClient(server.address, credentials, deadline=5.0)
    yield client
    client.close()


def test_an_inline_handler_answers_a_call_without_tensors_with_tensors(
    server: RpcServer, client: RpcClient
) -> None:
    server.register("ones", lambda request: Response(request.body, {"x": torch.ones(3)}))
    server.start()
    for turn in range(3):
        reply = client.call("ones", turn)
        assert reply.body == turn
        assert torch.equal(reply.tensors["x"], torch.ones(3))


def test_an_inline_handlers_on_sent_is_called_for_a_reply_without_tensors(
    server: RpcServer, client: RpcClient
) -> None:
    trackers: list[zmq.MessageTracker] = []

    def handler(request: Request) -> Response:
        return Response(request.body, on_sent=trackers.append)

    server.register("tracked", handler)
    server.start()
    for turn in range(3):
        assert client.call("tracked", turn).body == turn
    assert len(trackers) == 3
    assert all(tracker.done for tracker in trackers)
