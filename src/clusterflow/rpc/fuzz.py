"""Hostile frames for a live ``RpcServer``: the wire fuzzer of tests and benchmarks.

A server must survive what a port scanner or a broken peer sends (docs/failure-semantics.md,
"Hostile bytes"): garbage before the handshake, and, from a peer that holds the cluster's
secret, malformed frames, truncated msgpack, other protocol versions, absurd sizes,
unknown methods and contract-breaking bodies. Each gets an error reply or a dropped
connection; the process stays up and keeps serving good clients.

``hostile_message`` builds one such message from a ``random.Random``, so a seed replays
a run (the benchmark draws 100 000 of them); the tests draw theirs with hypothesis.
``WireProbe`` sends them as an authenticated peer and counts the answers;
``raw_garbage`` sends bytes that are not ZMTP at all.

Well-formed requests that change a cluster's state (``manager.stop``, ``ps.quiesce``,
``manager.exited`` naming a real task) are not hostile bytes but a member's orders: the
secret is the trust boundary, so ``FIELDS`` leaves those methods out and no hostile
value names a real task. A well-formed ``trial.report`` only appends a line to the
manager's report file, which nothing reads outside a tuning study.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from clusterflow.cluster.contract import ManagerMethod
from clusterflow.rpc import codec, runtime
from clusterflow.rpc.auth import Credentials

FIELDS: Mapping[str, tuple[str, ...]] = {
    "health.ping": (),
    "ps.create": ("config", "vars"),
    "ps.optimizer": ("spec", "group_of"),
    "ps.pull": ("names", "min_version", "timeout", "dtype"),
    "ps.push": ("worker", "version", "keys", "hyper", "commit", "timeout", "values_dtype"),
    "ps.apply": ("version", "workers"),
    "ps.wait_version": ("version", "timeout"),
    "ps.state": (),
    "ps.stats": (),
    "data.register": ("spec", "locations"),
    "data.lease": ("name", "worker", "host", "incarnation", "acks", "count"),
    "data.ack": ("name", "leases", "worker"),
    "data.release": ("name", "worker", "leases"),
    "data.status": ("name",),
    "data.state_dict": (),
    ManagerMethod.HEARTBEAT: ("task",),
    ManagerMethod.DECLARE: ("task", "respawnable", "resizable"),
    ManagerMethod.CHECKPOINTS: ("task", "url"),
    ManagerMethod.EXITED: ("task", "code", "error"),
    ManagerMethod.REGISTER: ("task", "pid", "address"),
    ManagerMethod.STANDBY: ("pid", "wait_s"),
    ManagerMethod.STATUS: (),
    ManagerMethod.SPEC: (),
    ManagerMethod.REPORT: ("task", "step", "loss", "samples_per_s"),
    ManagerMethod.TRIAL_REPORT: ("step", "metrics"),
}
"""Methods the fuzzer calls with hostile bodies, and the body keys each one reads."""

SAFE_METHODS: tuple[str, ...] = tuple(FIELDS)
"""Every method above: none changes a cluster's course when its body is nonsense.
(``manager.scale`` is not one: a body of a small whole number resizes the cluster.)"""

_ATOMS: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    -0.5,
    "",
    "worker:",
    "ps:-1",
    "chief:99999999999999999999",
    "x" * 4096,
    "\x00\u2603",
    b"",
    b"\xff" * 64,
    [],
    {},
    [1, 2, 3],
    [["d", 0, 0]],
    [["d", -1, 2**63 - 1]],
    {"a": 1},
    {1: 2},
    "float32",
    "complex128",
    "bfloat16",
)


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 3 or roll < 0.6:
        return rng.choice(_ATOMS)
    if roll < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(("a", "name", "version", "x")): _value(rng, depth + 1)}


def _body(rng: random.Random, method: str) -> Any:
    keys = FIELDS.get(method, ())
    roll = rng.random()
    if roll < 0.1 or not keys:
        return _value(rng)
    return {k: _value(rng) for k in keys if rng.random() < 0.7}


def _descriptors(rng: random.Random) -> tuple[list[Any], list[bytes]]:
    """Tensor descriptors that lie about the frames after them (or, sometimes, do not)."""
    dtype = rng.choice((*codec.DTYPES, "complex64", "", "object"))
    shape: Any = rng.choice(([4], [2**62, 2**62], [-1], [], [0, 2**63 - 1], [1] * 40, "4", [1.5]))
    nbytes: Any = rng.choice((16, 0, -16, 2**62, 2**64 - 1, 3, "16", None))
    frames = [rng.randbytes(rng.choice((0, 3, 16, 17)))] * rng.randrange(3)
    return [["t", dtype, shape, nbytes]] if rng.random() < 0.8 else [_value(rng)], frames


def _header(rng: random.Random, method: str, request_id: int) -> dict[Any, Any]:
    header: dict[Any, Any] = {
        "v": codec.PROTOCOL_VERSION,
        "k": codec.KIND_REQUEST,
        "id": request_id,
        "m": method,
    }
    body = _body(rng, method)
    if body is not None:
        header["b"] = body
    return header


def hostile_message(
    rng: random.Random, methods: Sequence[str], request_id: int
) -> tuple[list[bytes], bool]:
    """One hostile message, and whether a well-behaved server must answer it.

    Answer expected: every message whose header a server can read as a request of
    ``request_id`` (``id`` stays intact in most cases so that the answer can be matched).
    """
    method = rng.choice(methods)
    kind = rng.randrange(11)
    header = _header(rng, method, request_id)
    if kind == 0:  # random bytes where the header belongs
        return [rng.randbytes(rng.randrange(64))], True
    if kind == 1:  # truncated msgpack
        raw = msgpack.packb(header, use_bin_type=True)
        return [raw[: rng.randrange(max(1, len(raw)))]], True
    if kind == 2:  # another protocol version
        header["v"] = rng.choice((0, 2, 99, -1, "1", None, 1.0 + 1e-9))
        return [msgpack.packb(header, use_bin_type=True)], True
    if kind == 3:  # a header of the wrong shape
        broken: Any = rng.choice(
            (
                [header],
                {**header, "k": rng.choice(("rep", "err", "", 7))},
                {**header, "m": rng.choice((None, 5, b"ps.pull", ["m"]))},
                {k: v for k, v in header.items() if k != "id"},
                {**header, "id": rng.choice((None, "1", 1.5, -(2**63)))},
                42,
                None,
            )
        )
        packed = msgpack.packb(broken, use_bin_type=True)
        return [packed], True
    if kind == 4:  # an unknown method
        header["m"] = rng.choice(("", "ps.", "no.such", "x" * 2048, "\u2603", method + ".x"))
        return [msgpack.packb(header, use_bin_type=True)], True
    if kind == 5:  # tensors whose descriptors lie
        descriptors, frames = _descriptors(rng)
        header["t"] = descriptors
        return [msgpack.packb(header, use_bin_type=True), *frames], True
    if kind == 6:  # frames nobody announced
        extra = [rng.randbytes(rng.randrange(32)) for _ in range(1 + rng.randrange(4))]
        return [msgpack.packb(header, use_bin_type=True), *extra], True
    if kind == 7:  # deep nesting
        deep: Any = 0
        for _ in range(rng.choice((50, 500, 5000))):
            deep = [deep]
        header["b"] = deep
        try:
            return [msgpack.packb(header, use_bin_type=True)], True
        except ValueError:  # msgpack's own nesting limit on the sending side
            return [b"\x91" * 100_000], True
    if kind == 8:  # a one-way message with a hostile body (no answer is owed)
        header["k"] = codec.KIND_ONEWAY
        return [msgpack.packb(header, use_bin_type=True)], False
    if kind == 9:  # a msgpack length prefix far beyond the frame
        prefix = rng.choice(
            (b"\xdb\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff", b"\xdd\xff\xff\xff\xf0")
        )
        return [b"\x85" + b"\xa1v\x01\xa1k\xa3req\xa2id" + prefix], True
    # a well-formed request of a known method with a contract-breaking body
    return [msgpack.packb(header, use_bin_type=True)], True


@dataclass(slots=True)
class ProbeResult:
    """What one ``WireProbe.run`` saw."""

    sent: int = 0
    owed: int = 0
    """Messages a well-behaved server must answer."""
    answered: int = 0
    """Answers that came back (error replies and replies), matched by id or not."""
    unanswered_ids: list[int] = field(default_factory=list)
    malformed_answers: int = 0
    internal: dict[str, int] = field(default_factory=dict)
    """Error replies of code ``internal`` per method: a handler raised what its contract
    should have refused as a bad request (a server bug, though answered)."""


class WireProbe:
    """An authenticated DEALER that sends raw frames to one server and reads its answers.

    Args:
        address: ``host:port`` of the server.
        credentials: the cluster's secret (the probe is an insider gone wrong).
    """

    def __init__(self, address: str, credentials: Credentials) -> None:
        host = address.rsplit(":", 1)[0].strip("[]")
        self._ctx = runtime.context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.sndhwm = 0
        self._sock.rcvhwm = 0
        credentials.apply_client(self._sock, host)
        self._sock.connect(f"tcp://{address}")

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> WireProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        messages: Iterable[tuple[list[bytes], bool, int]],
        *,
        answer_timeout_s: float,
        window: int = 64,
    ) -> ProbeResult:
        """Sends every ``(frames, owed, id)``, at most ``window`` owed answers in flight.

        Waits at most ``answer_timeout_s`` for each window's answers; an owed answer that
        does not come by then is listed in ``unanswered_ids``.
        """
        result = ProbeResult()
        pending: set[int] = set()
        for frames, owed, request_id in messages:
            self._sock.send_multipart(frames, copy=True)
            result.sent += 1
            if owed:
                result.owed += 1
                pending.add(request_id)
            if len(pending) >= window:
                self._collect(pending, result, answer_timeout_s)
        self._collect(pending, result, answer_timeout_s)
        return result

    def _collect(self, pending: set[int], result: ProbeResult, timeout_s: float) -> None:
        """Reads answers until as many came as ``pending`` holds, or the time runs out.

        Answers are counted, not matched: a header the server cannot read is answered
        with the id it could guess (often 0), and that still is the answer owed.
        """
        end = time.monotonic() + timeout_s
        owed = len(pending)
        while owed:
            remaining = int((end - time.monotonic()) * 1000)
            if remaining <= 0 or not self._sock.poll(remaining):
                break
            frames = self._sock.recv_multipart()
            result.answered += 1
            owed -= 1
            try:
                header = codec.decode_header(frames[0])
            except Exception:
                result.malformed_answers += 1
                continue
            pending.discard(header["id"])
            if header["k"] == codec.KIND_ERROR and header.get("c") == "internal":
                method = str(header.get("m"))
                result.internal[method] = result.internal.get(method, 0) + 1
        if owed:
            result.unanswered_ids.extend(sorted(pending)[:owed])
        pending.clear()


def hostile_stream(
    seed: int, methods: Sequence[str], count: int, first_id: int = 1_000_000
) -> Iterable[tuple[list[bytes], bool, int]]:
    """``count`` seeded hostile messages as ``WireProbe.run`` takes them."""
    rng = random.Random(seed)
    for i in range(count):
        request_id = first_id + i
        frames, owed = hostile_message(rng, methods, request_id)
        yield frames, owed, request_id


def raw_garbage(address: str, payload: bytes, timeout_s: float = 2.0) -> bool:
    """Sends bytes that are no ZMTP handshake; True if the server hung up within the timeout.

    A server that keeps the connection open is not at fault (ZMTP waits for a greeting);
    the caller judges only that the server keeps serving others.
    """
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):
                pass
        except OSError:
            return True
        except TimeoutError:
            return False
    return True
