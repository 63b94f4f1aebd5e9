"""The worker's side of the parameter server: one connection per ps task.

``RemotePS`` talks to ps tasks over RPC, one message per ps task per request, several
ps tasks in parallel. ``LocalPS`` calls an in-process ``VariableStore`` with the same
interface (``CentralStorageStrategy``: one local ps, no network).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import torch

from clusterflow.cluster import ClusterSpec
from clusterflow.ps.api import PSConfig
from clusterflow.ps.service import wire_cast
from clusterflow.ps.store import VariableStore
from clusterflow.rpc import Credentials, RpcClient

T = TypeVar("T")
Tensors = dict[str, torch.Tensor]


class PSConnection(Protocol):
    """What a strategy needs from the ps tasks; ``index`` picks the task."""

    @property
    def num_ps(self) -> int: ...

    def call(
        self, index: int, method: str, body: Any = None, tensors: Tensors | None = None
    ) -> tuple[Any, Tensors]:
        """Calls ``ps.<method>`` on ps task ``index``; returns (reply body, reply tensors)."""
        ...

    def map(self, fn: Callable[[int], T], indices: Sequence[int]) -> list[T]:
        """Runs ``fn`` for every index, in parallel where that helps; keeps the order."""
        ...

    def close(self) -> None: ...


CONTROL_METHODS = frozenset({"quiesce", "resume", "state", "load_state", "stats"})
"""Calls that go over a connection of their own: a sync worker's prefetch holds its data
connection in a pull that waits for the next step, and the step may need the chief's
checkpoint (quiesce, state, resume) to finish first."""


class RemotePS:
    def __init__(
        self, spec: ClusterSpec, credentials: Credentials, *, deadline: float = 120.0
    ) -> None:
        if "ps" not in spec.jobs:
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

    @property
    def num_ps(self) -> int:
        return len(self._clients)

    def call(
        self, index: int, method: str, body: Any = None, tensors: Tensors | None = None
    ) -> tuple[Any, Tensors]:
        clients = self._control if method in CONTROL_METHODS else self._clients
        reply = clients[index].call(f"ps.{method}", body, tensors)
        return reply.body, dict(reply.tensors)

    def map(self, fn: Callable[[int], T], indices: Sequence[int]) -> list[T]:
        if self._pool is None or len(indices) < 2:
            return [fn(i) for i in indices]
        return list(self._pool.map(fn, indices))

    def close(self) -> None:
        for client in [*self._clients, *self._control]:
            client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class LocalPS:
    """One in-process ps: the same calls, no network, no copies on the wire."""

    def __init__(self, store: VariableStore | None = None) -> None:
        self.store = store or VariableStore(0)

    @property
    def num_ps(self) -> int:
        return 1

    def call(
        self, index: int, method: str, body: Any = None, tensors: Tensors | None = None
    ) -> tuple[Any, Tensors]:
        body = body or {}
        tensors = tensors or {}
        store = self.store
        if method == "create":
            return {
                "created": store.create(PSConfig.from_dict(body["config"]), body["vars"], tensors)
            }, {}
        if method == "optimizer":
            from clusterflow.ps.optimizer import OptimizerSpec

            store.set_optimizer(OptimizerSpec.from_dict(body["spec"]), body["group_of"])
            return None, {}
        if method == "pull":
            version, values = store.pull(body.get("names"), int(body.get("min_version") or 0))
            return {"version": version}, wire_cast(values, body.get("dtype"))
        if method == "push":
            result = store.push(
                worker=str(body["worker"]),
                version=int(body["version"]),
                grads={k[2:]: t for k, t in tensors.items() if k.startswith("g/")},
                buffers={k[2:]: t for k, t in tensors.items() if k.startswith("b/")},
                keys=body.get("keys") or (),
                hyper=body.get("hyper"),
                commit=bool(body.get("commit")),
                want_values=bool(body.get("want_values")),
            )
            reply = {
                "applied": result.applied,
                "version": result.version,
                "reason": result.reason,
                "staleness": result.staleness,
                "duplicates": [list(k) for k in result.duplicates],
            }
            return reply, wire_cast(result.values, body.get("values_dtype"))
        if method == "stats":
            return store.snapshot_stats(), {}
        if method == "leave":
            store.leave(str(body["worker"]))
            return None, {}
        if method == "wait_version":
            return {
                "version": store.wait_version(
                    int(body["version"]), float(body.get("timeout", 60.0))
                )
            }, {}
        if method == "state":
            return store.state()
        if method == "quiesce":
            return {"version": store.quiesce()}, {}
        if method == "resume":
            store.resume()
            return None, {}
        if method == "load_state":
            store.load_state(body, tensors)
            return None, {}
        raise ValueError(f"unknown ps method {method!r}")

    def map(self, fn: Callable[[int], T], indices: Sequence[int]) -> list[T]:
        return [fn(i) for i in indices]

    def close(self) -> None:
        pass
