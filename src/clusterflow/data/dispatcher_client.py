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

from clusterflow.data.api import DatasetSpec, LeaseReply
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
        body = {"spec": spec.to_wire(), "locations": locations}
        reply: dict[str, Any] = self._call("data.register", body)
        return reply

    def lease(
        self,
        name: str,
        worker: str,
        host: str | None,
        acks: list[int] | None = None,
        count: int | None = None,
    ) -> dict[str, Any]:
        """The next split, after acking ``acks`` (one call instead of two); with
        ``count``, up to that many, listed in the reply's ``leases``."""
        body: dict[str, Any] = {
            "name": name,
            "worker": worker,
            "host": host,
            "incarnation": INCARNATION,
        }
        if acks:
            body["acks"] = acks
        if count is not None:
            body["count"] = count
        reply: dict[str, Any] = self._call("data.lease", body)
        return reply

    def lease_many(
        self,
        name: str,
        worker: str,
        host: str | None,
        count: int,
        acks: list[int] | None = None,
    ) -> LeaseReply:
        """Up to ``count`` splits in one call (1 to ``dispatcher.MAX_LEASES_PER_CALL``),
        each under its own lease, after acking ``acks``: one round trip for a worker that
        keeps several splits leased ahead.

        Raises:
            RemoteError: ``count`` is out of range (``error_type`` ``ConfigError``, the
                message names the value), an ack names an unknown lease, or nobody
                registered ``name``.
        """
        return LeaseReply.from_wire(self.lease(name, worker, host, acks, count))

    def ack(self, name: str, lease_ids: Iterable[int], worker: str | None = None) -> dict[str, int]:
        """Marks leases applied.

        Raises:
            RemoteError: an id is unknown to the dispatcher (``error_type`` is
                ``UnknownLeaseError``; the message names each id), or so is the dataset.
        """
        body = {"name": name, "leases": [int(x) for x in lease_ids], "worker": worker}
        reply: dict[str, int] = self._call("data.ack", body)
        return reply

    def release(self, name: str, worker: str, lease_ids: Iterable[int] | None = None) -> int:
        body: dict[str, Any] = {"name": name, "worker": worker}
        if lease_ids is not None:
            body["leases"] = [int(x) for x in lease_ids]
        return int(self._call("data.release", body)["released"])

    def status(self, name: str) -> dict[str, Any]:
        reply: dict[str, Any] = self._call("data.status", {"name": name})
        return reply

    def state_dict(self) -> dict[str, Any]:
        reply: dict[str, Any] = self.rpc.call("data.state_dict").body
        return reply

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rpc.call("data.load_state_dict", dict(state))
