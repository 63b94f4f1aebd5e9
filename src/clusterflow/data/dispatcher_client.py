"""The dispatcher's client: one typed method per ``data.*`` call of the data service.

Apart from ``client.py`` (the prefetching iterator) because it is the wire contract of the
dispatcher, used by the iterator, by strategies that hand leases back, and by tests,
without the iterator's threads.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from clusterflow.data.api import DatasetSpec
from clusterflow.data.messages import (
    LOAD_STATE_DICT,
    STATE_DICT,
    AckRequest,
    LeaseReply,
    LeaseRequest,
    RegisterRequest,
    ReleaseRequest,
    StatusRequest,
)
from clusterflow.rpc import RemoteError, RpcClient
from clusterflow.rpc.fencing import Fence, raise_if_fenced, stamp, watch

__all__ = ["INCARNATION", "DispatcherClient"]

INCARNATION = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
"""This process's identity: a restarted task reuses its name, never this."""


class DispatcherClient:
    """Calls the dispatcher's ``data.*`` methods (thread-safe, as ``RpcClient`` is)."""

    def __init__(self, rpc: RpcClient) -> None:
        self.rpc = rpc
        self._fence = Fence.from_env()
        watch(rpc, "data", self._fence)  # a lost connection: ask if we were fenced

    def _call(self, method: str, body: Any = None) -> Any:
        """One ``data.*`` call, fenced (rpc/fencing.py): a replaced worker stops here.

        Raises:
            TaskFenced: this task was relaunched; the dispatcher refuses this process.
        """
        try:
            return self.rpc.call(method, stamp(body, self._fence)).body
        except RemoteError as exc:
            raise_if_fenced(exc)
            raise

    def register(self, spec: DatasetSpec, locations: list[list[Any]]) -> dict[str, Any]:
        request = RegisterRequest(spec=spec, locations=locations)
        reply: dict[str, Any] = self._call(request.METHOD, request.to_wire())
        return reply

    def lease(
        self,
        name: str,
        worker: str,
        host: str | None,
        acks: list[int] | None = None,
        count: int | None = None,
    ) -> LeaseReply:
        """The next split, after acking ``acks`` (one call instead of two); with
        ``count``, up to that many (1 to ``MAX_LEASES_PER_CALL``), each under its own
        lease: one round trip for a worker that keeps several splits leased ahead.

        Raises:
            RemoteError: ``count`` is out of range (a ``MalformedBody``, the message
                names the value), an ack names an unknown lease, or nobody registered
                ``name``.
        """
        request = LeaseRequest(
            name=name,
            worker=worker,
            host=host,
            incarnation=INCARNATION,
            acks=tuple(acks or ()),
            count=count,
        )
        return LeaseReply.from_wire(self._call(request.METHOD, request.to_wire()))

    def lease_many(
        self,
        name: str,
        worker: str,
        host: str | None,
        count: int,
        acks: list[int] | None = None,
    ) -> LeaseReply:
        """Up to ``count`` splits in one call (``lease`` with a count)."""
        return self.lease(name, worker, host, acks, count)

    def ack(self, name: str, lease_ids: Iterable[int], worker: str | None = None) -> dict[str, int]:
        """Marks leases applied.

        Raises:
            RemoteError: an id is unknown to the dispatcher (``error_type`` is
                ``UnknownLeaseError``; the message names each id), or so is the dataset.
        """
        request = AckRequest(name=name, leases=tuple(int(x) for x in lease_ids), worker=worker)
        reply: dict[str, int] = self._call(request.METHOD, request.to_wire())
        return reply

    def release(self, name: str, worker: str, lease_ids: Iterable[int] | None = None) -> int:
        leases = None if lease_ids is None else tuple(int(x) for x in lease_ids)
        request = ReleaseRequest(name=name, worker=worker, leases=leases)
        return int(self._call(request.METHOD, request.to_wire())["released"])

    def status(self, name: str) -> dict[str, Any]:
        request = StatusRequest(name=name)
        reply: dict[str, Any] = self._call(request.METHOD, request.to_wire())
        return reply

    def state_dict(self) -> dict[str, Any]:
        reply: dict[str, Any] = self.rpc.call(STATE_DICT).body
        return reply

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rpc.call(LOAD_STATE_DICT, dict(state))
