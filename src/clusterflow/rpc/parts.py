"""Requests and replies in parts (``codec.encode_parts``): a large request travels as
several messages, so the server checks each part's frames while the next is on the
wire, and a blocking handler streams its reply's parts as it computes them
(``Request.stream``). A request cut off mid-transfer reaches no handler: its parts are
dropped at its deadline, when its peer starts another request, or when
``drop_partials`` names it (docs/architecture.md, docs/scaling.md)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from clusterflow.errors import ClusterflowError
from clusterflow.rpc import codec
from clusterflow.rpc.errors import ProtocolError
from clusterflow.rpc.handlers import Check, Entry

if TYPE_CHECKING:
    from clusterflow.rpc.server import RpcServer
    from clusterflow.rpc.side import SideServer

log = logging.getLogger(__name__)

PART_DEADLINE_S = 600.0
"""How long a request sent in parts may take to arrive whole when its header names no
deadline (``dl``): its received parts are dropped then."""


@dataclass(slots=True)
class Partial:
    """A request sent in parts whose last part has not come yet (``codec.encode_parts``).

    Its frames are kept where ZeroMQ received them (no copy): the handler runs only once
    every part came, so a request cut off mid-transfer reaches no handler, and its
    parts are dropped at its deadline, when its peer starts another request, or when
    ``drop_partials`` names it (a fenced task's)."""

    identity: bytes
    request_id: int
    method: str
    header: dict[str, Any]
    entry: Entry
    parts: int
    deadline: float
    pieces: codec.Pieces
    frames: list[Any] = field(default_factory=list)
    seq: int = 1
    unchecked: set[str] = field(default_factory=set)
    failed: tuple[str, BaseException] | None = None


class ReplyStream:
    """A blocking handler's ``Request.stream``: parts of its reply sent as it works.

    Each part goes to the loop through the pool's DEALER, as a whole reply does, so the
    parts and then the reply leave in order. Their frames are tracked: the reply's
    ``on_sent`` tracker covers them too."""

    def __init__(self, server: RpcServer, identity: bytes, request_id: int, method: str) -> None:
        self._server = server
        self._identity = identity
        self._request_id = request_id
        self._method = method
        self._descriptors: list[list[Any]] | None = None
        self._seq = 0
        self.frames: list[zmq.Frame] = []
        """Every tensor frame sent so far, tracked."""

    def begin(self, tensors: Any) -> None:
        if self._descriptors is not None:
            raise RuntimeError(f"{self._method}: the reply's stream was begun twice")
        self._descriptors = [codec.descriptor(name, t) for name, t in tensors.items()]

    def send(self, frames: Any) -> None:
        if self._descriptors is None:
            raise RuntimeError(f"{self._method}: a reply's stream sent before it was begun")
        header: dict[str, Any] = {
            "v": codec.PROTOCOL_VERSION,
            "k": codec.KIND_PART,
            "id": self._request_id,
            "m": self._method,
            "s": self._seq,
        }
        if self._seq == 0:
            header["t"] = self._descriptors
        self._seq += 1
        tracked = [zmq.Frame(f, track=True) for f in frames]
        self.frames.extend(tracked)
        self._server._push([self._identity, msgpack.packb(header), *tracked])


class RequestsInParts:
    """``RpcServer``'s side of requests sent in parts: a large request (the ps's push)
    arrives as several messages, each part's frames kept where ZeroMQ received them and
    checked as they come (``Entry.check``), the handler run once the last came.

    A mixin of ``RpcServer``, one concept apart from the loop that serves whole
    messages; it reads the server's table of methods and answers through it."""

    _name: str
    _partials: dict[bytes, Partial]
    _partials_lock: threading.Lock
    _side: SideServer | None

    if TYPE_CHECKING:

        def _serve(
            self,
            identity: bytes,
            header: dict[str, Any],
            frames: list[Any],
            entry: Entry,
            checked: frozenset[str],
        ) -> None: ...

        def _reply_or_log(
            self,
            identity: bytes,
            request_id: int,
            method: str,
            oneway: bool,
            code: str,
            error: object,
        ) -> None: ...

        def _send_error(
            self, identity: bytes, request_id: int, method: str, code: str, error: object
        ) -> None: ...

        def _push(self, frames: list[Any]) -> None: ...

        def _admit(
            self, identity: bytes, header: dict[str, Any], size: int, tensors: str | None
        ) -> Entry | None: ...

    def drop_partials(self, match: Callable[[str, Any], bool]) -> int:
        """Drops the requests sent in parts, not all arrived, for which
        ``match(method, body)`` is true (the body is the first part's); how many.

        Their handler never runs: a later part finds no request to join and is answered
        with a ``protocol`` error. The ps drops a fenced worker's pushes this way.
        """
        with self._partials_lock:
            gone = [k for k, p in self._partials.items() if match(p.method, p.header.get("b"))]
            for key in gone:
                del self._partials[key]
        side = self._side.drop(match) if self._side is not None else 0
        return len(gone) + side

    def partials(self) -> int:
        """Requests sent in parts whose last part has not come, and side-channel
        requests whose bytes are arriving (tests, stats)."""
        with self._partials_lock:
            zmq_parts = len(self._partials)
        return zmq_parts + (self._side.in_flight() if self._side is not None else 0)

    def _begin(
        self, identity: bytes, header: dict[str, Any], frames: list[Any], oneway: bool
    ) -> None:
        """The first part of a request sent in parts: checked as a whole request's
        header is, then kept (with its frames) until the rest came."""
        method, request_id, parts = header["m"], header["id"], header.get("n")
        if not isinstance(parts, int) or isinstance(parts, bool) or parts < 2:
            self._reply_or_log(
                identity, request_id, method, oneway, "protocol", f"bad part count n={parts!r}"
            )
            return
        try:
            pieces = codec.Pieces(header.get("t"))
        except ProtocolError as exc:
            self._reply_or_log(identity, request_id, method, oneway, "bad_request", exc)
            return
        entry = self._admit(
            identity, header, pieces.total + len(frames[1]), f"came in {parts} parts"
        )
        if entry is None:
            return
        wait = header.get("dl", PART_DEADLINE_S)
        if not isinstance(wait, int | float) or isinstance(wait, bool) or not wait > 0:
            wait = PART_DEADLINE_S
        partial = Partial(
            identity,
            request_id,
            method,
            header,
            entry,
            parts,
            time.monotonic() + min(float(wait), PART_DEADLINE_S),
            pieces,
        )
        with self._partials_lock:
            self._partials[identity] = partial
        self._take(partial, frames[2:])

    def _more(self, identity: bytes, header: dict[str, Any], frames: list[Any]) -> None:
        """A later part: joined to its request, which it completes if it is the last."""
        request_id, method, seq = header["id"], header["m"], header.get("s")
        with self._partials_lock:
            partial = self._partials.get(identity)
            if partial is not None and (partial.request_id != request_id or partial.seq != seq):
                del self._partials[identity]  # misordered: the request cannot complete
        if partial is None:
            self._send_error(
                identity,
                request_id,
                method,
                "protocol",
                f"part {seq!r} of request {request_id} belongs to no request in progress "
                f"(it expired, was dropped, or its first part never came)",
            )
            return
        if partial.request_id != request_id or partial.seq != seq:
            self._send_error(
                identity,
                partial.request_id,
                partial.method,
                "protocol",
                f"part {seq!r} of request {request_id} came where part {partial.seq} of "
                f"request {partial.request_id} was due; the request is dropped",
            )
            return
        partial.seq += 1
        self._take(partial, frames)

    def _take(self, partial: Partial, frames: list[Any]) -> None:
        """Keeps one part's frames, checking each (``Entry.check``); serves the request
        once its last part came."""
        if partial.failed is None:
            try:
                arrived = partial.pieces.feed(frames)
            except ProtocolError as exc:
                partial.failed = ("bad_request", exc)
            else:
                partial.frames.extend(frames)
                check = partial.entry.check
                if check is not None:
                    self._check(partial, check, arrived)
            if partial.failed is not None:
                partial.frames.clear()  # refused: the rest of it is read and dropped
        if partial.seq < partial.parts:
            return
        with self._partials_lock:
            if self._partials.get(partial.identity) is not partial:
                return  # dropped meanwhile (drop_partials)
            del self._partials[partial.identity]
        header, oneway = partial.header, partial.header["k"] == codec.KIND_ONEWAY
        if partial.failed is not None:
            code, error = partial.failed
            self._reply_or_log(
                partial.identity, partial.request_id, partial.method, oneway, code, error
            )
            return
        checked: frozenset[str] = frozenset()
        if partial.entry.check is not None:
            checked = frozenset(d[0] for d in header.get("t") or ()) - partial.unchecked
        self._serve(partial.identity, header, partial.frames, partial.entry, checked)

    def _check(
        self, partial: Partial, check: Check, arrived: list[tuple[str, str, int, Any]]
    ) -> None:
        for name, dtype, _, frame in arrived:
            view = codec.piece(dtype, frame)
            if view is None:
                partial.unchecked.add(name)  # the handler checks it whole
                continue
            try:
                check(name, view)
            except Exception as exc:
                if isinstance(exc, ClusterflowError):
                    log.info("%s: %s refused: %s", self._name, partial.method, exc)
                    partial.failed = ("app", exc)
                else:
                    log.exception("%s: check of %s raised", self._name, partial.method)
                    partial.failed = ("internal", exc)
                return

    def _expire_partials(self) -> None:
        """Drops the requests sent in parts whose deadline passed (their caller gave up)."""
        now = time.monotonic()
        with self._partials_lock:
            gone = [k for k, p in self._partials.items() if p.deadline < now]
            for key in gone:
                partial = self._partials.pop(key)
                log.warning(
                    "%s: %s request %s: %d of %d parts came before its deadline; dropped",
                    self._name,
                    partial.method,
                    partial.request_id,
                    partial.seq,
                    partial.parts,
                )
