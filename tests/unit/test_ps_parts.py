"""A push sent in parts, its reply streamed back as the ps steps it (issue 28).

ZeroMQ hands a message over only whole, so a 64 MiB push in one message leaves the
ps's finite check, its step and its reply until the last byte came. ``RemotePS`` sends
a push as several messages (``codec.encode_parts``): the ps checks each as it arrives
(``RpcServer.register``'s ``check``) while the next is on the wire, applies the push
once the last came, and sends each group of a large variable's chunks back as soon as
it is stepped (``Request.stream``, ``VariableStore._streamed_step``).

These tests hold that path to the one-message one bit for bit (float32 and bfloat16
gradients, two optimizers, embedding rows) and pin its rules: nothing of a push
applies before its last part came, so a NaN in a late part, a peer that dies mid-push,
a fence that replaces the pushing worker and misordered parts all leave no trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

from clusterflow.ps.api import PSConfig
from clusterflow.ps.service import PSService
from clusterflow.ps.store import VariableStore
from clusterflow.rpc import Credentials, RpcClient, codec, runtime
from clusterflow.rpc.client import split_endpoint
from clusterflow.server import Server, create_local_server

pytestmark = pytest.mark.timeout(120)

N = 2 * 1024 * 1024 + 12_345
"""8 MiB of float32: 17 chunks, the last one short."""
PART = 1024 * 1024
"""Parts of 1 MiB: a push of ``w`` travels in 9 messages (its reply in groups of
``codec.PART_BYTES``, the ps's own cut)."""
OPTIMIZERS = {
    "sgd": {"name": "SGD", "groups": [{"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}]},
    "adam": {"name": "Adam", "groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}]},
}


def _bits(t: Any) -> torch.Tensor:
    t = t.join() if isinstance(t, codec.Framed) else t
    return t.contiguous().view(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    return torch.equal(_bits(a), _bits(b))


class _PS:
    """One ps task served over RPC, with a client."""

    def __init__(self) -> None:
        self.credentials = Credentials.generate()
        self.server: Server = create_local_server(credentials=self.credentials)
        self.service = PSService(self.server)
        self.client = RpcClient(self.server.target, self.credentials, deadline=60)

    @property
    def store(self) -> VariableStore:
        return self.service.store

    def setup(self, spec: dict[str, Any]) -> None:
        decl = [
            {"name": "w", "shape": [N], "dtype": "float32"},
            {"name": "b", "shape": [7], "dtype": "float32"},
        ]
        values = {"w": torch.linspace(-1, 1, N), "b": torch.arange(7.0)}
        config = {"mode": "async", "num_replicas": 1}
        self.client.call("ps.create", {"config": config, "vars": decl}, values)
        self.client.call("ps.optimizer", {"spec": spec, "group_of": {"w": 0, "b": 0}})

    def dealer(self) -> zmq.Socket[bytes]:
        """A bare peer socket, to send parts one by one as a client mid-call would."""
        sock = runtime.context().socket(zmq.DEALER)
        sock.linger = 0
        self.credentials.apply_client(sock, "127.0.0.1")
        sock.connect(split_endpoint(self.server.target)[1])
        return sock

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def pair() -> Iterator[tuple[_PS, _PS]]:
    made: list[_PS] = []
    try:
        made += [_PS(), _PS()]
        yield made[0], made[1]
    finally:
        for ps in made:
            ps.close()


@pytest.fixture
def one() -> Iterator[_PS]:
    ps = _PS()
    try:
        yield ps
    finally:
        ps.close()


def _grads(steps: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        {"g/w": (torch.randn(N, generator=gen) * 1e-2).to(dtype), "g/b": torch.randn(7).to(dtype)}
        for _ in range(steps)
    ]


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_a_push_in_parts_with_a_streamed_reply_equals_one_message_bit_for_bit(
    pair: tuple[_PS, _PS], opt: str, wire: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, parted = pair
    for ps in pair:
        ps.setup(OPTIMIZERS[opt])
    finite: list[set[str]] = []
    groups: list[int] = []
    check, step_group = VariableStore._check, VariableStore._step_group

    def spy_check(self: VariableStore, grads: Any, done: Any = ()) -> Any:
        finite.append(set(done))
        return check(self, grads, done)

    def spy_group(opt: Any, stream: Any, group: list[torch.Tensor], frames: Any) -> None:
        groups.append(len(group))
        step_group(opt, stream, group, frames)

    monkeypatch.setattr(VariableStore, "_check", spy_check)
    monkeypatch.setattr(VariableStore, "_step_group", staticmethod(spy_group))
    for version, grads in enumerate(_grads(3, getattr(torch, wire))):
        body = {"worker": "w", "version": version, "want_values": True}
        one = whole.client.call("ps.push", body, grads, framed=True)
        many = parted.client.call(
            "ps.push", body, grads, framed=True, part_bytes=PART, streamed=True
        )
        assert one.body == many.body and many.body["applied"]
        assert set(many.tensors) == {"w", "b"}
        for name in ("w", "b"):
            assert _same(one.tensors[name], many.tensors[name]), name
    # The parted ps checked every frame as it came (the store did not check again) and
    # stepped w a group at a time, each sent as it was stepped.
    assert finite == [set(), {"w", "b"}] * 3
    assert sum(groups) == 3 * 17 and max(groups) == codec.PART_BYTES // codec.FRAME_BYTES
    for name in ("w", "b"):
        assert _same(whole.store.vars[name], parted.store.vars[name]), name
    meta, tensors = whole.store.state()
    meta2, tensors2 = parted.store.state()
    assert meta == meta2 and tensors.keys() == tensors2.keys()
    for key, value in tensors.items():
        assert _same(value, tensors2[key]), key


def _untouched(ps: _PS) -> None:
    """Nothing of a push reached the store: values, version, keys as created."""
    assert ps.store.version == 0
    assert _same(ps.store.vars["w"], torch.linspace(-1, 1, N))
    assert _same(ps.store.vars["b"], torch.arange(7.0))
    assert not ps.store.applied.applied([("d", 0, 1)])


def test_a_nan_in_a_late_part_refuses_the_whole_push(
    one: _PS, monkeypatch: pytest.MonkeyPatch
) -> None:
    one.setup(OPTIMIZERS["sgd"])
    grads = _grads(1, torch.float32)[0]
    grads["g/w"][-1] = float("nan")  # in the last part
    body = {"worker": "w", "version": 0, "keys": [["d", 0, 1]], "want_values": True}
    with pytest.raises(Exception, match="NaN or Inf"):
        one.client.call("ps.push", body, grads, part_bytes=PART, streamed=True)
    _untouched(one)
    assert one.server.partials() == 0
    assert one.client.call("ps.stats").body["version"] == 0  # and it serves on


def _parts(version: int, fence: list[Any] | None = None, wait: float = 60.0) -> list[list[Any]]:
    body: dict[str, Any] = {"worker": "w", "version": version, "keys": [["d", 0, 1]]}
    if fence is not None:
        body["fence"] = fence
    grads = _grads(1, torch.float32)[0]
    return codec.encode_parts(
        codec.KIND_REQUEST, 5, "ps.push", body, grads, part_bytes=PART, dl=wait
    )


def _send(sock: zmq.Socket[bytes], messages: list[list[Any]]) -> None:
    for frames in messages:
        sock.send_multipart(frames)


def _answer(sock: zmq.Socket[bytes]) -> dict[str, Any]:
    assert sock.poll(30_000), "no answer from the ps"
    return codec.decode_header(sock.recv_multipart()[0])


def _until(done: Callable[[], bool], what: str, poke: Callable[[], Any] = lambda: None) -> None:
    """Waits until ``done()`` (calling ``poke`` between looks), 30 s at most."""
    end = time.monotonic() + 30
    while not done():
        assert time.monotonic() < end, f"never: {what}"
        poke()


def test_a_fence_drops_the_replaced_workers_push_in_parts(one: _PS) -> None:
    one.setup(OPTIMIZERS["sgd"])
    messages = _parts(0, fence=["worker:0", 0])
    assert len(messages) > 3
    sock = one.dealer()
    try:
        _send(sock, messages[:2])
        _until(lambda: one.server.partials() == 1, "the first parts arrived")
        one.client.call("ps.fence", {"fence": ["worker:0", 1]})  # worker 0 relaunched
        assert one.server.partials() == 0
        _send(sock, messages[2:])  # the rest of the old incarnation's push
        answer = _answer(sock)
    finally:
        sock.close(linger=0)
    assert answer["k"] == codec.KIND_ERROR and "no request in progress" in answer["b"]
    _untouched(one)


def test_a_peer_that_dies_mid_push_leaves_no_trace(one: _PS) -> None:
    one.setup(OPTIMIZERS["sgd"])
    sock = one.dealer()
    try:
        _send(sock, _parts(0, wait=0.2)[:3])  # then the worker dies
        _until(lambda: one.server.partials() == 1, "the first parts arrived")
    finally:
        sock.close(linger=0)
    # Its parts go at their deadline, read as the next message arrives.
    _until(
        lambda: one.server.partials() == 0, "the parts expired", lambda: one.client.call("ps.stats")
    )
    _untouched(one)
    grads = _grads(1, torch.float32)[0]
    body = {"worker": "w", "version": 0, "keys": [["d", 0, 1]]}
    assert one.client.call("ps.push", body, grads, part_bytes=PART).body["applied"]
    assert one.store.version == 1 and one.store.applied.applied([("d", 0, 1)])


def test_a_new_request_drops_the_unfinished_one_of_its_peer(one: _PS) -> None:
    one.setup(OPTIMIZERS["sgd"])
    sock = one.dealer()
    try:
        _send(sock, _parts(0)[:2])
        _until(lambda: one.server.partials() == 1, "the first parts arrived")
        sock.send_multipart(codec.encode(codec.KIND_REQUEST, 9, "ps.stats"))
        answer = _answer(sock)
    finally:
        sock.close(linger=0)
    assert answer["k"] == codec.KIND_REPLY and answer["id"] == 9
    assert one.server.partials() == 0
    _untouched(one)


def test_misordered_parts_are_refused_and_the_ps_serves_on(one: _PS) -> None:
    one.setup(OPTIMIZERS["sgd"])
    messages = _parts(0)
    sock = one.dealer()
    try:
        _send(sock, [messages[0], messages[2]])  # the second part skipped
        answer = _answer(sock)
        stray = {"v": codec.PROTOCOL_VERSION, "k": codec.KIND_MORE, "id": 77, "m": "ps.push"}
        sock.send_multipart([msgpack.packb({**stray, "s": 1}), b"\x00" * 8])  # no request 77
        unknown = _answer(sock)
    finally:
        sock.close(linger=0)
    assert answer["k"] == codec.KIND_ERROR and answer["id"] == 5
    assert "part 2 of request 5 came where part 1" in answer["b"]
    assert unknown["k"] == codec.KIND_ERROR and "no request in progress" in unknown["b"]
    assert one.server.partials() == 0
    _untouched(one)
    assert one.client.call("ps.stats").body["version"] == 0


def test_parts_holding_more_bytes_than_their_header_describes_are_refused(one: _PS) -> None:
    one.setup(OPTIMIZERS["sgd"])
    messages = _parts(0)
    messages[-1].append(b"\x00" * 64)  # a frame beyond every tensor's bytes
    sock = one.dealer()
    try:
        _send(sock, messages)
        answer = _answer(sock)
    finally:
        sock.close(linger=0)
    assert answer["k"] == codec.KIND_ERROR and "after every tensor's bytes" in answer["b"]
    _untouched(one)


class _Kept:
    """A reply stream whose parts never leave (a reply still in flight)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.pieces: list[torch.Tensor] = []

    def begin(self, tensors: Any) -> None:
        self.names = list(tensors)

    def send(self, frames: Any) -> None:
        self.pieces.extend(torch.frombuffer(f, dtype=torch.float32) for f in frames)


def test_values_streamed_in_a_reply_in_flight_are_never_written_by_the_next_push() -> None:
    from clusterflow.ps.loans import Loan
    from clusterflow.ps.optimizer import OptimizerSpec

    store = VariableStore(0)
    store.create(
        PSConfig(mode="async", num_replicas=1),
        [{"name": "w", "shape": [N], "dtype": "float32"}],
        {"w": torch.linspace(-1, 1, N)},
    )
    store.set_optimizer(OptimizerSpec.from_dict(OPTIMIZERS["sgd"]), {"w": 0})
    grads = [g["g/w"] for g in _grads(2, torch.float32)]
    kept = _Kept()
    result = store.push(
        worker="w", version=0, grads={"w": grads[0]}, want_values=True, lend=Loan(), stream=kept
    )
    assert result.applied and result.values == {} and kept.names == ["w"]
    assert sum(p.numel() for p in kept.pieces) == N
    sent = [p.clone() for p in kept.pieces]
    store.push(worker="w", version=1, grads={"w": grads[1]})
    # The second step wrote a copy: the reply's pieces still read the first step's values.
    assert store.stats["copied_on_write"] == 1
    assert all(_same(p, s) for p, s in zip(kept.pieces, sent, strict=True))
    assert not _same(store.vars["w"][: sent[0].numel()], sent[0])
