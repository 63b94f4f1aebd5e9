"""clusterflow's RPC layer: request/response and one-way messages over ZeroMQ.

See docs/architecture.md section 4 for the wire contract. Public names:

* ``RpcServer`` / ``RpcClient``: serve and call methods, with deadlines.
* ``Request`` / ``Response``: what handlers take and give.
* ``Credentials``: a cluster's secret; ``plain`` on loopback, ``curve`` elsewhere.
* errors: ``RpcError`` and its kinds; ``CodedError``, an error that travels typed.
"""

from __future__ import annotations

from clusterflow.rpc.auth import AuthMode, Credentials, is_loopback
from clusterflow.rpc.client import DEFAULT_DEADLINE_S, RpcClient, split_endpoint
from clusterflow.rpc.codec import FRAME_BYTES, PROTOCOL_VERSION, WHOLE_BYTES
from clusterflow.rpc.errors import (
    AuthenticationError,
    ClientClosed,
    CodedError,
    DeadlineExceeded,
    MalformedBody,
    ProtocolError,
    RemoteError,
    RpcError,
)
from clusterflow.rpc.message import Handler, Request, Response, body_map
from clusterflow.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, RpcServer

__all__ = [
    "DEFAULT_DEADLINE_S",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "FRAME_BYTES",
    "PROTOCOL_VERSION",
    "WHOLE_BYTES",
    "AuthMode",
    "AuthenticationError",
    "ClientClosed",
    "CodedError",
    "Credentials",
    "DeadlineExceeded",
    "Handler",
    "MalformedBody",
    "ProtocolError",
    "RemoteError",
    "Request",
    "Response",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "body_map",
    "is_loopback",
    "split_endpoint",
]
