"""The serving side of the RPC layer: a ZeroMQ ROUTER and a dispatch loop.

One thread owns the ROUTER socket (ZeroMQ sockets are not thread-safe). Handlers
registered as ``blocking=False`` run inline on that thread: they must be quick and never
wait, which keeps a no-op call at the cost of the socket round trip. Handlers that may
wait (a long poll, a barrier) are registered ``blocking=True`` and run on a pool of
daemon threads; their replies come back to the loop through the ROUTER itself, from an
inproc DEALER of the server's own (the stop signal too), so the loop only ever waits in
the ROUTER's ``recv``, as a bare pyzmq echo does (docs/benchmarks.md, "RPC round trip").
That DEALER is attached before the TCP port is bound, under a routing id that ZeroMQ then
refuses to any peer claiming it, so no remote peer can speak as the loop. The threads
are daemons so that a handler still waiting never keeps a finished process alive;
``runtime`` stops every server before the interpreter finalizes.

A bad message never takes the server down: malformed frames, an unknown method, a
message over the size limit or an exception in a handler each produce an error reply
to that caller, and the loop goes on serving everyone else.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.utils.monitor

from clusterflow.rpc import codec, runtime
from clusterflow.rpc.auth import AuthMode, Credentials
from clusterflow.rpc.errors import ProtocolError
from clusterflow.rpc.handlers import Check, Entry, HandlerThreads, run_handler
from clusterflow.rpc.message import Request, Response
from clusterflow.rpc.parts import Partial, ReplyStream, RequestsInParts
from clusterflow.rpc.side import SideServer

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 2 * 1024**3
"""2 GiB: above any single push or pull we expect, below what would exhaust memory."""

_STOP = b"\x00stop"
_LOOP_ID = b"\x00clusterflow-loop"
"""Routing id of the server's own inproc DEALER. A leading zero byte, as ZeroMQ's own ids
have; taken before any remote peer can connect, so one that claims it is ignored."""
# Plain ints: pyzmq's enum members cost a conversion per use.
_RCVMORE, _SNDMORE = int(zmq.RCVMORE), int(zmq.SNDMORE)
_instances = itertools.count()


def bind_host(host: str) -> str:
    """The ZeroMQ bind interface for an address host: IPs as they are, names on all."""
    bare = host.strip("[]")
    if bare == "localhost":
        return "127.0.0.1"
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in bare else socket.AF_INET, bare)
    except OSError:
        return "*"
    return f"[{bare}]" if ":" in bare else bare


class RpcServer(RequestsInParts):
    """Serves registered methods on one TCP port.

    Usage: build, ``register`` methods, ``start()``; ``stop()`` when done (also a
    context manager). ``register`` may be called after ``start``.

    Args:
        credentials: the cluster's secret; peers without it are refused at connect.
        host: interface to bind (``127.0.0.1`` by default: local clusters stay local).
        port: port to bind; 0 picks an ephemeral one.
        listen_fd: an already bound TCP socket to adopt instead of binding (the
            supervisor's reserved port, docs/architecture.md section 3). ZeroMQ takes
            ownership of the descriptor.
        max_message_bytes: a request larger than this gets a ``too_large`` error reply.
        workers: threads for ``blocking`` handlers.
        name: used in thread names and logs.
        tensors: whether any handler here takes tensors. A server that takes none (the
            manager's) answers a request carrying tensor frames with ``bad_request``
            before decoding them, so a stray or hostile peer cannot make a process that
            never moves tensors import torch (~2.5 s, 200 MiB) or allocate its frames.
    """

    def __init__(
        self,
        credentials: Credentials,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        listen_fd: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        workers: int = 8,
        name: str = "rpc",
        tensors: bool = True,
    ) -> None:
        self._ctx = runtime.context()
        self._takes_tensors = tensors
        self._handlers: dict[str, Entry] = {}
        self._max_message_bytes = max_message_bytes
        self._name = name
        self._router = self._ctx.socket(zmq.ROUTER)
        # Replies of blocking handlers (and the stop signal) reach the loop through the
        # ROUTER from this DEALER. ZeroMQ sockets are not thread-safe: every use, and
        # the close, holds the lock, so a handler finishing during stop() never races it.
        self._pusher = self._ctx.socket(zmq.DEALER)
        self._pusher_lock = threading.Lock()
        try:
            self._router.linger = 0
            self._router.sndhwm = 0
            self._router.rcvhwm = 0
            # A single frame above the limit cannot be answered (ZeroMQ drops the peer);
            # multi-frame messages above it are answered with `too_large` below.
            self._router.maxmsgsize = max_message_bytes
            self._router.router_mandatory = False
            inproc = f"inproc://clusterflow-rpc-loop-{next(_instances)}"
            self._router.bind(inproc)
            self._pusher.linger = 0
            self._pusher.sndhwm = 0
            self._pusher.routing_id = _LOOP_ID
            # Before the TCP bind below: this connection (and its routing id) is queued
            # to the ROUTER ahead of any remote peer's, which can only come after it.
            self._pusher.connect(inproc)
            if listen_fd is not None:
                adopted = socket.socket(fileno=listen_fd)
                host, port = adopted.getsockname()[:2]
                adopted.listen(512)
                self._router.setsockopt(zmq.USE_FD, adopted.detach())
            interface = bind_host(host)
            self.auth_mode: AuthMode = credentials.apply_server(self._router, host)
            self._router.bind(f"tcp://{interface}:{port}")
            self._bound = str(self._router.getsockopt_string(zmq.LAST_ENDPOINT))
            self.port = int(self._bound.rsplit(":", 1)[1])
            self.host = _advertised_host(host)
        except BaseException:
            self._router.close(linger=0)
            self._pusher.close(linger=0)
            raise
        self._workers = HandlerThreads(workers, name)
        self._partials: dict[bytes, Partial] = {}
        """Requests sent in parts, not all arrived, by peer: a peer's calls follow each
        other (``RpcClient`` serialises them), so it has one at most."""
        self._partials_lock = threading.Lock()
        """The loop thread and ``drop_partials`` (a handler's thread) share the table."""
        self._side: SideServer | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._sockets_closed = False
        runtime.track_server(self)

    @property
    def address(self) -> str:
        """``host:port`` as peers should dial it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.address}"

    def register(
        self,
        method: str,
        handler: Callable[[Request], Any],
        *,
        blocking: bool = False,
        framed: bool = False,
        check: Check | None = None,
    ) -> None:
        """Serves ``method`` with ``handler``; ``blocking`` handlers run on the pool.

        ``framed``: the request's tensors in several frames reach the handler as
        ``codec.Framed`` zero-copy views, not joined (a handler that consumes them frame
        by frame, such as the ps's push).

        ``check``: for a request sent in parts (``codec.encode_parts``), called on the
        loop thread with each tensor frame as its message arrives, while the next is on
        the wire (the ps's finite check of a push). One that raises refuses the request:
        its error is the answer once the last part came, and the handler never runs.
        The handler learns which tensors passed from ``Request.checked``.
        """
        if method in self._handlers:
            raise ValueError(f"method {method!r} is already registered")
        self._handlers[method] = Entry(handler, blocking, framed, check)

    def enable_side_channel(self) -> bool:
        """Serves large requests and replies over a TCP socket of their own as well
        (``rpc/side.py``), opened by ``rpc.side``; whether it was. Only with ``plain``
        auth (loopback), where ZeroMQ carries the bytes in clear too: with CURVE they
        stay on ZeroMQ, encrypted. Idempotent."""
        if self.auth_mode != "plain":
            mode = self.auth_mode
            log.info("%s: no side channel under %s auth; tensors stay on ZeroMQ", self._name, mode)
            return False
        if self._side is None:
            self._side = SideServer(self.host, self._handlers.get, self._side_refusal, self._name)
            side = self._side
            self.register("rpc.side", lambda request: side.issue())
        return True

    def _side_refusal(self, method: str, size: int, tensors: bool) -> tuple[str, str] | None:
        """``_admit``'s rules for a side-channel request (size limit, tensors at all)."""
        if size > self._max_message_bytes:
            limit = self._max_message_bytes
            return "too_large", f"message of {size} bytes exceeds the limit of {limit} bytes"
        if not self._takes_tensors and tensors:
            return "bad_request", f"{self._name} takes no tensors; {method!r} came with some"
        return None

    def reserve_workers(self, count: int) -> None:
        """Room for ``count`` blocking handlers at once (threads start only as needed).

        For a service whose handlers wait on each other: a sync ps step's pulls wait for
        pushes that, with too few threads, would queue behind them forever.
        """
        self._workers.grow(count)

    def start(self) -> RpcServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"{self._name}-loop", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stops serving and releases the port. Pending blocking handlers are abandoned.

        Waits up to ``timeout`` seconds for the loop thread to finish the message it is
        handling; idempotent.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._workers.close()
        if self._side is not None:
            self._side.close()
        if self._thread is not None and self._thread.is_alive():
            self._push([_STOP])
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
        else:
            self._close_sockets()

    def __enter__(self) -> RpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # The loop thread --------------------------------------------------------------

    def _run(self) -> None:
        router = self._router
        try:
            while True:
                # One wait, in the ROUTER's recv: requests, pool handlers' replies and
                # the stop signal all arrive here, fair-queued by ZeroMQ. (A poll over a
                # second socket cost a no-op call a few microseconds per side, and a
                # ZMQ_EVENTS check per message; docs/benchmarks.md, "RPC round trip".)
                frames = _recv_request(router)
                if frames[0] == _LOOP_ID:
                    if frames[1] == _STOP:
                        return
                    runtime.send(router, frames[1:])  # [caller's routing id, reply...]
                    # Held frames would keep a tracked reply's memory "in use"
                    # (Response.on_sent) until the next reply came.
                    del frames
                    continue
                try:
                    self._dispatch(frames)
                except Exception:
                    # Expected failures were answered inside _dispatch; one that gets
                    # here is a bug of ours, and the loop still serves everyone else.
                    log.exception("%s: dropped a message that failed dispatch", self._name)
        except Exception:
            log.exception("%s: serving loop failed", self._name)
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._release_port()
        self._router.close(linger=0)
        with self._pusher_lock:
            self._pusher.close(linger=0)
            self._sockets_closed = True

    def _release_port(self, timeout_ms: int = 2000) -> None:
        """Unbinds, and waits until libzmq's IO thread has closed the listening socket.

        ``close()`` returns before that happens, so a server started on the same port
        right after ``stop()`` (a restarted task) would find it still in use.
        """
        try:
            monitor = self._router.get_monitor_socket(zmq.EVENT_CLOSED)
        except zmq.ZMQError:
            return
        try:
            self._router.unbind(self._bound)
            if monitor.poll(timeout_ms):
                zmq.utils.monitor.recv_monitor_message(monitor)
            else:
                log.warning("%s: port %s not released in time", self._name, self.port)
        except zmq.ZMQError as exc:
            log.debug("%s: unbind of %s failed: %s", self._name, self._bound, exc)
        finally:
            self._router.disable_monitor()
            monitor.close(linger=0)

    def _push(self, frames: list[Any]) -> None:
        """Hands frames to the loop thread, from any thread; dropped once it has stopped."""
        with self._pusher_lock:
            if self._sockets_closed:
                return
            runtime.send(self._pusher, frames)

    # Used by runtime.shutdown at interpreter exit.

    def _closed(self) -> bool:
        return self._sockets_closed

    def _wait_handlers(self, timeout: float) -> bool:
        return self._workers.wait_idle(timeout)

    def _dispatch(self, frames: list[Any]) -> None:
        identity = _bytes(frames[0])  # frames: at least the id and a header (_recv_request)
        try:
            header = codec.decode_header(frames[1])
        except ProtocolError as exc:
            self._send_error(identity, _guess_id(frames[1]), "", "protocol", exc)
            return
        method: str = header["m"]
        request_id: int = header["id"]
        if len(frames) == 2 and header["k"] == codec.KIND_REQUEST and not self._partials:
            entry = self._handlers.get(method)
            if entry is not None and not entry.blocking and "n" not in header and "t" not in header:
                self._serve_small(identity, method, request_id, header.get("b"), entry)
                return
        oneway = header["k"] == codec.KIND_ONEWAY
        if self._partials:
            self._expire_partials()
        if header["k"] == codec.KIND_MORE:
            self._more(identity, header, frames[2:])
            return
        if header["k"] not in (codec.KIND_REQUEST, codec.KIND_ONEWAY):
            self._send_error(identity, request_id, method, "protocol", "expected a request")
            return
        if self._partials and identity in self._partials:
            # A peer's calls follow each other: its new request means the one it left
            # unfinished (a call that gave up) never completes.
            with self._partials_lock:
                self._partials.pop(identity, None)
        parts = header.get("n", 1)
        if parts != 1:
            self._begin(identity, header, frames, oneway)
            return
        size = len(frames[1]) if len(frames) == 2 else sum(len(f) for f in frames[1:])
        tensors = (
            f"came with {len(frames) - 2} frames" if header.get("t") or len(frames) > 2 else None
        )
        entry = self._admit(identity, header, size, tensors)
        if entry is None:
            return
        self._serve(identity, header, frames[2:], entry, frozenset())

    def _serve_small(
        self, identity: bytes, method: str, request_id: int, body: Any, entry: Entry
    ) -> None:
        """``_serve`` of a request in one frame whose handler runs inline, in fewer
        steps: the common call (docs/benchmarks.md, "RPC round trip"). Its frame is
        within the size limit (ZeroMQ drops a peer whose lone frame is not)."""
        request = Request(method, body, {}, identity)
        response = run_handler(self._name, entry, request)
        if isinstance(response, Response) and not response.tensors and response.on_sent is None:
            try:
                reply = codec.encode_small(codec.KIND_REPLY, request_id, method, response.body)
            except ProtocolError:
                pass  # _invoke's error path answers it
            else:
                self._router.send(identity, _SNDMORE)
                self._router.send(reply)
                return
        frames = self._invoke(entry, request, request_id, response)
        if frames is not None:
            runtime.send(self._router, [identity, *frames])

    def _admit(
        self, identity: bytes, header: dict[str, Any], size: int, tensors: str | None
    ) -> Entry | None:
        """The handler of a request of ``size`` bytes, whole or in parts (``tensors``:
        how its tensors came, None for none); None once the caller was answered with
        why not (over the size limit, no such method, tensors to a server of none)."""
        method, request_id = header["m"], header["id"]
        oneway = header["k"] == codec.KIND_ONEWAY
        if size > self._max_message_bytes:
            self._reply_or_log(
                identity,
                request_id,
                method,
                oneway,
                "too_large",
                f"message of {size} bytes exceeds the limit of {self._max_message_bytes} bytes",
            )
            return None
        entry = self._handlers.get(method)
        if entry is None:
            self._reply_or_log(
                identity, request_id, method, oneway, "not_found", f"no method {method!r} here"
            )
            return None
        if not self._takes_tensors and tensors is not None:
            self._reply_or_log(
                identity,
                request_id,
                method,
                oneway,
                "bad_request",
                f"{self._name} takes no tensors; {method!r} {tensors}",
            )
            return None
        return entry

    def _serve(
        self,
        identity: bytes,
        header: dict[str, Any],
        frames: list[Any],
        entry: Entry,
        checked: frozenset[str],
    ) -> None:
        """Decodes a whole request's tensors and runs its handler (inline or on the pool)."""
        method, request_id = header["m"], header["id"]
        oneway = header["k"] == codec.KIND_ONEWAY
        try:
            tensors = codec.decode_tensors(header, frames, framed=entry.framed)
        except ProtocolError as exc:
            self._reply_or_log(identity, request_id, method, oneway, "bad_request", exc)
            return
        request = Request(method, header.get("b"), tensors, identity, oneway, checked)
        if entry.blocking and header.get("sr") and not oneway:
            request.stream = ReplyStream(self, identity, request_id, method)
        if entry.blocking:
            self._workers.submit(self._run_blocking, entry, request, request_id)
        else:
            reply = self._invoke(entry, request, request_id)
            if reply is not None:
                runtime.send(self._router, [identity, *reply])

    def _invoke(
        self,
        entry: Entry,
        request: Request,
        request_id: int,
        response: Response | tuple[str, Exception] | None = None,
    ) -> list[Any] | None:
        """Runs a handler (unless its ``response`` is given); returns the reply frames,
        or None for a one-way message."""
        if response is None:
            response = run_handler(self._name, entry, request)
        if request.oneway:
            return None
        if not isinstance(response, Response):
            return codec.encode_error(request_id, request.method, *response)
        try:
            frames = codec.encode(
                codec.KIND_REPLY, request_id, request.method, response.body, response.tensors
            )
            streamed = request.stream.frames if isinstance(request.stream, ReplyStream) else []
            if response.on_sent is not None:
                frames = _tracked(frames, response.on_sent, streamed)
            return frames
        except Exception as exc:
            # The handler returned what cannot travel (a set, a complex tensor, a list
            # where a tensor belongs): a fault of this side, not the caller's.
            log.error("%s: reply of %s cannot be sent: %s", self._name, request.method, exc)
            return codec.encode_error(request_id, request.method, "internal", exc)

    def _run_blocking(self, entry: Entry, request: Request, request_id: int) -> None:
        reply = self._invoke(entry, request, request_id)
        if reply is not None and not self._stopped.is_set():
            self._push([request.peer, *reply])

    def _reply_or_log(
        self,
        identity: bytes,
        request_id: int,
        method: str,
        oneway: bool,
        code: str,
        error: object,
    ) -> None:
        if oneway:
            log.warning("%s: one-way %s rejected (%s): %s", self._name, method, code, error)
        else:
            self._send_error(identity, request_id, method, code, error)

    def _send_error(
        self, identity: bytes, request_id: int, method: str, code: str, error: object
    ) -> None:
        log.warning(
            "%s: %s request %s rejected (%s): %s", self._name, method, request_id, code, error
        )
        frames = codec.encode_error(request_id, method, code, error)
        self._router.send_multipart([identity, *frames])


def _advertised_host(host: str) -> str:
    """The host peers should dial for a server bound on ``host``."""
    bare = host.strip("[]")
    if bare in ("", "localhost"):
        return "127.0.0.1"
    if bare in ("*", "0.0.0.0", "::"):
        return socket.gethostname()
    return bare


def _tracked(
    frames: list[Any], on_sent: Callable[[Any], None], streamed: list[Any] | None = None
) -> list[Any]:
    """``frames`` with the tensor frames as tracked zero-copy ``zmq.Frame``s.

    The tracker is done once ZeroMQ dropped every reference to the tensors' memory:
    their bytes left (or the peer went away). Frames under ZeroMQ's copy threshold are
    copied at once and count as done. ``streamed``: the tracked frames of the reply's
    parts sent before (``ReplyStream``), which the tracker covers too.
    """
    tensor_frames = [zmq.Frame(f, track=True) for f in frames[1:]]
    on_sent(zmq.MessageTracker(*(streamed or ()), *tensor_frames))
    return [frames[0], *tensor_frames]


def _recv_request(router: zmq.Socket[bytes]) -> list[Any]:
    """One request's frames: the routing id and the header as bytes, tensors as frames.

    The first two are small and copied (a ``zmq.Frame`` costs more to make than its
    bytes cost to copy); tensor frames stay zero-copy. Called when a message is queued:
    ZeroMQ delivers a multipart message whole, so no part of it blocks. A ROUTER puts the
    routing id before every message, which has at least one part, so only the parts after
    the second are asked for.
    """
    frames: list[Any] = [router.recv(), router.recv()]
    while router.getsockopt(_RCVMORE):
        frames.append(router.recv(copy=False))
    return frames


def _bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else bytes(frame.bytes)


def _guess_id(frame: Any) -> int:
    """The request id of a header we could not accept, so the caller gets its answer."""
    try:
        header = msgpack.unpackb(_bytes(frame), raw=False, strict_map_key=False)
        request_id = header.get("id", 0) if isinstance(header, dict) else 0
        return request_id if isinstance(request_id, int) else 0
    except Exception:
        return 0
