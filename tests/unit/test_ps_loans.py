"""Replies from the ps's live variables (``ps/loans.py``): never torn by a later push.

In process, a loan that is not yet sent stands for a reply still in flight. Over real
sockets, a TCP relay holds a large reply half-sent while another worker pushes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from clusterflow.ps.api import PSConfig
from clusterflow.ps.loans import Loan
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.service import PSService
from clusterflow.ps.store import VariableStore
from clusterflow.rpc import Credentials, RpcClient
from clusterflow.server import create_local_server

ASYNC = PSConfig(mode="async", num_replicas=2)


class _Done:
    done = True


def _store(momentum: float = 0.0) -> VariableStore:
    store = VariableStore(0)
    decl = [
        {"name": "w", "shape": [3], "dtype": "float32"},
        {"name": "count", "shape": [], "dtype": "int64", "trainable": False},
    ]
    store.create(ASYNC, decl, {"w": torch.zeros(3), "count": torch.tensor(0)})
    store.set_optimizer(OptimizerSpec("SGD", ({"lr": 1.0, "momentum": momentum},)), {"w": 0})
    return store


def _push(store: VariableStore, lend: Loan | None = None, **extra: Any) -> Any:
    return store.push(
        worker="worker:0", version=store.version, grads={"w": torch.ones(3)}, lend=lend, **extra
    )


def test_a_write_meeting_a_reply_in_flight_moves_the_variable_to_a_copy() -> None:
    store, plain = _store(momentum=0.9), _store(momentum=0.9)
    loan = Loan()
    _, lent = store.pull(["w"], lend=loan)
    assert lent["w"].data_ptr() == store.vars["w"].data_ptr()  # no snapshot
    _push(store, buffers={"count": torch.tensor(7)})
    _push(plain, buffers={"count": torch.tensor(7)})
    assert torch.equal(lent["w"], torch.zeros(3))  # the reply still reads version 0
    assert store.snapshot_stats()["copied_on_write"] == 1
    _push(store)
    _push(plain)  # momentum stayed attached to the moved variable
    assert torch.equal(store.vars["w"], plain.vars["w"])
    assert int(store.vars["count"]) == 7


def test_once_the_reply_left_a_write_is_in_place() -> None:
    store = _store()
    loan = Loan()
    result = _push(store, loan, want_values=True)
    assert result.values["w"].data_ptr() == store.vars["w"].data_ptr()
    loan.sent(_Done())
    address = store.vars["w"].data_ptr()
    _push(store)
    assert store.vars["w"].data_ptr() == address
    assert "copied_on_write" not in store.snapshot_stats()
    assert torch.equal(store.vars["w"], torch.full((3,), -2.0))


def test_without_a_loan_replies_are_snapshots() -> None:
    store = _store()
    values = _push(store, want_values=True).values
    _push(store)
    assert torch.equal(values["w"], torch.full((3,), -1.0))
    assert "copied_on_write" not in store.snapshot_stats()


# Over real sockets ----------------------------------------------------------------

N = 8 * 1024 * 1024
"""32 MiB of float32: far more than loopback's socket buffers hold, so a held relay
keeps most of a reply inside the ps's ZeroMQ."""


class _Relay:
    """A TCP relay whose ps-to-worker direction can stop mid-message until released."""

    def __init__(self, port: int) -> None:
        self._port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.hold_after: int | None = None
        """Once set: bytes passed downstream before the relay holds."""
        self.held = threading.Event()
        self.release = threading.Event()
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            down, _ = self.listener.accept()
        except OSError:
            return
        up = socket.socket()
        up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        up.connect(("127.0.0.1", self._port))
        self._sockets += [down, up]
        threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
        self._pump(up, down, True)

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        passed = 0
        try:
            while data := src.recv(64 * 1024):
                if downstream and self.hold_after is not None:
                    passed += len(data)
                    if passed >= self.hold_after and not self.release.is_set():
                        self.held.set()
                        self.release.wait(30)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.release.set()
        for sock in self._sockets:
            sock.close()


@pytest.fixture
def ps() -> Iterator[tuple[Any, RpcClient, RpcClient, _Relay]]:
    credentials = Credentials.generate()
    server = create_local_server(credentials=credentials)
    service = PSService(server)
    relay = _Relay(int(server.target.rsplit(":", 1)[1]))
    direct = RpcClient(server.target, credentials, deadline=30)
    relayed = RpcClient(f"127.0.0.1:{relay.port}", credentials, deadline=30)
    try:
        direct.call(
            "ps.create",
            {"config": ASYNC.to_dict(), "vars": [{"name": "w", "shape": [N], "dtype": "float32"}]},
            {"w": torch.zeros(N)},
        )
        spec = {"name": "SGD", "groups": [{"lr": 1.0}]}
        direct.call("ps.optimizer", {"spec": spec, "group_of": {"w": 0}})
        yield service, direct, relayed, relay
    finally:
        relay.close()
        relayed.close()
        direct.close()
        server.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("held_call", ["pull", "push"])
def test_a_push_while_a_large_reply_is_in_flight_leaves_that_reply_whole(
    ps: tuple[Any, RpcClient, RpcClient, _Relay], held_call: str
) -> None:
    service, direct, relayed, relay = ps
    relayed.call("ps.stats")  # connected through the relay before it holds anything
    relay.hold_after = 1 << 20
    replies: list[Any] = []

    def call() -> None:
        if held_call == "pull":
            replies.append(relayed.call("ps.pull", {"names": ["w"]}))
        else:
            body = {"worker": "worker:1", "version": 0, "want_values": True}
            replies.append(relayed.call("ps.push", body, {"g/w": torch.ones(N)}))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    try:
        assert relay.held.wait(30), "the reply never reached the relay"
        before = held_call == "push"  # the held push applied first: version 1, -1.0
        body = {"worker": "worker:0", "version": int(before), "want_values": True}
        pushed = direct.call("ps.push", body, {"g/w": torch.full((N,), 2.0)})
        assert pushed.body["applied"] and pushed.body["version"] == 1 + before
        assert torch.equal(pushed.tensors["w"], torch.full((N,), -2.0 - before))
    finally:
        relay.release.set()
        thread.join(30)
    (reply,) = replies
    assert reply.body["version"] == int(before)
    assert torch.equal(reply.tensors["w"], torch.full((N,), -float(before)))
    assert service.store.snapshot_stats()["copied_on_write"] == 1


@pytest.mark.timeout(60)
def test_a_reply_that_left_returns_its_loan_and_the_next_push_is_in_place(
    ps: tuple[Any, RpcClient, RpcClient, _Relay],
) -> None:
    service, direct, _, _ = ps
    pulled = direct.call("ps.pull", {"names": ["w"]})
    assert torch.equal(pulled.tensors["w"], torch.zeros(N))
    deadline = time.monotonic() + 30
    while service.store.lent("w"):  # ZeroMQ lets go of the frames on its own threads
        assert time.monotonic() < deadline, "the reply's loan never came back"
        time.sleep(0.01)
    body = {"worker": "worker:0", "version": 0}
    assert direct.call("ps.push", body, {"g/w": torch.ones(N)}).body["applied"]
    assert "copied_on_write" not in service.store.snapshot_stats()
