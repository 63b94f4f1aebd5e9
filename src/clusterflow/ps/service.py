"""The ``ps.*`` RPC methods of a ps task: ``ps/protocol.py``'s handler on its ``Server``.

Every method runs on the server's pool (``blocking=True``): pulls may wait for a version,
and ps 0 may fan a sync step out to the other shards.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from clusterflow.cluster import ClusterSpec
from clusterflow.ps.handler import PSHandler
from clusterflow.ps.loans import Loan
from clusterflow.ps.protocol import GRAD_PREFIX, METHODS, ApplyRequest
from clusterflow.ps.store import VariableStore
from clusterflow.rpc import Credentials, Request, Response, RpcClient
from clusterflow.rpc.fencing import FENCE_KEY, FenceBook
from clusterflow.rpc.message import Handler
from clusterflow.server import Server

log = logging.getLogger(__name__)

FANOUT_DEADLINE_S = 60.0
HANDLERS_PER_TASK = 16
"""Calls one task may have waiting at once: a pull and a push for each of up to 8
replicas (``--replicas-per-host``). Threads start only as calls need them."""
REPLICA_JOBS = ("chief", "worker")


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
        # Every pull of a sync step waits on a handler thread until the step's last push
        # arrives: with fewer threads than replicas, the last pushes queue behind the
        # waiting pulls and the step never completes (the default pool holds 8).
        replica_tasks = sum(spec.num_tasks(job) for job in spec.jobs if job in REPLICA_JOBS)
        server.reserve_handler_threads(HANDLERS_PER_TASK * replica_tasks + 8)
        fan_out = self._fan_out if len(self._peer_addresses) > 1 else None
        self.handler = PSHandler(self.store, fan_out)
        self.fences = FenceBook()  # rpc/fencing.py: a replaced worker's requests are refused
        self._holder: tuple[str, int] | None = None
        """The task and incarnation that quiesced this ps (a chief cutting a checkpoint)."""
        self._holder_lock = threading.Lock()
        for name in METHODS:
            handler = self.fences.guard(self._serve(name))
            if name in ("quiesce", "resume"):
                handler = self._tracking_holder(name, handler)
            # A push's gradients come as the frames ZeroMQ received: the store applies
            # them chunk by chunk from there (ps/store.py), never joined into one buffer.
            # A push sent in parts (RemotePS) has each frame checked as its part arrives,
            # while the next is on the wire; the step waits for the last part.
            push = name == "push"
            check = self._check_piece if push else None
            server.register(f"ps.{name}", handler, blocking=True, framed=push, check=check)
        # Pushes and pulls move their tensors over a plain TCP socket where ZeroMQ would
        # carry them in clear anyway (rpc/side.py): received straight into tensor memory,
        # sent from it, without ZeroMQ's copy in series with the socket (issue 28).
        server.enable_side_channel()
        self.fences.register_on(server, "ps")  # ps.fence: the manager's relaunches
        self.fences.on_raise(self._release_a_replaced_holder)
        self.fences.on_raise(self._drop_partial_pushes)

    def _check_piece(self, name: str, piece: Any) -> None:
        """One arrived frame of a push sent in parts, on the server's loop thread: the
        store's finite check (``VariableStore.check_piece``), done while the next part is
        on the wire rather than after the last."""
        if name.startswith(GRAD_PREFIX):  # a buffer (b/) is assigned, never checked
            self.store.check_piece(name[len(GRAD_PREFIX) :], piece)

    def _drop_partial_pushes(self, task: str, incarnation: int) -> None:
        """A replaced task's pushes still arriving in parts never apply: its parts are
        dropped now, not at their deadline (a fence clears what the old one left)."""

        def older(method: str, body: Any) -> bool:
            raw = body.get(FENCE_KEY) if isinstance(body, Mapping) else None
            return (
                isinstance(raw, list | tuple)
                and len(raw) == 2
                and raw[0] == task
                and isinstance(raw[1], int)
                and raw[1] < incarnation
            )

        dropped = self.server.drop_partials(older)
        if dropped:
            log.warning(
                "ps:%d: dropped %d unfinished push(es) of %s, replaced by incarnation %d",
                self.store.ps_index,
                dropped,
                task,
                incarnation,
            )

    def _tracking_holder(self, method: str, handler: Handler) -> Handler:
        """Remembers who quiesced this ps (from the request's fence), until it resumes."""

        def tracked(request: Request) -> Any:
            body = request.body
            raw = body.get(FENCE_KEY) if isinstance(body, Mapping) else None
            reply = handler(request)  # a malformed fence was refused in there
            holder = (str(raw[0]), int(raw[1])) if isinstance(raw, list | tuple) else None
            with self._holder_lock:
                self._holder = holder if method == "quiesce" else None
            return reply

        return tracked

    def _release_a_replaced_holder(self, task: str, incarnation: int) -> None:
        """A chief that dies while it holds the ps still (mid-checkpoint) never resumes
        it. When it is a respawnable chief (worker 0 of a cluster without a ``chief``
        job), the manager replaces it alone and the ps lives on: the hold would stop
        every push for good. Its replacement's fence ends the hold; the checkpoint the
        dead chief was writing is never committed (its manifest is the last write)."""
        with self._holder_lock:
            holder = self._holder
            if holder is None or holder[0] != task or holder[1] >= incarnation:
                return
            self._holder = None
        log.warning(
            "ps:%d: %s (incarnation %d) held this ps for a checkpoint and was replaced; "
            "resuming pushes",
            self.store.ps_index,
            task,
            holder[1],
        )
        self.handler.resume()

    def _serve(self, method: str) -> Handler:
        def serve(request: Request) -> Response:
            # Replies send the live variables; a push applying while one is still in
            # flight moves the variable to a copy first (ps/loans.py).
            loan = Loan()
            body, tensors = self.handler.dispatch(
                method,
                request.body,
                request.tensors,
                loan,
                checked=request.checked,
                stream=request.stream,
            )
            # The tracker covers the frames the reply streamed before too (rpc/server.py).
            lent = tensors or request.stream is not None
            return Response(body, tensors, on_sent=loan.sent if lent else None)

        return serve

    def _peer(self, index: int) -> RpcClient:
        if index not in self._peers:
            assert self._credentials is not None
            self._peers[index] = RpcClient(
                self._peer_addresses[index], self._credentials, deadline=FANOUT_DEADLINE_S
            )
        return self._peers[index]

    def _fan_out(self, request: ApplyRequest) -> None:
        """ps 0 decided a sync step: every other shard applies the same replicas."""
        body, _ = request.to_wire()
        for index in self._peer_addresses:
            if index != self.store.ps_index:
                self._peer(index).call(f"ps.{ApplyRequest.METHOD}", body)
