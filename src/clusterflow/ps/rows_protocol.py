"""The ``ps.rows_*`` wire contract: embedding-table requests, their replies, their handler.

The sparse half of the ps protocol (``protocol.py`` holds the dense half and routes
these names here). On the wire a table's ids travel as tensor ``i/<table>`` (1-d int64,
global row ids) and its rows as ``r/<table>`` (``len(ids) x dim``): a pull names ids and
gets rows back, a push sends ids with their gradient rows, de-duplicated and coalesced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from clusterflow.ps.api import MalformedRequest, PSConfig
from clusterflow.ps.applied import Key
from clusterflow.ps.rows import RowOptimizerSpec, TableSpec
from clusterflow.ps.wire import DEFAULT_TIMEOUT_S, Tensors, Wire, in_bounds, split_keys
from clusterflow.ps.wire import request_body as _body

IDS = "i/"
ROWS = "r/"


def _number(method: str, body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedRequest(f"ps.{method}: {key!r} must be a number, got {value!r:.40}")
    in_bounds(method, key, float(value))
    return float(value)


def _split(method: str, tensors: Tensors, *prefixes: str) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in prefixes]
    for name, tensor in tensors.items():
        for i, prefix in enumerate(prefixes):
            if name.startswith(prefix):
                out[i][name[len(prefix) :]] = tensor
                break
        else:
            raise MalformedRequest(f"ps.{method}: tensor {name!r} is neither ids nor rows")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RowsCreateRequest:
    """Declares tables; each ps draws its own rows (the first creator wins)."""

    METHOD: ClassVar[str] = "rows_create"
    config: PSConfig
    tables: list[TableSpec]
    shard: int | None = None
    """The ps task's index in the worker's cluster spec (its shard of every table)."""

    def to_wire(self) -> Wire:
        body = {"config": self.config.to_dict(), "tables": [t.to_dict() for t in self.tables]}
        return body | {"shard": self.shard}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> RowsCreateRequest:
        b = _body(cls.METHOD, body)
        if not isinstance(b.get("config"), dict) or not isinstance(b.get("tables"), list):
            raise MalformedRequest("ps.rows_create needs 'config' and 'tables'")
        shard = b.get("shard")
        if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int)):
            raise MalformedRequest(f"ps.rows_create: 'shard' must be an int, got {shard!r:.40}")
        return cls(
            config=PSConfig.from_dict(b["config"]),
            tables=[TableSpec.from_dict(dict(t)) for t in b["tables"]],
            shard=shard,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RowsOptimizerRequest:
    """The row optimizer of each table (once; the same request again is a no-op)."""

    METHOD: ClassVar[str] = "rows_optimizer"
    optimizers: dict[str, RowOptimizerSpec]

    def to_wire(self) -> Wire:
        return {"optimizers": {k: v.to_dict() for k, v in self.optimizers.items()}}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> RowsOptimizerRequest:
        specs = _body(cls.METHOD, body).get("optimizers")
        if not isinstance(specs, dict):
            raise MalformedRequest("ps.rows_optimizer needs 'optimizers'")
        return cls(
            optimizers={str(k): RowOptimizerSpec.from_dict(dict(v)) for k, v in specs.items()}
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RowsPullRequest:
    """The rows at ``ids[table]`` of each table, once the ps's tables reached ``min_version``."""

    METHOD: ClassVar[str] = "rows_pull"
    ids: Tensors
    min_version: int = 0
    timeout: float = DEFAULT_TIMEOUT_S

    def to_wire(self) -> Wire:
        body = {"min_version": self.min_version, "timeout": self.timeout}
        return body, {IDS + k: v for k, v in self.ids.items()}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> RowsPullRequest:
        b = _body(cls.METHOD, body)
        (ids,) = _split(cls.METHOD, tensors, IDS)
        return cls(
            ids=ids,
            min_version=int(_number(cls.METHOD, b, "min_version", 0)),
            timeout=_number(cls.METHOD, b, "timeout", DEFAULT_TIMEOUT_S),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RowsPullReply:
    version: int
    rows: Tensors

    def to_wire(self) -> Wire:
        return {"version": self.version}, {ROWS + k: v for k, v in self.rows.items()}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> RowsPullReply:
        (rows,) = _split("rows_pull reply", tensors, ROWS)
        return cls(version=int(body["version"]), rows=rows)


@dataclass(frozen=True, slots=True, kw_only=True)
class RowsPushRequest:
    """One replica's row gradients for this ps's shards of every table, with its step's
    split keys (applied at most once) and each table's current hyper-parameters."""

    METHOD: ClassVar[str] = "rows_push"
    worker: str
    version: int
    """The tables' version on this ps when the rows were pulled."""
    ids: Tensors = field(default_factory=dict)
    grads: Tensors = field(default_factory=dict)
    keys: tuple[Key, ...] = ()
    hyper: dict[str, Any] = field(default_factory=dict)
    timeout: float = DEFAULT_TIMEOUT_S

    def to_wire(self) -> Wire:
        body = {
            "worker": self.worker,
            "version": self.version,
            "keys": [list(k) for k in self.keys],
            "hyper": self.hyper,
            "timeout": self.timeout,
        }
        tensors = {IDS + k: v for k, v in self.ids.items()}
        tensors.update({ROWS + k: v for k, v in self.grads.items()})
        return body, tensors

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> RowsPushRequest:
        b = _body(cls.METHOD, body)
        ids, grads = _split(cls.METHOD, tensors, IDS, ROWS)
        if set(ids) != set(grads):
            raise MalformedRequest("ps.rows_push: every table needs both ids and rows")
        worker, hyper = b.get("worker"), b.get("hyper") or {}
        if not isinstance(worker, str) or not isinstance(hyper, dict):
            raise MalformedRequest("ps.rows_push needs a 'worker' name and a 'hyper' map")
        return cls(
            worker=worker,
            version=int(_number(cls.METHOD, b, "version", 0)),
            ids=ids,
            grads=grads,
            keys=split_keys(cls.METHOD, "keys", b.get("keys")),
            hyper=dict(hyper),
            timeout=_number(cls.METHOD, b, "timeout", DEFAULT_TIMEOUT_S),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RowsPushReply:
    applied: bool
    version: int
    reason: str = ""
    staleness: int = 0
    duplicates: tuple[Key, ...] = ()

    def to_wire(self) -> Wire:
        body = {
            "applied": self.applied,
            "version": self.version,
            "reason": self.reason,
            "staleness": self.staleness,
            "duplicates": [list(k) for k in self.duplicates],
        }
        return body, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> RowsPushReply:
        return cls(
            applied=bool(body["applied"]),
            version=int(body["version"]),
            reason=str(body.get("reason") or ""),
            staleness=int(body.get("staleness") or 0),
            duplicates=split_keys("rows_push reply", "duplicates", body.get("duplicates")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RowsReadRequest:
    """This ps's shard of one table, whole (export, tests)."""

    METHOD: ClassVar[str] = "rows_read"
    table: str

    def to_wire(self) -> Wire:
        return {"table": self.table}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> RowsReadRequest:
        name = _body(cls.METHOD, body).get("table")
        if not isinstance(name, str):
            raise MalformedRequest("ps.rows_read needs a 'table' name")
        return cls(table=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class RowsReadReply:
    version: int
    ids: torch.Tensor
    """The global ids of the shard's rows, in the order of ``rows``."""
    rows: torch.Tensor

    def to_wire(self) -> Wire:
        return {"version": self.version}, {"ids": self.ids, "rows": self.rows}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> RowsReadReply:
        return cls(version=int(body["version"]), ids=tensors["ids"], rows=tensors["rows"])


ROWS_METHODS: tuple[str, ...] = (
    "rows_create",
    "rows_optimizer",
    "rows_pull",
    "rows_push",
    "rows_read",
)
