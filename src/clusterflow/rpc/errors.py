"""Errors of the RPC layer.

Each failure a caller must tell apart has its own type: a peer that does not answer in
time (``DeadlineExceeded``), one that refuses our credentials (``AuthenticationError``),
one that speaks another protocol version (``ProtocolError``) and one that answered with
an error (``RemoteError``, carrying the remote code and message).

An error a caller must act on (a fenced task stops, a version wait that ran out is
retried) is a ``CodedError``: it declares a stable ``wire_code``, the server sends that
code with the error reply, and the client raises a ``RemoteError`` that is also an
instance of the registered class (``remote_error``). Callers then decide by type
(``except TaskFenced``), never by the remote class's name or message, and a renamed
class or a reworded message cannot change a decision.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from clusterflow.errors import ClusterflowError

RESERVED_CODES = frozenset({"not_found", "bad_request", "too_large", "protocol", "internal", "app"})
"""``RemoteError.code``'s reasons, which say who refused a call; no wire code may be one."""

_REMOTE_TYPES: dict[str, type[RemoteError]] = {}
"""Wire code -> the ``RemoteError`` subclass that is also the registered ``CodedError``."""


class RpcError(ClusterflowError):
    """Base of every error raised by ``clusterflow.rpc``."""


class DeadlineExceeded(RpcError, TimeoutError):
    """The peer did not answer within the call's deadline (dead, hung or unreachable)."""


class PeerLost(RpcError, ConnectionError):
    """The connection broke in the middle of a call (the peer died or cut it): on the
    side channel (``rpc/side.py``), where a TCP connection's end is seen at once."""


class AuthenticationError(RpcError):
    """The peer refused our credentials (another cluster's secret, or none)."""


class ProtocolError(RpcError):
    """A message was malformed or carried a protocol version we do not speak."""


class ClientClosed(RpcError):
    """The client was closed; no further calls can be made on it."""


class RemoteError(RpcError):
    """The peer answered with an error reply.

    Attributes:
        code: a stable machine-readable reason (``not_found``, ``bad_request``,
            ``too_large``, ``protocol``, ``internal``, ``app``).
        error_type: the name of the exception class raised by the remote handler, for
            messages and logs only: a caller that must act on an error catches its
            ``CodedError`` type instead.
        method: the method that was called.
    """

    def __init__(self, code: str, message: str, *, error_type: str = "", method: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.error_type = error_type
        self.method = method

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (a Ray task's or a coordinator's error) by what it carries, so the
        # typed class a wire code maps to comes back as itself on the other side.
        wire_code = getattr(type(self), "wire_code", "")
        return (remote_error, (self.code, str(self), self.error_type, self.method, wire_code))


class CodedError(ClusterflowError):
    """An error a remote caller must act on by its type, not by its text.

    A subclass that declares its own ``wire_code`` is registered at class creation: a
    handler raising it answers with that code, and the client raises
    ``remote_error``'s typed ``RemoteError``, an instance of the subclass too. A
    subclass without a code of its own travels as its nearest registered ancestor.
    A process learns a code when the module defining its class is imported, which is
    the case wherever code catches the class.
    """

    wire_code: ClassVar[str] = ""
    """Stable name of the error on the wire (``fenced``); never rename one in use."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("wire_code")
        if code is None or issubclass(cls, RemoteError):
            return  # inherits its ancestor's code, or is a remote twin built below
        if not isinstance(code, str) or not code or code in RESERVED_CODES:
            raise TypeError(f"{cls.__qualname__}: wire_code {code!r} is empty or reserved")
        known = _REMOTE_TYPES.get(code)
        same = known is not None and (known.__module__, known.__qualname__) == (
            cls.__module__,
            f"Remote{cls.__qualname__}",
        )  # the same class defined again (its module reloaded) takes its code back
        if known is not None and not same:
            raise TypeError(f"{cls.__qualname__}: wire_code {code!r} is taken by {known}")
        # RemoteError first in the bases: its __init__ (code, message, ...) is the one
        # called; the registered class's constructor takes the message only.
        twin = cast(
            "type[RemoteError]",
            type(f"Remote{cls.__name__}", (RemoteError, cls), {"__module__": cls.__module__}),
        )
        twin.__qualname__ = f"Remote{cls.__qualname__}"
        _REMOTE_TYPES[code] = twin


def remote_error(
    code: str, message: str, error_type: str = "", method: str = "", wire_code: str = ""
) -> RemoteError:
    """The exception for an error reply: typed when ``wire_code`` is registered here.

    An unknown or empty ``wire_code`` (a peer of another version, a class this process
    never imported) gives a plain ``RemoteError``: every caller still catches it as one.
    """
    cls = _REMOTE_TYPES.get(wire_code, RemoteError) if wire_code else RemoteError
    return cls(code, message, error_type=error_type, method=method)


class MalformedBody(CodedError):
    """A request's or reply's body breaks its contract: not a map, a field missing or of
    another type. The sender's bug, so no caller retries it.

    The one error every wire contract raises for it (``body_map`` checks the map); a
    service's own kind (``ps``'s ``MalformedRequest``, the coordinator's
    ``MalformedMessage``) subclasses it, so a caller may catch either, locally or, by
    the wire code, remotely.
    """

    wire_code = "malformed"
