"""The ``ps.*`` wire contract: its request and reply types, built by the worker and
parsed by the ps from the same definition.

Nothing here imports the server side (the store, the tables, ``ps/handler.py``), so a
worker that needs the types does not load the ps. A worker reaches its ps tasks two
ways: over RPC (``RemotePS`` to ``PSService``) or in process (``LocalPS``, under
``CentralStorageStrategy``). Both ends go through the types here and through one
``PSHandler``, so the two paths cannot drift apart (they once did: the in-process path
dropped a pull's and a push's timeout). docs/architecture.md section 4 describes the
contract.

The two requests that change who a sync step waits for (``LeaveRequest``,
``MembersRequest``) live in ``membership.py``, which the manager imports without torch;
``METHODS`` lists them with the others.

Tensor names on the wire carry a role prefix: ``g/`` gradients and ``b/`` buffer values
in a push; plain variable names in a pull's and a push's reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from clusterflow.ps.api import MalformedRequest, PSConfig
from clusterflow.ps.applied import Key
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.rows_protocol import ROWS_METHODS
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


@dataclass(frozen=True, slots=True)
class ControlRequest:
    """A request with no fields: ``resume`` (let held pushes through), ``state`` (the
    ``PSState`` to checkpoint), ``stats`` (counters, for tests and the dashboard)."""

    METHOD: str

    def to_wire(self) -> Wire:
        return None, {}

    @classmethod
    def from_wire(cls, method: str, body: Any, tensors: Tensors) -> ControlRequest:
        if method not in CONTROL:
            raise MalformedRequest(f"ps.{method} is no request without fields")
        _body(method, body)  # absent, or a map: its fields are ignored
        return cls(method)


CONTROL = ("resume", "state", "stats")
"""The methods ``ControlRequest`` carries."""
RESUME, STATE, STATS = (ControlRequest(m) for m in CONTROL)


# Replies ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PullReply:
    version: int
    values: Tensors
    """From ``RemotePS``, a value over ``codec.WHOLE_BYTES`` is a ``codec.Framed``, the
    frames it arrived in, which ``shards.load_into`` writes into the parameter."""

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
    """The values after the push, when the request wanted them (``codec.Framed`` as in a
    ``PullReply``)."""
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


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionReply:
    """The version a ps reached or holds at: ``wait_version``'s, ``quiesce``'s and
    ``apply``'s reply."""

    version: int

    def to_wire(self) -> Wire:
        return {"version": self.version}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> VersionReply:
        b = _body("version reply", body)
        return cls(version=_field("version reply", b, "version", int, _REQUIRED))


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateReply:
    """The variables this ``create`` made (those that existed are kept, not listed)."""

    created: list[str]

    def to_wire(self) -> Wire:
        return {"created": self.created}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> CreateReply:
        b = _body("create reply", body)
        created = _field("create reply", b, "created", list, _REQUIRED)
        return cls(created=_all_of("create reply", "created", created, str))


# The methods ------------------------------------------------------------------------

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
    "members",
    "stats",
    *ROWS_METHODS,
)
"""Every method of the contract, registered as ``ps.<name>`` (``ps/handler.py`` serves them)."""
