"""The calling end of the side channel (``rpc/side.py``): one TCP connection per
``RpcClient``, opened with a token the server handed over ZeroMQ.

``RpcClient.call(side=True)`` sends here where the server offers a channel; where it
cannot be opened (a server without one, CURVE auth, a refused connection) the client
logs one line and keeps to ZeroMQ, trying again after ``RETRY_S``.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from clusterflow.rpc import codec
from clusterflow.rpc.errors import DeadlineExceeded, PeerLost, ProtocolError, remote_error
from clusterflow.rpc.message import Response
from clusterflow.rpc.side import (
    CLIENT_IDLE_S,
    HELLO,
    SIDE_VERSION,
    allocate,
    recv_header,
    recv_into,
    recv_tensors,
    send_message,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

RETRY_S = 30.0
"""After a channel could not be opened, calls keep to ZeroMQ this long before trying again."""
_ids = itertools.count(1)


class SideLink:
    """One client's connection to a server's side channel. Not thread-safe: its
    ``RpcClient`` serialises calls."""

    def __init__(self, host: str, what: str) -> None:
        self._host = host
        self._what = what
        self._sock: socket.socket | None = None
        self._used = 0.0
        self._retry_at = 0.0

    def usable(self) -> bool:
        """Whether a call should try the channel (it is open, or may be opened now)."""
        return self._sock is not None or time.monotonic() >= self._retry_at

    def open(self, offer: Any, end: float) -> None:
        """Connects to the port ``offer`` (``rpc.side``'s answer) names and presents its
        token, by ``end``.

        Raises:
            ProtocolError: an offer of another side-channel version, or malformed.
            DeadlineExceeded, PeerLost, OSError: no connection, or it was refused.
        """
        self.close()
        if (
            not isinstance(offer, dict)
            or offer.get("v") != SIDE_VERSION
            or not isinstance(offer.get("port"), int)
            or not isinstance(offer.get("token"), str)
        ):
            raise ProtocolError(f"{self._what}: side channel offer {offer!r:.120} not understood")
        wait = max(0.001, end - time.monotonic())
        sock = socket.create_connection((self._host, offer["port"]), timeout=wait)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = codec.encode(codec.KIND_REQUEST, 0, HELLO, {"token": offer["token"]})
            send_message(sock, hello[0], (), end, f"{self._what}: side hello")
            header = recv_header(sock, end, f"{self._what}: side hello")
            if header["k"] != codec.KIND_REPLY:
                raise ProtocolError(f"{self._what}: side channel refused: {header.get('b')}")
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._used = time.monotonic()

    def failed(self, why: object) -> None:
        """The channel could not be opened: calls keep to ZeroMQ for ``RETRY_S``."""
        self.close()
        self._retry_at = time.monotonic() + RETRY_S
        log.info("%s: no side channel (%s); tensors go over ZeroMQ", self._what, why)

    def is_open(self) -> bool:
        """Whether a call may go out on the link now. One unused for ``CLIENT_IDLE_S``
        is dropped (the server may cut it soon), and one the server closed meanwhile
        (it restarted, or cut the link) too: a call never goes into a dead socket, so
        a restarted server's first call is served over a new link, not lost."""
        sock = self._sock
        if sock is not None and (time.monotonic() - self._used > CLIENT_IDLE_S or _closed(sock)):
            self.close()
        return self._sock is not None

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def call(
        self,
        method: str,
        body: Any,
        tensors: Mapping[str, torch.Tensor] | None,
        end: float,
        timeout: float,
        *,
        framed: bool,
        streamed: bool,
    ) -> Response:
        """One call over the open channel: the request's tensors sent from their
        memory, the reply's received into buffers of their own (``framed``: as a
        one-piece ``codec.Framed``, which ``shards.load_into`` copies without torch's
        thread pool).

        Raises:
            DeadlineExceeded: no whole reply by ``end``.
            PeerLost: the connection broke (the server died or cut it).
            RemoteError: the server answered with an error.
            ProtocolError: a malformed reply.
        """
        sock = self._sock
        assert sock is not None  # is_open() or open() first
        request_id = next(_ids)
        extra: dict[str, Any] = {"dl": timeout}
        if streamed:
            extra["sr"] = 1
        frames = codec.encode(codec.KIND_REQUEST, request_id, method, body, tensors, **extra)
        what = f"{method} to {self._what} (side channel)"
        try:
            try:
                send_message(sock, frames[0], frames[1:], end, what)
            except PeerLost:
                # A server that refused the request (too large) answers, then cuts.
                reply = self._answer(sock, request_id, min(end, time.monotonic() + 1.0), what)
                if reply is None:
                    raise
            reply = self._answer(sock, request_id, end, what, framed=framed)
            assert reply is not None
            self._used = time.monotonic()
            return reply
        except BaseException as exc:
            if not isinstance(exc, _Answered):
                self.close()  # mid-message: the stream is out of step for good
                raise
            if exc.cut:
                self.close()
            raise exc.error from None

    def _answer(
        self, sock: socket.socket, request_id: int, end: float, what: str, framed: bool = False
    ) -> Response | None:
        """The reply (its streamed parts first); None when the connection is gone
        before an answer (only when reading after a failed send)."""
        stream: _Streamed | None = None
        seq = 0
        while True:
            try:
                header = recv_header(sock, end, what)
            except (PeerLost, DeadlineExceeded):
                if not framed and seq == 0 and end - time.monotonic() < 1.5:
                    return None
                raise
            if header["id"] != request_id:
                raise ProtocolError(f"{what}: a reply to request {header['id']}")
            kind = header["k"]
            if kind == codec.KIND_ERROR:
                error = remote_error(
                    str(header.get("c", "internal")),
                    f"{what}: {header.get('b')}",
                    error_type=str(header.get("e", "")),
                    method=str(header.get("m", "")),
                    wire_code=str(header.get("w", "") or ""),
                )
                raise _Answered(error, cut=header.get("c") in ("protocol", "too_large"))
            if kind == codec.KIND_PART:
                if header.get("s") != seq or (seq == 0) != ("t" in header):
                    raise ProtocolError(f"{what}: reply part {header.get('s')!r} out of order")
                if seq == 0:
                    stream = _Streamed(allocate(header["t"]), what)
                assert stream is not None
                stream.take(sock, header.get("nb"), end)
                seq += 1
                continue
            if kind != codec.KIND_REPLY:
                raise ProtocolError(f"{what}: a {kind!r} as reply")
            tensors = recv_tensors(sock, header.get("t"), end, what)
            streamed = stream.tensors() if stream is not None else {}
            both = streamed.keys() & tensors.keys()
            if both:
                raise ProtocolError(f"{what}: tensor {sorted(both)[0]!r} came twice")
            out = {**streamed, **tensors}
            if framed:
                out = {n: _framed(t) for n, t in out.items()}
            return Response(header.get("b"), out)


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed an idle link: between calls nothing may arrive, so any
    readable byte, an end of stream or a reset says the link is dead (one syscall)."""
    # Non-blocking for the peek: with a timeout set, Python waits for readiness first.
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return False  # nothing to read: alive
    except OSError:
        return True
    return True  # an end of stream, or a byte no call asked for


class _Streamed:
    """The tensors of a reply sent in parts as its handler worked: the first part names
    them, each part carries the next ``nb`` bytes of them, in order."""

    def __init__(self, allocated: list[tuple[str, Any, Any]], what: str) -> None:
        self._allocated = allocated
        self._what = what
        self._at = 0  # the tensor the next byte belongs to
        self._got = 0  # its bytes received

    def take(self, sock: socket.socket, nbytes: Any, end: float) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ProtocolError(f"{self._what}: a reply part of {nbytes!r} bytes")
        while nbytes:
            count = len(self._allocated)
            while self._at < count and self._got == self._allocated[self._at][1].numel():
                self._at, self._got = self._at + 1, 0
            if self._at == len(self._allocated):
                raise ProtocolError(f"{self._what}: a reply part beyond its tensors' bytes")
            flat = self._allocated[self._at][1]
            take = min(nbytes, flat.numel() - self._got)
            view = memoryview(flat.numpy())[self._got : self._got + take]
            recv_into(sock, view, end, self._what)
            self._got += take
            nbytes -= take

    def tensors(self) -> dict[str, Any]:
        """The streamed tensors, once every byte came.

        Raises:
            ProtocolError: some did not.
        """
        missing = sum(f.numel() for _, f, _ in self._allocated[self._at :]) - self._got
        if missing:
            raise ProtocolError(f"{self._what}: the streamed reply lacks {missing} bytes")
        return {name: tensor for name, _, tensor in self._allocated}


class _Answered(Exception):
    """A well-formed error answer, carried out of the read loop (``cut``: the server
    closes the connection after it)."""

    def __init__(self, error: Exception, cut: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.cut = cut


def _framed(tensor: Any) -> Any:
    """A large received tensor as a one-piece ``codec.Framed`` (``load_into`` copies
    it with a plain memcpy); a small one as it is."""
    if tensor.numel() * tensor.element_size() <= codec.WHOLE_BYTES:
        return tensor
    return codec.Framed(tensor.shape, tensor.dtype, [tensor.view(-1)])
