"""The ``ps.*`` wire contract: its request and reply types, and the one handler serving them.

A worker reaches its ps tasks two ways: over RPC (``RemotePS`` to ``PSService``) or in
process (``LocalPS``, under ``CentralStorageStrategy``). Both ends go through the types
here and through ``PSHandler``, so the two paths cannot drift apart (they once did: the
in-process path dropped a pull's and a push's timeout). docs/architecture.md section 4
describes the contract.

Tensor names on the wire carry a role prefix: ``g/`` gradients and ``b/`` buffer values
in a push; plain variable names in a pull's and a push's reply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from clusterflow.ps.api import MalformedRequest, PSConfig
from clusterflow.ps.applied import Key
from clusterflow.ps.loans import Loan
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.rows_protocol import ROWS_METHODS, rows_dispatch
from clusterflow.ps.store import VariableStore
from clusterflow.ps.tables import RowStore
from clusterflow.ps.wire import DEFAULT_TIMEOUT_S, Tensors, Wire, in_bounds, split_keys
from clusterflow.ps.wire import request_body as _body
from clusterflow.rpc.codec import DTYPES

Body = dict[str, Any]

GRAD_PREFIX = "g/"
BUFFER_PREFIX = "b/"

_T = TypeVar("_T")
_REQUIRED: Any = object()


def _field(method: str, body: Mapping[str, Any], key: str, kind: type[_T], default: Any) -> _T:
    """One field of a request body, of the type the contract says, or ``MalformedRequest``."""
    value = body.get(key)
    if value is None:
        if default is _REQUIRED:
            raise MalformedRequest(f"ps.{method} request lacks {key!r}")
        return default  # type: ignore[no-any-return]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedRequest(
            f"ps.{method} request: {key!r} must be {kind.__name__}, got {value!r:.80}"
        )
    if isinstance(value, int | float):
        in_bounds(method, key, value)
    return value


def _all_of(method: str, key: str, items: Any, kind: type) -> Any:
    """``items`` (a list or None) if every element is a ``kind``, or ``MalformedRequest``."""
    if items is not None and not all(isinstance(item, kind) for item in items):
        raise MalformedRequest(f"ps.{method} request: {key!r} must list {kind.__name__}s")
    return items


def _wire_dtype(method: str, value: Any) -> str | None:
    if value is not None and (
        not isinstance(value, str)
        or value not in DTYPES
        or not getattr(torch, value).is_floating_point
    ):
        raise MalformedRequest(f"ps.{method} request: no floating wire dtype {value!r:.40}")
    return None if value is None else str(value)


def wire_cast(tensors: Tensors, dtype: str | None) -> Tensors:
    """Casts floating tensors to the wire dtype (bf16 halves the bytes of a pull)."""
    if dtype in (None, "float32"):
        return tensors
    target = getattr(torch, str(dtype))
    return {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}


# Requests ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateRequest:
    """Declares variables with their initial values; the first creator wins."""

    METHOD: ClassVar[str] = "create"
    config: PSConfig
    """Every worker must send the same one; another is refused."""
    variables: list[Mapping[str, Any]]
    """``{"name", "shape", "dtype", "trainable"}`` of each variable on this ps."""
    values: Tensors = field(default_factory=dict)
    """The initial value of each variable, by name."""

    def to_wire(self) -> Wire:
        return {"config": self.config.to_dict(), "vars": self.variables}, self.values

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> CreateRequest:
        b = _body(cls.METHOD, body)
        return cls(
            config=PSConfig.from_dict(_field(cls.METHOD, b, "config", dict, _REQUIRED)),
            variables=_all_of(
                cls.METHOD, "vars", _field(cls.METHOD, b, "vars", list, _REQUIRED), dict
            ),
            values=tensors,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerRequest:
    """Builds the optimizer once; the same request from another worker is a no-op."""

    METHOD: ClassVar[str] = "optimizer"
    spec: OptimizerSpec
    group_of: dict[str, int]
    """The optimizer's param group of each variable (shard) name."""

    def to_wire(self) -> Wire:
        return {"spec": self.spec.to_dict(), "group_of": self.group_of}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> OptimizerRequest:
        b = _body(cls.METHOD, body)
        return cls(
            spec=OptimizerSpec.from_dict(_field(cls.METHOD, b, "spec", dict, _REQUIRED)),
            group_of=_field(cls.METHOD, b, "group_of", dict, _REQUIRED),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PullRequest:
    """A consistent copy of variables once the ps reached ``min_version``."""

    METHOD: ClassVar[str] = "pull"
    names: list[str] | None = None
    """The variables to send; None for all."""
    min_version: int = 0
    timeout: float = DEFAULT_TIMEOUT_S
    """How long the ps waits for ``min_version`` before it refuses (``PSError``)."""
    dtype: str | None = None
    """The wire dtype of floating values (``float32`` or ``bfloat16``); None keeps theirs."""

    def to_wire(self) -> Wire:
        body = {
            "names": self.names,
            "min_version": self.min_version,
            "timeout": self.timeout,
            "dtype": self.dtype,
        }
        return body, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> PullRequest:
        b = _body(cls.METHOD, body)
        return cls(
            names=_all_of(cls.METHOD, "names", _field(cls.METHOD, b, "names", list, None), str),
            min_version=_field(cls.METHOD, b, "min_version", int, 0),
            timeout=_field(cls.METHOD, b, "timeout", float, DEFAULT_TIMEOUT_S),
            dtype=_wire_dtype(cls.METHOD, b.get("dtype")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PushRequest:
    """One replica's gradients (and the chief's buffer values) for the shards of one ps."""

    METHOD: ClassVar[str] = "push"
    worker: str
    """The pushing replica's task name: the unit of staleness, sync steps and leaving."""
    version: int
    """The version the gradients were computed from."""
    grads: Tensors = field(default_factory=dict)
    buffers: Tensors = field(default_factory=dict)
    """Values of non-trainable variables (the chief's batch-norm statistics)."""
    keys: tuple[Key, ...] = ()
    """The ``(dataset, epoch, split)`` keys of the data splits this update completes:
    a ps applies an update at most once per key."""
    hyper: list[dict[str, Any]] | None = None
    """The optimizer's param-group hyperparameters at this step (lr schedules)."""
    commit: bool = False
    """sync, ps 0 only: this replica's push to every other shard is done; count it."""
    want_values: bool = False
    """Send the values after this push back in the reply (async: saves a pull)."""
    values_dtype: str | None = None
    """The wire dtype of the values sent back."""
    timeout: float = DEFAULT_TIMEOUT_S
    """How long the push may wait for a quiesced ps to resume."""

    def to_wire(self) -> Wire:
        body = {
            "worker": self.worker,
            "version": self.version,
            "keys": [list(k) for k in self.keys],
            "hyper": self.hyper,
            "commit": self.commit,
            "want_values": self.want_values,
            "values_dtype": self.values_dtype,
            "timeout": self.timeout,
        }
        tensors = {GRAD_PREFIX + k: v for k, v in self.grads.items()}
        tensors.update({BUFFER_PREFIX + k: v for k, v in self.buffers.items()})
        return body, tensors

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> PushRequest:
        b = _body(cls.METHOD, body)
        grads, buffers = {}, {}
        for name, tensor in tensors.items():
            if name.startswith(GRAD_PREFIX):
                grads[name[len(GRAD_PREFIX) :]] = tensor
            elif name.startswith(BUFFER_PREFIX):
                buffers[name[len(BUFFER_PREFIX) :]] = tensor
            else:
                raise MalformedRequest(
                    f"ps.push tensor {name!r} is neither a gradient (g/) nor a buffer (b/)"
                )
        return cls(
            worker=_field(cls.METHOD, b, "worker", str, _REQUIRED),
            version=_field(cls.METHOD, b, "version", int, _REQUIRED),
            grads=grads,
            buffers=buffers,
            keys=split_keys(cls.METHOD, "keys", b.get("keys")),
            hyper=_field(cls.METHOD, b, "hyper", list, None),
            commit=_field(cls.METHOD, b, "commit", bool, False),
            want_values=_field(cls.METHOD, b, "want_values", bool, False),
            values_dtype=_wire_dtype(cls.METHOD, b.get("values_dtype")),
            timeout=_field(cls.METHOD, b, "timeout", float, DEFAULT_TIMEOUT_S),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyRequest:
    """ps 0 decided sync step ``version``: apply the average of these workers' gradients."""

    METHOD: ClassVar[str] = "apply"
    version: int
    workers: list[str]

    def to_wire(self) -> Wire:
        return {"version": self.version, "workers": self.workers}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> ApplyRequest:
        b = _body(cls.METHOD, body)
        workers = _field(cls.METHOD, b, "workers", list, _REQUIRED)
        return cls(
            version=_field(cls.METHOD, b, "version", int, _REQUIRED),
            workers=[str(w) for w in workers],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitVersionRequest:
    """Blocks until the ps reached ``version``, at most ``timeout`` (then ``PSError``)."""

    METHOD: ClassVar[str] = "wait_version"
    version: int
    timeout: float = DEFAULT_TIMEOUT_S

    def to_wire(self) -> Wire:
        return {"version": self.version, "timeout": self.timeout}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> WaitVersionRequest:
        b = _body(cls.METHOD, body)
        return cls(
            version=_field(cls.METHOD, b, "version", int, _REQUIRED),
            timeout=_field(cls.METHOD, b, "timeout", float, DEFAULT_TIMEOUT_S),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class QuiesceRequest:
    """Holds new pushes and waits, at most ``timeout``, for those in flight."""

    METHOD: ClassVar[str] = "quiesce"
    timeout: float = DEFAULT_TIMEOUT_S

    def to_wire(self) -> Wire:
        return {"timeout": self.timeout}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> QuiesceRequest:
        b = _body(cls.METHOD, body)
        return cls(timeout=_field(cls.METHOD, b, "timeout", float, DEFAULT_TIMEOUT_S))


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaveRequest:
    """A replica will push no more: sync steps stop waiting for it."""

    METHOD: ClassVar[str] = "leave"
    worker: str

    def to_wire(self) -> Wire:
        return {"worker": self.worker}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> LeaveRequest:
        return cls(worker=_field(cls.METHOD, _body(cls.METHOD, body), "worker", str, _REQUIRED))


@dataclass(frozen=True, slots=True, kw_only=True)
class PSState:
    """Everything a ps needs to resume (``state``'s reply, ``load_state``'s request)."""

    METHOD: ClassVar[str] = "load_state"
    meta: dict[str, Any]
    """Version, applied keys, config, optimizer and its scalar slots (``VariableStore.state``)."""
    tensors: Tensors
    """``var/<name>`` values and ``slot/<name>/<key>`` optimizer slots."""

    def to_wire(self) -> Wire:
        return self.meta, self.tensors

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> PSState:
        meta = _body(cls.METHOD, body)
        _field(cls.METHOD, meta, "version", int, _REQUIRED)  # checked before the store is
        _field(cls.METHOD, meta, "trainable", dict, _REQUIRED)  # touched: never half loaded
        return cls(meta=dict(meta), tensors=tensors)


# Replies ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PullReply:
    version: int
    values: Tensors

    def to_wire(self) -> Wire:
        return {"version": self.version}, self.values

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> PullReply:
        return cls(version=int(body["version"]), values=tensors)


@dataclass(frozen=True, slots=True, kw_only=True)
class PushReply:
    applied: bool
    """False: the push was dropped (stale, late for its sync step, or a duplicate key)."""
    version: int
    """The ps's version after the push."""
    reason: str = ""
    """Why a push was not applied."""
    staleness: int = 0
    values: Tensors = field(default_factory=dict)
    """The values after the push, when the request wanted them."""
    duplicates: tuple[Key, ...] = ()
    """Keys of the push this ps applied before: its gradients were not applied again."""

    def to_wire(self) -> Wire:
        body = {
            "applied": self.applied,
            "version": self.version,
            "reason": self.reason,
            "staleness": self.staleness,
            "duplicates": [list(k) for k in self.duplicates],
        }
        return body, self.values

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> PushReply:
        return cls(
            applied=bool(body["applied"]),
            version=int(body["version"]),
            reason=str(body.get("reason") or ""),
            staleness=int(body.get("staleness") or 0),
            values=tensors,
            duplicates=split_keys("push reply", "duplicates", body.get("duplicates")),
        )


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

    def push(self, request: PushRequest, lend: Loan | None = None) -> PushReply:
        result = self.store.push(
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

    def dispatch(self, method: str, body: Any, tensors: Tensors, lend: Loan | None = None) -> Wire:
        """Serves one request as it travels (``method`` without the ``ps.`` prefix).

        ``lend``: a pull's or a push's reply may carry the live variables under this
        loan, whose ``sent`` the caller must hand the reply's tracker (``ps/loans.py``);
        without it, they are snapshots.

        Raises:
            MalformedRequest: an unknown method, or a body the contract does not allow.
            PSError: the store refused the request (its message says why).
        """
        if method == "create":
            return {"created": self.create(CreateRequest.from_wire(body, tensors))}, {}
        if method == "optimizer":
            self.optimizer(OptimizerRequest.from_wire(body, tensors))
            return None, {}
        if method == "pull":
            return self.pull(PullRequest.from_wire(body, tensors), lend).to_wire()
        if method == "push":
            return self.push(PushRequest.from_wire(body, tensors), lend).to_wire()
        if method == "apply":
            return {"version": self.apply(ApplyRequest.from_wire(body, tensors))}, {}
        if method == "wait_version":
            return {"version": self.wait_version(WaitVersionRequest.from_wire(body, tensors))}, {}
        if method == "quiesce":
            return {"version": self.quiesce(QuiesceRequest.from_wire(body, tensors))}, {}
        if method == "resume":
            self.resume()
            return None, {}
        if method == "state":
            return self.state().to_wire()
        if method == "load_state":
            self.load_state(PSState.from_wire(body, tensors))
            return None, {}
        if method == "leave":
            self.leave(LeaveRequest.from_wire(body, tensors))
            return None, {}
        if method == "stats":
            return self.stats(), {}
        if method in ROWS_METHODS:
            return rows_dispatch(self.tables, method, body, tensors)
        raise MalformedRequest(f"unknown ps method {method!r}")


METHODS: tuple[str, ...] = (
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
    "leave",
    "stats",
    *ROWS_METHODS,
)
"""Every method ``PSHandler.dispatch`` serves, registered as ``ps.<name>``."""
