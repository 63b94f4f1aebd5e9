"""The worker's side of the parameter server: one connection per ps task.

``RemotePS`` talks to ps tasks over RPC, one message per ps task per request, several
ps tasks in parallel. ``LocalPS`` (``ps/local.py``) serves the same requests in process
(``CentralStorageStrategy``: one local ps, no network). Both speak ``ps/protocol.py``:
its types on the way in and out, its one ``PSHandler`` at the other end. This module
loads nothing of the ps itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from clusterflow.cluster import ClusterSpec
from clusterflow.ps.protocol import PullReply, PullRequest, PushReply, PushRequest
from clusterflow.ps.wire import Tensors, Wire
from clusterflow.rpc import Credentials, RemoteError, RpcClient
from clusterflow.rpc.codec import PART_BYTES
from clusterflow.rpc.fencing import Fence, raise_if_fenced, stamp, watch

T = TypeVar("T")


class Request(Protocol):
    """A typed ``ps.*`` request (``ps/protocol.py``, ``ps/rows_protocol.py``)."""

    @property
    def METHOD(self) -> str: ...

    def to_wire(self) -> Wire: ...


class PSConnection(Protocol):
    """What a strategy needs from the ps tasks; ``index`` picks the task."""

    @property
    def num_ps(self) -> int: ...

    def call(
        self, index: int, method: str, body: Any = None, tensors: Tensors | None = None
    ) -> tuple[Any, Tensors]:
        """Calls ``ps.<method>`` on ps task ``index``; returns (reply body, reply tensors)."""
        ...

    def pull(self, index: int, request: PullRequest) -> PullReply:
        """Values of ps task ``index`` once it reached ``request.min_version``.

        Raises:
            PSError or RemoteError: unknown variables, or the version did not come
                within ``request.timeout``.
        """
        ...

    def push(self, index: int, request: PushRequest) -> PushReply:
        """Pushes gradients to ps task ``index``; the reply says whether they were applied.

        Raises:
            PushRejected or RemoteError: a gradient of a wrong shape, dtype or name, or
                not finite; nothing of the push was applied.
        """
        ...

    def map(self, fn: Callable[[int], T], indices: Sequence[int]) -> list[T]:
        """Runs ``fn`` for every index, in parallel where that helps; keeps the order."""
        ...

    def close(self) -> None: ...


CONTROL_METHODS = frozenset({"quiesce", "resume", "state", "load_state", "stats"})
"""Calls that go over a connection of their own: a sync worker's prefetch holds its data
connection in a pull that waits for the next step, and the step may need the chief's
checkpoint (quiesce, state, resume) to finish first."""


PARTED_METHODS = frozenset({"push", "rows_push"})
"""Calls whose large tensors travel in several messages (``RpcClient.call``'s
``part_bytes``): a ps works on one while the next arrives."""


class RemotePS:
    def __init__(
        self, spec: ClusterSpec, credentials: Credentials, *, deadline: float = 120.0
    ) -> None:
        if "ps" not in spec.jobs or not spec.num_tasks("ps"):
            from clusterflow.errors import ConfigError

            raise ConfigError(f"the cluster has no ps job: {spec.as_dict()}")
        self._clients = [
            RpcClient(spec.task_address("ps", i), credentials, deadline=deadline)
            for i in spec.task_indices("ps")
        ]
        self._control = [
            RpcClient(spec.task_address("ps", i), credentials, deadline=deadline)
            for i in spec.task_indices("ps")
        ]
        self._pool = (
            ThreadPoolExecutor(len(self._clients), thread_name_prefix="ps-client")
            if len(self._clients) > 1
            else None
        )
        self._fence = Fence.from_env()
        """Who this process is, on every request: a replaced worker is refused."""
        for client in [*self._clients, *self._control]:
            watch(client, "ps", self._fence)  # a lost connection: ask if we were fenced

    @property
    def num_ps(self) -> int:
        return len(self._clients)

    def call(
        self, index: int, method: str, body: Any = None, tensors: Tensors | None = None
    ) -> tuple[Any, Tensors]:
        return self._call(index, method, body, tensors, framed=False)

    def _call(
        self, index: int, method: str, body: Any, tensors: Tensors | None, *, framed: bool
    ) -> tuple[Any, Tensors]:
        clients = self._control if method in CONTROL_METHODS else self._clients
        if method != "load_state":  # its body is the ps's state, key for key
            body = stamp(body, self._fence)
        # A push's gradients go in parts (rpc.codec.encode_parts): the ps checks each
        # while the next is on the wire, and applies the push once the last came.
        parts = PART_BYTES if method in PARTED_METHODS else 0
        try:
            reply = clients[index].call(
                f"ps.{method}",
                body,
                tensors,
                framed=framed,
                part_bytes=parts,
                streamed=method == "push",  # its values may leave as the ps steps them
                side=framed,  # pushes and pulls: over the ps's side channel where it has one
            )
        except RemoteError as exc:
            raise_if_fenced(exc)  # TaskFenced: this worker was replaced; it stops here
            raise
        return reply.body, dict(reply.tensors)

    # Pulled values (a pull's, an async push's reply) come as the frames ZeroMQ
    # received (``codec.Framed``): ``shards.load_into`` writes each frame straight into
    # its parameter, the one copy between the socket and the model.

    def pull(self, index: int, request: PullRequest) -> PullReply:
        return PullReply.from_wire(
            *self._call(index, request.METHOD, *request.to_wire(), framed=True)
        )

    def push(self, index: int, request: PushRequest) -> PushReply:
        return PushReply.from_wire(
            *self._call(index, request.METHOD, *request.to_wire(), framed=True)
        )

    def map(self, fn: Callable[[int], T], indices: Sequence[int]) -> list[T]:
        if self._pool is None or len(indices) < 2:
            return [fn(i) for i in indices]
        return list(self._pool.map(fn, indices))

    def close(self) -> None:
        for client in [*self._clients, *self._control]:
            client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def send(ps: PSConnection, index: int, request: Request) -> Wire:
    """Sends a typed request to ps task ``index``; the reply as it travels, for the
    reply type's ``from_wire``. Every request a worker makes goes out through its type."""
    return ps.call(index, request.METHOD, *request.to_wire())
