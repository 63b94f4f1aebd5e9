"""The one handler of the ``ps.*`` contract: where requests meet a ps task's state.

``PSService`` registers it on the ps task's RPC server; ``LocalPS`` calls it in process.
The types it parses and answers with are ``ps/protocol.py``'s and
``ps/rows_protocol.py``'s, which import nothing of this side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from clusterflow.ps.api import MalformedRequest
from clusterflow.ps.loans import Loan
from clusterflow.ps.membership import LeaveRequest, MembersRequest
from clusterflow.ps.protocol import (
    CONTROL,
    GRAD_PREFIX,
    ApplyRequest,
    ControlRequest,
    CreateReply,
    CreateRequest,
    OptimizerRequest,
    PSState,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
    QuiesceRequest,
    VersionReply,
    WaitVersionRequest,
)
from clusterflow.ps.rows_protocol import (
    ROWS_METHODS,
    RowsCreateRequest,
    RowsOptimizerRequest,
    RowsPullReply,
    RowsPullRequest,
    RowsPushReply,
    RowsPushRequest,
    RowsReadReply,
    RowsReadRequest,
)
from clusterflow.ps.store import VariableStore
from clusterflow.ps.tables import RowStore
from clusterflow.ps.wire import Tensors, Wire
from clusterflow.rpc.message import ReplyStream


def wire_cast(tensors: Tensors, dtype: str | None) -> Tensors:
    """Casts floating tensors to the wire dtype (bf16 halves the bytes of a pull)."""
    if dtype in (None, "float32"):
        return tensors
    target = getattr(torch, str(dtype))
    return {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}


# The handler ------------------------------------------------------------------------

FanOut = Callable[[ApplyRequest], None]
"""ps 0's way to tell every other shard which replicas form a sync step."""


class PSHandler:
    """Serves every ``ps.*`` method on one ``VariableStore``: the one place requests meet it.

    Args:
        store: the variables of this ps task.
        fan_out: called when a push (or a leave) on ps 0 completes a sync step that other
            shards must apply too; None where this is the only shard.
    """

    def __init__(self, store: VariableStore, fan_out: FanOut | None = None) -> None:
        self.store = store
        self._fan_out = fan_out
        self.tables = RowStore(store.ps_index)
        """This task's rows of the embedding tables (``ps.rows_*``, ``ps/tables.py``)."""

    def create(self, request: CreateRequest) -> list[str]:
        return self.store.create(request.config, request.variables, request.values)

    def optimizer(self, request: OptimizerRequest) -> None:
        self.store.set_optimizer(request.spec, request.group_of)

    def pull(self, request: PullRequest, lend: Loan | None = None) -> PullReply:
        version, values = self.store.pull(request.names, request.min_version, request.timeout, lend)
        return PullReply(version=version, values=wire_cast(values, request.dtype))

    def push(
        self,
        request: PushRequest,
        lend: Loan | None = None,
        checked: frozenset[str] = frozenset(),
        stream: ReplyStream | None = None,
    ) -> PushReply:
        """``checked``: wire names of the gradients whose frames passed the finite check as
        they arrived (a push sent in parts, ``PSService``); the store skips theirs.
        ``stream``: where the values may leave as they are stepped (float32 replies)."""
        if request.values_dtype not in (None, "float32"):
            stream = None  # cast whole in wire_cast below
        result = self.store.push(
            stream=stream,
            finite={n[len(GRAD_PREFIX) :] for n in checked if n.startswith(GRAD_PREFIX)},
            worker=request.worker,
            version=request.version,
            grads=request.grads,
            buffers=request.buffers,
            keys=request.keys,
            hyper=request.hyper,
            commit=request.commit,
            want_values=request.want_values,
            timeout=request.timeout,
            lend=lend,
        )
        if result.commit is not None:
            self._commit(result.commit)
        return PushReply(
            applied=result.applied,
            version=result.version,
            reason=result.reason,
            staleness=result.staleness,
            values=wire_cast(result.values, request.values_dtype),
            duplicates=tuple(result.duplicates),
        )

    def apply(self, request: ApplyRequest) -> int:
        return self.store.apply_sync(request.version, request.workers)

    def wait_version(self, request: WaitVersionRequest) -> int:
        return self.store.wait_version(request.version, request.timeout)

    def quiesce(self, request: QuiesceRequest) -> int:
        # The cut's step: the dense version, or the tables' where only tables train.
        return max(self.store.quiesce(request.timeout), self.tables.quiesce(request.timeout))

    def resume(self) -> None:
        self.store.resume()
        self.tables.resume()

    def state(self) -> PSState:
        meta, tensors = self.store.state()
        self.tables.add_state(meta, tensors)
        return PSState(meta=meta, tensors=tensors)

    def load_state(self, request: PSState) -> None:
        self.store.load_state(request.meta, request.tensors)
        self.tables.load_state(request.meta, request.tensors)

    def leave(self, request: LeaveRequest) -> None:
        self.tables.leave(request.worker)
        commit = self.store.leave(request.worker)
        if commit is not None:
            self._commit(commit)

    def members(self, request: MembersRequest) -> None:
        """The manager names the replicas of the steps to come (an elastic cluster): the
        dense variables and the tables take them, each at its own next step unless the
        request names one. Completes no step (``leave`` does that)."""
        self.store.members(request.workers, request.version, request.previous)
        self.tables.members(request.workers, request.version, request.previous)

    def stats(self) -> dict[str, Any]:
        stats = self.store.snapshot_stats()
        if self.tables.tables:
            stats["rows"] = self.tables.snapshot_stats()
            stats["version"] = max(int(stats["version"]), self.tables.version)
        return stats

    def _commit(self, commit: Mapping[str, Any]) -> None:
        if self._fan_out is None:
            return
        request = ApplyRequest(version=int(commit["version"]), workers=list(commit["workers"]))
        self.store.begin_fanout()  # quiesce waits for the fan-out, as for a push
        try:
            self._fan_out(request)
        finally:
            self.store.end_fanout()

    def dispatch(
        self,
        method: str,
        body: Any,
        tensors: Tensors,
        lend: Loan | None = None,
        *,
        checked: frozenset[str] = frozenset(),
        stream: ReplyStream | None = None,
    ) -> Wire:
        """Serves one request as it travels (``method`` without the ``ps.`` prefix).

        ``lend``: a pull's or a push's reply may carry the live variables under this
        loan, whose ``sent`` the caller must hand the reply's tracker (``ps/loans.py``);
        without it, they are snapshots. ``checked``: tensors a push's frames passed the
        finite check of as they arrived (``Request.checked``); ``stream``: where a push's
        reply may send values as they are stepped (``Request.stream``).

        Raises:
            MalformedRequest: an unknown method, or a body the contract does not allow.
            PSError: the store refused the request (its message says why).
        """
        if method == "create":
            return CreateReply(
                created=self.create(CreateRequest.from_wire(body, tensors))
            ).to_wire()
        if method == "optimizer":
            self.optimizer(OptimizerRequest.from_wire(body, tensors))
            return None, {}
        if method == "pull":
            return self.pull(PullRequest.from_wire(body, tensors), lend).to_wire()
        if method == "push":
            push = PushRequest.from_wire(body, tensors)
            return self.push(push, lend, checked, stream).to_wire()
        if method == "apply":
            version = self.apply(ApplyRequest.from_wire(body, tensors))
            return VersionReply(version=version).to_wire()
        if method == "wait_version":
            version = self.wait_version(WaitVersionRequest.from_wire(body, tensors))
            return VersionReply(version=version).to_wire()
        if method == "quiesce":
            version = self.quiesce(QuiesceRequest.from_wire(body, tensors))
            return VersionReply(version=version).to_wire()
        if method in CONTROL:
            ControlRequest.from_wire(method, body, tensors)
            if method == "resume":
                self.resume()
                return None, {}
            if method == "state":
                return self.state().to_wire()
            return self.stats(), {}
        if method == "load_state":
            self.load_state(PSState.from_wire(body, tensors))
            return None, {}
        if method == "leave":
            self.leave(LeaveRequest.from_wire(body, tensors))
            return None, {}
        if method == "members":
            self.members(MembersRequest.from_wire(body, tensors))
            return None, {}
        if method in ROWS_METHODS:
            return rows_dispatch(self.tables, method, body, tensors)
        raise MalformedRequest(f"unknown ps method {method!r}")


def rows_dispatch(store: RowStore, method: str, body: Any, tensors: Tensors) -> Wire:
    """Serves one ``ps.rows_*`` request on ``store`` (``PSHandler.dispatch`` routes here).

    Raises:
        MalformedRequest: a body or tensors the contract does not allow.
        PSError: the store refused (an id out of range: ``TableIndexError``).
    """
    if method == "rows_create":
        request = RowsCreateRequest.from_wire(body, tensors)
        return {"created": store.create(request.config, request.tables, request.shard)}, {}
    if method == "rows_optimizer":
        store.set_optimizer(RowsOptimizerRequest.from_wire(body, tensors).optimizers)
        return None, {}
    if method == "rows_pull":
        pull = RowsPullRequest.from_wire(body, tensors)
        version, rows = store.pull(pull.ids, pull.min_version, pull.timeout)
        return RowsPullReply(version=version, rows=rows).to_wire()
    if method == "rows_push":
        push = RowsPushRequest.from_wire(body, tensors)
        result = store.push(
            worker=push.worker,
            version=push.version,
            grads={k: (push.ids[k], push.grads[k]) for k in push.ids},
            keys=push.keys,
            hyper=push.hyper,
            timeout=push.timeout,
        )
        reply = RowsPushReply(
            applied=result.applied,
            version=result.version,
            reason=result.reason,
            staleness=result.staleness,
            duplicates=tuple(result.duplicates),
        )
        return reply.to_wire()
    if method == "rows_read":
        read = RowsReadRequest.from_wire(body, tensors)
        ids, values = store.read_rows(read.table)
        return RowsReadReply(version=store.version, ids=ids, rows=values).to_wire()
    raise MalformedRequest(f"unknown ps method {method!r}")
