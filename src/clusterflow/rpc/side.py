"""The side channel: a server's large requests and replies over a plain TCP socket.

ZeroMQ's I/O thread copies every byte of a message into its own buffers, in series
with the socket, and a 64 MiB push crosses Python as 128 frames each way: the ps's
64 MiB push+pull read 0.75 of a raw TCP echo of the same bytes (issue 28). Here the
bytes go straight between the socket and tensor memory: a request's tensors are
``recv_into`` a buffer of their own, piece by piece, each piece checked (``Entry.check``)
as it lands while the next is on the wire; a reply's are sent from the tensors' memory
(``sendmsg``), a streamed reply's groups as the handler writes them.

Only where ZeroMQ itself carries the bytes in clear (``plain`` auth: loopback): with
CURVE the bytes stay encrypted on ZeroMQ. The channel is opened over the authenticated
ZeroMQ connection: ``rpc.side`` answers a port and a one-time token, the client dials
the port and presents the token first. A peer without one gets an error and is cut.

Wire (one connection per client, calls in series): every message is a 4-byte
big-endian length, a msgpack header as ``codec`` encodes it (``v``, ``k``, ``id``,
``m``, ``b``, ``t``, ``sr``, ``dl``), then the bytes of every tensor ``t`` describes, in
order, back to back. A reply streamed while its handler runs is ``prt`` messages, then
the ``rep``. The first message of a connection is ``side.hello`` with the token.

Its rules are the ZeroMQ path's: the handler runs only once every byte came, so a
request cut off mid-transfer (its peer died, its deadline passed, a fence dropped it)
reaches no handler and leaves nothing behind; every receive and send has a deadline; a
bad message gets an error naming it, and the server serves on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from clusterflow.errors import ClusterflowError
from clusterflow.rpc import codec
from clusterflow.rpc.errors import DeadlineExceeded, PeerLost, ProtocolError
from clusterflow.rpc.handlers import Entry, run_handler
from clusterflow.rpc.message import Request, Response
from clusterflow.rpc.pool import RECEIVE_POOL

log = logging.getLogger(__name__)

SIDE_VERSION = 1
"""The side channel's wire (framing, hello); ``rpc.side`` answers it, a client of
another refuses the channel and keeps to ZeroMQ."""
HELLO = "side.hello"
TOKEN_TTL_S = 30.0
"""A token not presented within this is void (a client that asked and died)."""
HELLO_S = 10.0
"""A connection must present its token within this, or is cut."""
IDLE_S = 120.0
"""A connection with no request for this long is closed (its client went quiet)."""
CLIENT_IDLE_S = 60.0
"""A client drops its link after this long unused, before the server would cut it: it
never sends a request into a connection the server closed."""
PIECE_BYTES = 1024 * 1024
"""A request's bytes are received, and checked, in pieces of this: the check of each
runs while the next arrives, so only the last piece's check follows the last byte
(about 0.1 ms for 1 MiB of float32 here; 0.7 ms for 8 MiB)."""
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_CONNECTIONS = 256
DRAIN_BYTES = 1024 * 1024
"""The scratch buffer a refused request's tensor bytes are read into and dropped."""
_LENGTH = struct.Struct(">I")


@dataclass(slots=True)
class Sent:
    """``Response.on_sent``'s tracker for a reply that left through the side channel:
    its bytes were in the kernel when ``sendmsg`` returned, so it is done at once."""

    done: bool = True


# -- both ends ---------------------------------------------------------------------------


def _remaining(end: float, what: str) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"{what}: deadline passed")
    return left


def send_message(
    sock: socket.socket, header: bytes, buffers: Iterable[Any], end: float, what: str
) -> None:
    """Sends a length-prefixed header and ``buffers``, from their memory, by ``end``.

    Raises:
        DeadlineExceeded: the peer took nothing for too long.
        PeerLost: the connection broke.
    """
    pending = [memoryview(_LENGTH.pack(len(header)) + header)]
    pending += [memoryview(b).cast("B") for b in buffers if len(b)]
    try:
        while pending:
            sock.settimeout(_remaining(end, what))
            sent = sock.sendmsg(pending[:512])  # below any system's IOV_MAX
            while sent:
                if sent >= len(pending[0]):
                    sent -= len(pending.pop(0))
                else:
                    pending[0] = pending[0][sent:]
                    sent = 0
    except TimeoutError:
        raise DeadlineExceeded(f"{what}: the peer took no bytes in time") from None
    except OSError as exc:
        raise PeerLost(f"{what}: the connection broke while sending ({exc})") from exc


def recv_into(sock: socket.socket, view: memoryview, end: float, what: str) -> None:
    """Fills ``view`` from the socket by ``end``.

    Raises:
        DeadlineExceeded: the bytes did not come in time.
        PeerLost: the connection broke or the peer closed it.
    """
    got, size = 0, len(view)
    try:
        while got < size:
            sock.settimeout(_remaining(end, what))
            n = sock.recv_into(view[got:])
            if n == 0:
                raise PeerLost(f"{what}: the peer closed the connection")
            got += n
    except TimeoutError:
        raise DeadlineExceeded(f"{what}: {got} of {size} bytes came in time") from None
    except PeerLost:
        raise
    except OSError as exc:
        raise PeerLost(f"{what}: the connection broke while receiving ({exc})") from exc


def recv_header(sock: socket.socket, end: float, what: str) -> dict[str, Any]:
    """One message's header (``codec.decode_header``'s checks).

    Raises:
        ProtocolError: a header over ``MAX_HEADER_BYTES``, malformed, or of another version.
        DeadlineExceeded, PeerLost: as ``recv_into``.
    """
    length = bytearray(4)
    recv_into(sock, memoryview(length), end, what)
    (size,) = _LENGTH.unpack(length)
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"{what}: a header of {size} bytes (at most {MAX_HEADER_BYTES})")
    raw = bytearray(size)
    recv_into(sock, memoryview(raw), end, what)
    return codec.decode_header(bytes(raw))


def allocate(descriptors: Any) -> list[tuple[str, Any, Any]]:
    """``(name, flat uint8 buffer, tensor view of it)`` for each tensor ``descriptors``
    (a header's ``t``) names, the buffers from ``RECEIVE_POOL``.

    Raises:
        ProtocolError: malformed descriptors, or a shape that does not fill its bytes.
    """
    import torch

    codec.Pieces(descriptors)  # their form, before a byte is allocated
    out = []
    for name, dtype_name, shape, nbytes in descriptors or ():
        itemsize = codec.DTYPES[dtype_name]
        if (
            not isinstance(shape, list)
            or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape)
            or math.prod(shape) * itemsize != nbytes
        ):
            raise ProtocolError(
                f"tensor {name!r}: shape {shape!r:.80} of {dtype_name} does not fill {nbytes} bytes"
            )
        flat = RECEIVE_POOL.take(nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        out.append((name, flat, flat.view(getattr(torch, dtype_name)).reshape(shape)))
    return out


def recv_tensors(
    sock: socket.socket,
    descriptors: Any,
    end: float,
    what: str,
    check: Callable[[str, Any], None] | None = None,
) -> dict[str, Any]:
    """The tensors ``descriptors`` name, received into buffers of their own
    (``allocate``), in pieces of ``PIECE_BYTES``; ``check(name, flat)`` sees each
    piece (whole elements, a flat tensor of its dtype) as it lands, while the next is
    on the wire.

    Raises:
        ProtocolError: malformed descriptors.
        DeadlineExceeded, PeerLost: as ``recv_into``.
    """
    out: dict[str, Any] = {}
    for name, flat, tensor in allocate(descriptors):
        view, nbytes, done = memoryview(flat.numpy()), flat.numel(), 0
        itemsize = tensor.element_size()
        while done < nbytes:
            stop = min(nbytes, done + PIECE_BYTES)
            recv_into(sock, view[done:stop], end, what)
            if check is not None:
                check(name, tensor.view(-1)[done // itemsize : stop // itemsize])
            done = stop
        out[name] = tensor
    return out


def drain(sock: socket.socket, nbytes: int, end: float, what: str) -> None:
    """Reads ``nbytes`` and drops them: a refused request's tensors, so the connection
    stays in step for the next call."""
    scratch = memoryview(bytearray(min(nbytes, DRAIN_BYTES)))
    while nbytes:
        take = min(nbytes, len(scratch))
        recv_into(sock, scratch[:take], end, what)
        nbytes -= take


# -- the serving end ---------------------------------------------------------------------


@dataclass(slots=True)
class _InFlight:
    """A request whose bytes are arriving (``drop`` may void it, as ``drop_partials``)."""

    method: str
    body: Any
    dropped: bool = False


class SideServer:
    """An ``RpcServer``'s side channel: a listening TCP socket on its host, a daemon
    thread per connection that reads a request, runs its handler there and writes the
    reply. Built by ``RpcServer.enable_side_channel``, which serves ``rpc.side``.

    Args:
        host: the interface (the server's, a loopback one).
        lookup: the ``Entry`` of a method, or None (the server's table).
        admit: why a request of ``size`` bytes whose tensors came so is refused, as
            ``(code, message)``, or None (the server's size limit and tensor rule).
        name: for logs and threads.
    """

    def __init__(
        self,
        host: str,
        lookup: Callable[[str], Entry | None],
        admit: Callable[[str, int, bool], tuple[str, str] | None],
        name: str,
    ) -> None:
        self._lookup = lookup
        self._admit = admit
        self._name = name
        self._listener = socket.create_server((host, 0), backlog=64)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}
        self._connections: set[socket.socket] = set()
        self._in_flight: dict[int, _InFlight] = {}
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-side-accept", daemon=True).start()

    def issue(self) -> dict[str, Any]:
        """``rpc.side``'s answer: the port and a token good for one connection."""
        token = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            self._tokens = {t: e for t, e in self._tokens.items() if e > now}
            self._tokens[token] = now + TOKEN_TTL_S
        return {"v": SIDE_VERSION, "port": self.port, "token": token}

    def drop(self, match: Callable[[str, Any], bool]) -> int:
        """Voids the requests still arriving for which ``match(method, body)``; how many.
        Their handler never runs: their caller gets a ``protocol`` error once the bytes
        came (``RpcServer.drop_partials``)."""
        with self._lock:
            flights = self._in_flight.values()
            gone = [f for f in flights if not f.dropped and match(f.method, f.body)]
            for flight in gone:
                flight.dropped = True
        return len(gone)

    def in_flight(self) -> int:
        """Requests whose bytes are arriving, those ``drop`` voided left out."""
        with self._lock:
            return sum(not flight.dropped for flight in self._in_flight.values())

    def close(self) -> None:
        """Stops accepting and cuts every connection (their handlers are abandoned)."""
        with self._lock:
            self._closed = True
            conns = list(self._connections)
        self._listener.close()
        for conn in conns:
            _shut(conn)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._connections) >= MAX_CONNECTIONS
                if not self._closed and not full:
                    self._connections.add(conn)
            if self._closed or full:
                why = "closed" if self._closed else f"{MAX_CONNECTIONS} open"
                log.warning("%s: side connection refused (%s)", self._name, why)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(conn,), name=f"{self._name}-side", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._hello(conn):
                while self._one(conn):
                    pass
        except (PeerLost, DeadlineExceeded, ProtocolError) as exc:
            log.info("%s: side connection closed: %s", self._name, exc)
        except Exception:
            log.exception("%s: side connection failed", self._name)
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._in_flight.pop(id(conn), None)
            _shut(conn)

    def _hello(self, conn: socket.socket) -> bool:
        end = time.monotonic() + HELLO_S
        header = recv_header(conn, end, "side hello")
        body = header.get("b")
        token = body.get("token") if isinstance(body, dict) else None
        with self._lock:
            expiry = self._tokens.pop(token, None) if isinstance(token, str) else None
        if header.get("m") != HELLO or expiry is None or expiry < time.monotonic():
            why = "unknown or expired token"
            self._error(conn, header.get("id", 0), HELLO, "protocol", why, end)
            log.warning("%s: side connection with an unknown or expired token cut", self._name)
            return False
        send_message(conn, _reply(header["id"], HELLO, None), (), end, "side hello")
        return True

    def _one(self, conn: socket.socket) -> bool:
        """Serves one request; False when the connection must close (after its answer)."""
        try:
            header = recv_header(conn, time.monotonic() + IDLE_S, "side request")
        except DeadlineExceeded:
            return False  # idle: the client drops its link before this (CLIENT_IDLE_S)
        method, request_id = header["m"], header["id"]
        wait = header.get("dl", 600.0)
        if not isinstance(wait, int | float) or isinstance(wait, bool) or not wait > 0:
            wait = 600.0
        end = time.monotonic() + min(float(wait), 600.0)
        if header["k"] != codec.KIND_REQUEST:
            self._error(conn, request_id, method, "protocol", f"a {header['k']!r} as request", end)
            return False
        try:
            total = codec.Pieces(header.get("t")).total
        except ProtocolError as exc:
            self._error(conn, request_id, method, "bad_request", exc, end)
            return False  # its bytes cannot be told apart from the next header
        refused = self._admit(method, total, bool(header.get("t")))
        entry = self._lookup(method)
        if refused is None and entry is None:
            refused = ("not_found", f"no method {method!r} here")
        if refused is not None:
            if refused[0] == "too_large":
                self._error(conn, request_id, method, *refused, end)
                return False  # not read: that many bytes are the harm the limit prevents
            drain(conn, total, end, f"{method} (refused)")
            self._error(conn, request_id, method, *refused, end)
            return True
        assert entry is not None
        flight = _InFlight(method, header.get("b"))
        with self._lock:
            self._in_flight[id(conn)] = flight
        failed: list[tuple[str, Exception]] = []

        def checked(name: str, piece: Any) -> None:
            if failed or entry.check is None:
                return
            try:
                entry.check(name, piece)
            except Exception as exc:
                failed.append(("app" if isinstance(exc, ClusterflowError) else "internal", exc))

        try:
            tensors = recv_tensors(conn, header.get("t"), end, method, checked)
        except ProtocolError as exc:
            self._error(conn, request_id, method, "bad_request", exc, end)
            return False
        finally:
            with self._lock:
                self._in_flight.pop(id(conn), None)
        if flight.dropped:
            why = "the request was dropped (fenced)"
            self._error(conn, request_id, method, "protocol", why, end)
            return True
        if failed:
            log.info("%s: %s refused: %s", self._name, method, failed[0][1])
            self._error(conn, request_id, method, *failed[0], end)
            return True
        names = frozenset(tensors) if entry.check is not None else frozenset()
        request = Request(method, header.get("b"), tensors, b"side", False, names)
        stream = _SideStream(conn, request_id, method, end) if header.get("sr") else None
        request.stream = stream
        del tensors
        result = run_handler(self._name, entry, request)
        del request
        if stream is not None and not stream.finish():
            return False  # the reply cannot be whole: the client learns it from the cut
        if not isinstance(result, Response):
            self._error(conn, request_id, method, *result, end)
            return True
        try:
            header_bytes, frames = _encoded(request_id, method, result)
        except Exception as exc:
            log.error("%s: reply of %s cannot be sent: %s", self._name, method, exc)
            self._error(conn, request_id, method, "internal", exc, end)
            return True
        send_message(conn, header_bytes, frames, end, f"reply of {method}")
        if result.on_sent is not None:
            result.on_sent(Sent())
        return True

    def _error(
        self,
        conn: socket.socket,
        request_id: Any,
        method: str,
        code: str,
        error: object,
        end: float,
    ) -> None:
        log.warning(
            "%s: side %s request %s rejected (%s): %s", self._name, method, request_id, code, error
        )
        rid = request_id if isinstance(request_id, int) else 0
        frames = codec.encode_error(rid, method, code, error)
        send_message(conn, frames[0], (), end, f"error reply of {method}")


class _SideStream:
    """``Request.stream`` on the side channel: each ``send`` queues a ``prt`` message of
    the handler's buffers, which a thread of its own writes to the socket while the
    handler works on (the ps steps the next group of chunks meanwhile: a send on the
    handler's thread would copy into the kernel in series with the step).

    The buffers are read until ``finish`` returned; the reply's ``on_sent`` follows it,
    so the ps's loans (``ps/loans.py``) cover them until then.
    """

    def __init__(self, conn: socket.socket, request_id: int, method: str, end: float) -> None:
        self._conn = conn
        self._request_id = request_id
        self._method = method
        self._end = end
        self._descriptors: list[list[Any]] | None = None
        self._seq = 0
        self._queue: queue.SimpleQueue[tuple[bytes, list[Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.broken: Exception | None = None
        """Why a part could not be sent; the later ones are dropped, and the connection
        is cut once the handler returned (its reply cannot be whole)."""

    def begin(self, tensors: Any) -> None:
        if self._descriptors is not None:
            raise RuntimeError(f"{self._method}: the reply's stream was begun twice")
        self._descriptors = [codec.descriptor(name, t) for name, t in tensors.items()]

    def send(self, frames: Any) -> None:
        """Queues the next part; never raises for the connection (a step half done
        would stay so): a broken one is seen by ``finish``."""
        if self._descriptors is None:
            raise RuntimeError(f"{self._method}: a reply's stream sent before it was begun")
        extra: dict[str, Any] = {"s": self._seq, "nb": sum(len(f) for f in frames)}
        if self._seq == 0:
            extra["t"] = self._descriptors
        self._seq += 1
        header = codec.encode(codec.KIND_PART, self._request_id, self._method, **extra)[0]
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._write, name=f"{self._method}-stream", daemon=True
            )
            self._thread.start()
        self._queue.put((header, list(frames)))

    def finish(self) -> bool:
        """Waits until every queued part left (each send bounded by the request's
        deadline); whether all did."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        return self.broken is None

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.broken is not None:
                continue  # the rest is dropped: the connection is cut after the handler
            header, frames = item
            try:
                send_message(self._conn, header, frames, self._end, f"{self._method} part")
            except (PeerLost, DeadlineExceeded) as exc:
                log.warning("%s: its streamed reply broke off: %s", self._method, exc)
                self.broken = exc


def _encoded(request_id: int, method: str, response: Response) -> tuple[bytes, list[Any]]:
    frames = codec.encode(codec.KIND_REPLY, request_id, method, response.body, response.tensors)
    return frames[0], frames[1:]


def _reply(request_id: int, method: str, body: Any) -> bytes:
    frames: list[bytes] = codec.encode(codec.KIND_REPLY, request_id, method, body)
    return frames[0]


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    conn.close()
