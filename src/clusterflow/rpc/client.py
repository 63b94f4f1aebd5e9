"""The calling side of the RPC layer: a ZeroMQ DEALER with deadlines.

Every call has a deadline (the client's default, or the call's own). When it passes
the client raises ``DeadlineExceeded`` and rebuilds its socket: ZeroMQ would otherwise
keep the unsent request queued and deliver it, late, when the peer comes back.

Until the first handshake with the peer succeeds the client also watches the socket's
monitor, so a peer that refuses our credentials is reported at once as
``AuthenticationError`` instead of as a silent timeout. After that the monitor is
dropped and a call costs one send, one poll and one receive.

A client given a ``ReconnectProbe`` keeps the monitor, to learn of a lost connection.
A connection can die under a call, a partition's retransmissions running out (the
kernel gives up on a link that drops everything after ``tcp_retries2`` probes): ZeroMQ
then dials a new one, but what was written to the old one, the call's request or its
answer, is gone, and the call would wait for nothing until its deadline. When the
connection is back while a call waits, the client sends the probe, a request that is
safe to repeat; a refusal it names fails the call at once (a replaced task learns it
is fenced, ``rpc/fencing.py``). Otherwise the call waits on, within its deadline. (A
loss and return between two calls is read during the next one and probed then: one
spare round trip, cheaper than reading the monitor before every call.)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.utils.monitor

from clusterflow.rpc import codec, runtime
from clusterflow.rpc.auth import Credentials
from clusterflow.rpc.errors import (
    AuthenticationError,
    ClientClosed,
    DeadlineExceeded,
    ProtocolError,
    RemoteError,
    RpcError,
    remote_error,
)
from clusterflow.rpc.message import Response
from clusterflow.rpc.side_client import SideLink

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 30.0
"""Long enough for a push of several GiB on loopback; short enough to notice a dead peer."""

_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_ids = itertools.count(1)
# Plain ints: pyzmq's enum members cost a Python-level conversion per use.
_NOBLOCK, _POLLIN, _SNDTIMEO = int(zmq.NOBLOCK), int(zmq.POLLIN), int(zmq.SNDTIMEO)
_RCVMORE = int(zmq.RCVMORE)


@dataclass(frozen=True, slots=True)
class ReconnectProbe:
    """What a client asks when its connection came back while a call waited.

    The call's request or its answer may have been lost with the old connection. The
    probe must be safe to send any number of times. An error answer whose wire code is
    in ``refusals`` (a ``CodedError``'s ``wire_code``) fails the waiting call with that
    answer, raised as its typed ``RemoteError``; any other answer leaves the call
    waiting, within its deadline.
    """

    method: str
    body: Any
    refusals: frozenset[str]
    """Wire codes (``TaskFenced.wire_code``), never class names or message text."""


def _wire_code(header: Mapping[str, Any]) -> str:
    code = header.get("w", "")
    return code if isinstance(code, str) else ""


def _remote_error(
    header: Mapping[str, Any], default_code: str, where: str, method: str
) -> RemoteError:
    """The exception for an error reply: typed by its wire code (rpc/errors.py)."""
    return remote_error(
        str(header.get("c", default_code)),
        f"{where}: {header.get('b')}",
        error_type=str(header.get("e", "")),
        method=method,
        wire_code=_wire_code(header),
    )


def split_endpoint(address: str) -> tuple[str, str]:
    """(host, ``tcp://host:port``) for ``host:port`` or ``tcp://host:port``."""
    endpoint = address if "://" in address else f"tcp://{address}"
    host = endpoint.split("://", 1)[1].rsplit(":", 1)[0]
    return host.strip("[]"), endpoint


class RpcClient:
    """Calls methods of one ``RpcServer``. Thread-safe: calls are serialised.

    Args:
        address: ``host:port`` or ``tcp://host:port`` of the server.
        credentials: the cluster's secret.
        deadline: default seconds a call may take before ``DeadlineExceeded``.
    """

    def __init__(
        self,
        address: str,
        credentials: Credentials,
        *,
        deadline: float = DEFAULT_DEADLINE_S,
    ) -> None:
        self._host, self.endpoint = split_endpoint(address)
        self._credentials = credentials
        self.deadline = deadline
        self._ctx = runtime.context()
        self._lock = threading.Lock()
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._poller: zmq.Poller | None = None
        self._closed = False
        self._probe: ReconnectProbe | None = None
        self._down = False
        """A disconnect was seen and no handshake since (only watched with a probe)."""
        self._side: SideLink | None = None
        if credentials.resolve_mode(self._host) == "plain":
            self._side = SideLink(self._host, self.endpoint)
        """The side channel (``rpc/side_client.py``) for ``call(side=True)``; none under
        CURVE, where the bytes stay encrypted on ZeroMQ."""
        runtime.track_client(self)

    def probe_on_reconnect(self, probe: ReconnectProbe | None) -> None:
        """Sends ``probe`` whenever the connection comes back while a call waits (see
        the module's docstring); None stops it. Keeps the socket's monitor alive."""
        with self._lock:
            if probe != self._probe:
                self._probe = probe
                self._reset()  # the next call builds a socket watched for disconnects

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the socket; later calls raise ``ClientClosed``. Waits for a call in flight."""
        with self._lock:
            self._closed = True
            self._reset()
            if self._side is not None:
                self._side.close()

    def _close_at_exit(self, timeout: float) -> bool:
        """``close`` unless another thread is inside a call past ``timeout``; True if closed."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            self._closed = True
            self._reset()
            if self._side is not None:
                self._side.close()
            return True
        finally:
            self._lock.release()

    def call(
        self,
        method: str,
        body: Any = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        deadline: float | None = None,
        framed: bool = False,
        part_bytes: int = 0,
        streamed: bool = False,
        side: bool = False,
    ) -> Response:
        """Sends a request and waits for its reply.

        ``framed``: the reply's tensors in several frames come as ``codec.Framed``
        zero-copy views, not joined (for a caller that writes them where they belong).

        ``part_bytes``: tensors of more bytes than this are sent as several messages of
        about this many bytes each (``codec.encode_parts``), so the server works on one
        (checks it) while the next is on the wire; 0 sends one message. The server runs
        the handler only once the last came, and drops the parts it has when the
        deadline passes.

        ``streamed``: the handler may send tensors of its reply while it still works
        (``Request.stream``: the ps sends each chunk of a variable once stepped); they
        arrive as parts and join the reply's tensors.

        ``side``: the call goes over the server's side channel where it offers one
        (``rpc/side.py``: a plain TCP socket, for large tensors; loopback, ``plain``
        auth), else over ZeroMQ as without. ``part_bytes`` does not apply there: the
        server checks each piece of the bytes as it lands.

        Blocks until the reply arrives or ``deadline`` seconds pass. The tensors are sent
        without a copy, straight from their memory: do not modify them in place from
        another thread while the call runs.

        Raises:
            DeadlineExceeded: no reply in time (the peer is dead, hung or unreachable).
            AuthenticationError: the peer refused our credentials.
            RemoteError: the peer answered with an error (its code says why).
            ProtocolError: the reply was malformed or of another protocol version.
            PeerLost: the side channel's connection broke mid-call (the server died).
            ClientClosed: ``close()`` was called.
        """
        timeout = self.deadline if deadline is None else deadline
        end = time.monotonic() + timeout
        with self._lock:
            sock = self._socket()
            if side and self._side is not None:
                if self._side_ready(sock, end, timeout):
                    return self._side.call(
                        method, body, tensors, end, timeout, framed=framed, streamed=streamed
                    )
                sock = self._socket()  # a failed offer may have reset it
            request_id = next(_ids)
            extra = {"sr": 1} if streamed else {}
            if part_bytes:
                messages = codec.encode_parts(
                    codec.KIND_REQUEST,
                    request_id,
                    method,
                    body,
                    tensors,
                    part_bytes=part_bytes,
                    dl=timeout,  # the server drops what came of it after this
                    **extra,
                )
            else:
                messages = [
                    codec.encode(codec.KIND_REQUEST, request_id, method, body, tensors, **extra)
                ]
            try:
                for frames in messages:
                    self._send_before(sock, frames, method, end, timeout)
                return self._await_reply(sock, request_id, method, end, timeout, framed)
            except RemoteError:
                raise  # a well-formed answer: the connection is as good as before
            except BaseException:
                # Anything else leaves a request of ours in flight (or the stream in doubt):
                # a new socket guarantees its late reply is never read as another's.
                self._reset()
                raise

    def _side_ready(self, sock: zmq.Socket[bytes], end: float, timeout: float) -> bool:
        """Whether the side channel is open, opening it when it may be (the lock is
        held): ``rpc.side`` over ZeroMQ, then its port. Where that fails the call keeps
        to ZeroMQ (one line logged) and the channel is tried again later."""
        link = self._side
        assert link is not None
        if link.is_open():
            return True
        if not link.usable():
            return False
        request_id = next(_ids)
        try:
            frames = codec.encode(codec.KIND_REQUEST, request_id, "rpc.side")
            self._send_before(sock, frames, "rpc.side", end, timeout)
            offer = self._await_reply(sock, request_id, "rpc.side", end, timeout)
            link.open(offer.body, end)
        except RemoteError as exc:
            link.failed(exc)  # a server without one: not_found
            return False
        except (OSError, RpcError) as exc:
            if not isinstance(exc, RemoteError | AuthenticationError | ClientClosed):
                self._reset()  # as call's: a request of ours may be in flight
            link.failed(exc)
            if isinstance(exc, AuthenticationError | ClientClosed):
                raise
            return False
        return True

    def send(
        self, method: str, body: Any = None, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Sends a one-way message: no reply, no delivery guarantee if the peer is down.

        Returns once the message is queued. The tensors are copied first (only their
        frames over 64 KiB cost anything): with no reply to wait for, a caller could
        otherwise not know when it may modify or reuse them.

        Raises:
            DeadlineExceeded: it could not even be queued within the client's deadline
                (no connection to send on: see ``call``).
            ClientClosed: ``close()`` was called.
        """
        frames = codec.encode(codec.KIND_ONEWAY, 0, method, body, tensors)
        with self._lock:
            sock = self._socket()
            sock.sndtimeo = max(1, int(self.deadline * 1000))
            try:
                sock.send_multipart(frames, copy=True)
            except zmq.Again:
                self._reset()  # part of the message may be queued: never send after it
                raise DeadlineExceeded(
                    f"{method} to {self.endpoint}: could not even send within {self.deadline:g}s"
                ) from None

    # -------------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket[bytes]:
        if self._closed:
            raise ClientClosed(f"client of {self.endpoint} is closed")
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = 0
            sock.rcvhwm = 0
            sock.reconnect_ivl = 50
            sock.reconnect_ivl_max = 1000
            self._credentials.apply_client(sock, self._host)
            lost = zmq.EVENT_DISCONNECTED if self._probe is not None else 0
            self._monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILURES | lost
            )
            self._down = False
            self._poller = zmq.Poller()
            self._poller.register(sock, _POLLIN)
            self._poller.register(self._monitor, _POLLIN)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        """Drops the socket (and anything queued on it); the next call dials afresh."""
        self._drop_monitor()
        self._poller = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _drop_monitor(self) -> None:
        if self._monitor is not None:
            if self._sock is not None:
                self._sock.disable_monitor()
            if self._poller is not None:
                # Kept, polling the socket alone: Socket.poll() would build a Poller per call.
                self._poller.unregister(self._monitor)
            self._monitor.close(linger=0)
            self._monitor = None

    def _send_before(
        self, sock: zmq.Socket[bytes], frames: list[Any], method: str, end: float, timeout: float
    ) -> None:
        """Queues the request, waiting for a connection no longer than the call's deadline.

        A DEALER's send blocks while it has no connection to send on: after a peer
        refused our credentials (its connection is dropped, even between the frames of
        one message), or while it is unreachable. Without a bound the call would hang
        there, before its deadline is ever looked at.
        """
        if len(frames) == 1:
            # A lone header, the common small call: with a connection (the usual case)
            # it is queued at once, so try that first and set no timeout; a one-part
            # message is queued whole or not at all, so a refusal leaves nothing behind.
            try:
                sock.send(frames[0], _NOBLOCK)
                return
            except zmq.Again:
                pass
        sock.setsockopt(_SNDTIMEO, max(1, int((end - time.monotonic()) * 1000)))
        try:
            runtime.send(sock, frames)
        except zmq.Again:
            if self._monitor is not None:
                self._read_monitor(method)  # raises AuthenticationError if it was that
            raise DeadlineExceeded(
                f"{method} to {self.endpoint}: could not even send within {timeout:g}s"
            ) from None

    def _await_reply(
        self,
        sock: zmq.Socket[bytes],
        request_id: int,
        method: str,
        end: float,
        timeout: float,
        framed: bool = False,
    ) -> Response:
        probe_id = -1
        stream: _Parts | None = None
        while True:
            remaining_ms = int((end - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise DeadlineExceeded(f"{method} to {self.endpoint}: no reply within {timeout:g}s")
            assert self._poller is not None  # built with the socket
            events = self._poller.poll(remaining_ms)
            if not events:
                continue
            if self._monitor is not None:
                ready = dict(events)
                if self._monitor in ready and self._read_monitor(method):
                    probe_id = self._send_probe(sock, method, end, timeout)
                if sock not in ready:
                    continue
            frames = _recv_reply(sock)
            header = codec.decode_header(frames[0])
            if header["id"] == probe_id:
                self._probe_answered(header, method)
                continue
            if header["id"] != request_id:
                continue  # a late reply to an earlier call that gave up
            if header["k"] == codec.KIND_PART:
                if stream is None:
                    stream = _Parts(f"{method} to {self.endpoint}")
                stream.take(header, frames[1:])
                continue
            if header["k"] not in (codec.KIND_REPLY, codec.KIND_ERROR):
                raise ProtocolError(f"{method} to {self.endpoint}: a {header['k']!r} as reply")
            if header["k"] == codec.KIND_ERROR:
                raise _remote_error(header, "internal", f"{method} on {self.endpoint}", method)
            tensors = codec.decode_tensors(header, frames[1:], framed=framed)
            if stream is not None:
                tensors = stream.join(tensors, framed)
            return Response(header.get("b"), tensors)

    def _send_probe(self, sock: zmq.Socket[bytes], method: str, end: float, timeout: float) -> int:
        """Sends the probe (the connection is back while ``method`` waits); its id."""
        assert self._probe is not None  # the monitor reports disconnects only with one
        probe_id = next(_ids)
        log.info(
            "%s: the connection to %s came back while the call waited (its request or "
            "answer may be lost with the old one); asking %s",
            method,
            self.endpoint,
            self._probe.method,
        )
        body = codec.encode(codec.KIND_REQUEST, probe_id, self._probe.method, self._probe.body)
        self._send_before(sock, body, method, end, timeout)
        return probe_id

    def _probe_answered(self, header: Mapping[str, Any], method: str) -> None:
        """Fails the waiting call if the probe was refused in a way that says so."""
        assert self._probe is not None
        if header["k"] == codec.KIND_ERROR and _wire_code(header) in self._probe.refusals:
            raise _remote_error(header, "app", f"{method} on {self.endpoint}", method)
        log.info("%s: %s answered %s; waiting on", method, self._probe.method, header.get("b"))

    def _read_monitor(self, method: str) -> bool:
        """Reads the monitor's events; True if the connection came back after a loss.

        Raises:
            AuthenticationError: the peer refused our credentials.
        """
        assert self._monitor is not None
        back = False
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return back
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                self._down = True
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._probe is None:
                    self._drop_monitor()
                    return False
                back |= self._down
                self._down = False
            elif kind & _HANDSHAKE_FAILURES:
                raise AuthenticationError(
                    f"{method} to {self.endpoint}: the peer refused our credentials "
                    f"(another cluster's secret, or another auth mode)"
                )


class _Parts:
    """The parts of a reply its handler sent while it worked (``codec.KIND_PART``)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._header: dict[str, Any] | None = None
        self._pieces: codec.Pieces | None = None
        self._frames: list[Any] = []
        self._count = 0

    def take(self, header: dict[str, Any], frames: list[Any]) -> None:
        """One part, in order (its ``s``); the first names the tensors.

        Raises:
            ProtocolError: a part out of order, or frames its tensors do not hold.
        """
        seq = header.get("s")
        if seq == 0 and self._header is None:
            self._header = {"t": header.get("t")}
            self._pieces = codec.Pieces(header.get("t"))
        elif self._pieces is None or seq != self._count:
            raise ProtocolError(f"{self._what}: reply part {seq!r} out of order")
        assert self._pieces is not None
        self._pieces.feed(frames)
        self._frames.extend(frames)
        self._count += 1

    def join(self, tensors: dict[str, Any], framed: bool) -> dict[str, Any]:
        """The streamed tensors with the reply's own ``tensors``.

        Raises:
            ProtocolError: a name in both, or streamed tensors not whole.
        """
        assert self._header is not None
        streamed = codec.decode_tensors(self._header, self._frames, framed=framed)
        both = streamed.keys() & tensors.keys()
        if both:
            raise ProtocolError(f"{self._what}: tensor {sorted(both)[0]!r} came twice")
        return {**streamed, **tensors}


def _recv_reply(sock: zmq.Socket[bytes]) -> list[Any]:
    """One reply's frames: the header as bytes, tensor frames zero-copy.

    Called when a message is queued (ZeroMQ delivers one whole). The header is copied:
    a ``zmq.Frame`` costs more to make than its few bytes to copy and asking the socket
    for ``RCVMORE`` together (docs/benchmarks.md, "RPC round trip").
    """
    frames: list[Any] = [sock.recv()]
    while sock.getsockopt(_RCVMORE):
        frames.append(sock.recv(copy=False))
    return frames
