"""The ``ps.*`` RPC methods of a ps task, mapped onto its ``VariableStore``.

Tensor names on the wire carry a role prefix: ``g/`` gradients and ``b/`` buffer
values in a push, plain names in a pull's reply. Every handler runs on the server's
pool (``blocking=True``): pulls may wait for a version, and ps 0 may fan a sync step
out to the other shards.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from clusterflow.cluster import ClusterSpec
from clusterflow.ps.api import PSConfig
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.store import VariableStore
from clusterflow.rpc import Credentials, Request, Response, RpcClient
from clusterflow.server import Server

log = logging.getLogger(__name__)

FANOUT_DEADLINE_S = 60.0


def wire_cast(tensors: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """Casts floating tensors to the wire dtype (bf16 halves the bytes of a pull)."""
    if dtype in (None, "float32"):
        return tensors
    target = getattr(torch, str(dtype))
    return {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}


class PSService:
    """Serves one ps task's shards on its ``Server``."""

    def __init__(self, server: Server, store: VariableStore | None = None) -> None:
        self.server = server
        task = server.task
        self.store = store or VariableStore(task.index if task.job == "ps" else 0)
        self._peers: dict[int, RpcClient] = {}
        spec: ClusterSpec = server.cluster_spec
        self._peer_addresses = {
            i: spec.task_address("ps", i)
            for i in (spec.task_indices("ps") if "ps" in spec.jobs else [])
        }
        self._credentials: Credentials | None = server.credentials
        for name in (
            "create",
            "optimizer",
            "pull",
            "push",
            "apply",
            "wait_version",
            "quiesce",
            "resume",
            "state",
            "load_state",
            "stats",
            "leave",
        ):
            server.register(f"ps.{name}", getattr(self, f"_on_{name}"), blocking=True)

    def _peer(self, index: int) -> RpcClient:
        if index not in self._peers:
            assert self._credentials is not None
            self._peers[index] = RpcClient(
                self._peer_addresses[index], self._credentials, deadline=FANOUT_DEADLINE_S
            )
        return self._peers[index]

    def _on_create(self, request: Request) -> dict[str, Any]:
        body = request.body or {}
        config = PSConfig.from_dict(body["config"])
        created = self.store.create(config, body["vars"], request.tensors)
        return {"created": created}

    def _on_optimizer(self, request: Request) -> None:
        body = request.body or {}
        self.store.set_optimizer(OptimizerSpec.from_dict(body["spec"]), body["group_of"])

    def _on_pull(self, request: Request) -> Response:
        body = request.body or {}
        version, values = self.store.pull(
            body.get("names"), int(body.get("min_version") or 0), float(body.get("timeout", 60.0))
        )
        return Response({"version": version}, wire_cast(values, body.get("dtype")))

    def _on_push(self, request: Request) -> Response:
        body = request.body or {}
        grads = {k[2:]: t for k, t in request.tensors.items() if k.startswith("g/")}
        buffers = {k[2:]: t for k, t in request.tensors.items() if k.startswith("b/")}
        result = self.store.push(
            worker=str(body["worker"]),
            version=int(body["version"]),
            grads=grads,
            buffers=buffers,
            keys=body.get("keys") or (),
            hyper=body.get("hyper"),
            commit=bool(body.get("commit")),
            want_values=bool(body.get("want_values")),
            timeout=float(body.get("timeout", 60.0)),
        )
        if result.commit is not None and len(self._peer_addresses) > 1:
            self._fan_out(result.commit)
        reply = {
            "applied": result.applied,
            "version": result.version,
            "reason": result.reason,
            "staleness": result.staleness,
            "duplicates": [list(k) for k in result.duplicates],
        }
        return Response(reply, wire_cast(result.values, body.get("values_dtype")))

    def _fan_out(self, commit: dict[str, Any]) -> None:
        """ps 0 decided a sync step: every other shard applies the same replicas."""
        self.store.begin_fanout()
        try:
            for index in self._peer_addresses:
                if index != self.store.ps_index:
                    self._peer(index).call("ps.apply", commit)
        finally:
            self.store.end_fanout()

    def _on_apply(self, request: Request) -> dict[str, Any]:
        body = request.body or {}
        version = self.store.apply_sync(int(body["version"]), [str(w) for w in body["workers"]])
        return {"version": version}

    def _on_wait_version(self, request: Request) -> dict[str, Any]:
        body = request.body or {}
        version = self.store.wait_version(int(body["version"]), float(body.get("timeout", 60.0)))
        return {"version": version}

    def _on_quiesce(self, request: Request) -> dict[str, Any]:
        return {"version": self.store.quiesce(float((request.body or {}).get("timeout", 60.0)))}

    def _on_resume(self, request: Request) -> None:
        self.store.resume()

    def _on_state(self, request: Request) -> Response:
        meta, tensors = self.store.state()
        return Response(meta, tensors)

    def _on_load_state(self, request: Request) -> None:
        self.store.load_state(request.body or {}, request.tensors)

    def _on_leave(self, request: Request) -> None:
        commit = self.store.leave(str((request.body or {})["worker"]))
        if commit is not None and len(self._peer_addresses) > 1:
            self._fan_out(commit)

    def _on_stats(self, request: Request) -> dict[str, Any]:
        return self.store.snapshot_stats()
