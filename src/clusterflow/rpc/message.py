"""The values handlers receive and return."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from clusterflow.rpc.errors import MalformedBody

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Request:
    """One incoming call as a handler sees it."""

    method: str
    body: Any
    tensors: dict[str, torch.Tensor]
    peer: bytes
    """ZeroMQ routing id of the caller: stable for one connection, opaque otherwise."""
    oneway: bool = False
    checked: frozenset[str] = frozenset()
    """Tensors whose every frame the method's ``check`` passed as it arrived (a request
    sent in parts, ``RpcServer.register``): the handler need not check them again."""
    stream: ReplyStream | None = None
    """Where the caller takes the reply in parts (``RpcClient.call``'s ``streamed``) and
    the handler runs on the pool: tensors it sends here leave while it still works."""


class ReplyStream(Protocol):
    """Sends tensors of a reply before the handler returns (``RpcServer``).

    ``begin`` names the tensors (their dtype and shape) once; ``send`` then hands over
    their bytes in order, as buffers (``codec.raw_frame`` and slices of it), each call
    one message that leaves at once. The reply the handler returns ends the stream: its
    body and any other tensors follow, and the caller gets all of them as one
    ``Response``. The buffers are read after ``send`` returned, until the reply's
    ``on_sent`` tracker is done.
    """

    def begin(self, tensors: Mapping[str, torch.Tensor]) -> None: ...

    def send(self, frames: Sequence[Any]) -> None: ...


@dataclass(slots=True)
class Response:
    """What a call returns: a msgpack-able body and named tensors sent as raw frames.

    The tensors leave without a copy, from their own memory, after the handler has
    returned: return a tensor that nothing modifies in place meanwhile (a clone of a
    variable that other handlers update, not the variable itself).
    """

    body: Any = None
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    on_sent: Callable[[Any], None] | None = None
    """Called with a ``zmq.MessageTracker`` over the reply's tensor frames once they are
    handed to ZeroMQ; it is ``done`` when ZeroMQ released their memory. A handler may
    then reply from memory it will modify later, if it writes there only after that
    (the ps replies from its live variables: ``ps/loans.py``). Never called when no
    reply leaves (a one-way call, a failed handler, a stopped server)."""


Handler = Callable[[Request], "Response | Any"]
"""A handler returns a ``Response``, or any msgpack-able value taken as the body."""


def body_map(
    what: str, body: Any, *, none_is_empty: bool = False, error: type[MalformedBody] = MalformedBody
) -> Mapping[str, Any]:
    """``body`` as a map, or ``error`` (a ``MalformedBody``) naming ``what`` and the value.

    Every typed message's parser starts here, so a body that is not a map is refused
    alike whichever service it reached. ``none_is_empty``: a contract whose fields are
    all optional takes an absent body as an empty one.
    """
    if body is None and none_is_empty:
        return {}
    if not isinstance(body, Mapping):
        raise error(f"{what} must be a map, got {body!r:.80}")
    return body
