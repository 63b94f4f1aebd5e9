"""Errors of the RPC layer.

Each failure a caller must tell apart has its own type: a peer that does not answer in
time (``DeadlineExceeded``), one that refuses our credentials (``AuthenticationError``),
one that speaks another protocol version (``ProtocolError``) and one that answered with
an error (``RemoteError``, carrying the remote code and message).
"""

from __future__ import annotations

from clusterflow.errors import ClusterflowError


class RpcError(ClusterflowError):
    """Base of every error raised by ``clusterflow.rpc``."""


class DeadlineExceeded(RpcError, TimeoutError):
    """The peer did not answer within the call's deadline (dead, hung or unreachable)."""


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
        error_type: the name of the exception class raised by the remote handler.
        method: the method that was called.
    """

    def __init__(self, code: str, message: str, *, error_type: str = "", method: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.error_type = error_type
        self.method = method
