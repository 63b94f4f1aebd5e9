"""Values, settings and errors of the parameter server (docs/architecture.md section 5)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from clusterflow._checks import whole
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.rpc.codec import DTYPES
from clusterflow.rpc.errors import CodedError, MalformedBody

Mode = Literal["async", "sync"]
StalePolicy = Literal["drop", "scale"]
WireDtype = Literal["float32", "bfloat16"]


class PSError(ClusterflowError):
    """A parameter-server request was refused; the message names the variable or value."""


class MalformedRequest(PSError, MalformedBody):
    """A ``ps.*`` request that breaks the wire contract: an unknown method, a missing or
    mistyped field (``ps/protocol.py`` defines them). The rpc layer's ``MalformedBody``,
    of the ps's kind."""


class PushRejected(PSError):
    """A push carried a wrong shape, dtype, unknown variable or a non-finite value."""


class VersionTimeout(PSError, CodedError):
    """A wait for a version (a pull's ``min_version``, warm-up) ran out of time.

    Typed so a caller that waits in bounded rounds tells a round that ran out from a
    real failure without reading the message; its wire code makes a remote ps's answer
    a ``VersionTimeout`` on the client too (rpc/errors.py).
    """

    wire_code = "version_timeout"


@dataclass(frozen=True, slots=True, kw_only=True)
class PSConfig:
    """How a parameter server applies pushes. Every worker must send the same one."""

    mode: Mode = "async"
    """async: apply each push on arrival. sync: aggregate one step of N replicas."""
    num_replicas: int = 1
    """Replicas that train (the chief and the workers)."""
    backup_workers: int = 0
    """sync only: a step takes the first num_replicas - backup_workers pushes."""
    max_staleness: int | None = None
    """async only: a push computed from values more than this many versions old is stale;
    exactly this many old is still applied as is (``too_stale``: ``staleness >``)."""
    stale_policy: StalePolicy = "drop"
    """What happens to a stale push: dropped, or scaled by 1/staleness."""
    staleness_aware_lr: bool = False
    """async only: scale every push by 1/max(1, staleness) (Zhang et al., 2016)."""
    warmup_steps: int = 0
    """async only: the first W global steps are taken by the chief alone."""
    reject_nonfinite: bool = True
    """Refuse gradients holding NaN or Inf instead of poisoning the variables."""

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ConfigError(f"unknown ps mode {self.mode!r}; expected 'async' or 'sync'")
        whole("num_replicas", self.num_replicas, least=1)
        whole("backup_workers", self.backup_workers)
        if self.max_staleness is not None:
            whole("max_staleness", self.max_staleness)
        whole("warmup_steps", self.warmup_steps)
        if not 0 <= self.backup_workers < self.num_replicas:
            raise ConfigError(
                f"backup_workers={self.backup_workers} must be in [0, {self.num_replicas}) "
                f"for {self.num_replicas} replicas"
            )
        if self.backup_workers and self.mode != "sync":
            raise ConfigError("backup_workers needs mode='sync'")
        if self.stale_policy not in ("drop", "scale"):
            raise ConfigError(f"unknown stale_policy {self.stale_policy!r}; expected drop or scale")

    def agrees_with(self, other: PSConfig, *, resizable: bool = False) -> bool:
        """Whether ``other`` (a worker's) is the config this ps runs by.

        The workers of an elastic cluster count the replicas differently as it grows
        (issue 32): each counts the spec it started with. An async ps applies each push
        on its own, so the count is no part of its rules. A sync step counts its
        replicas, so the count must agree, unless the ps was told who the replicas are
        (``resizable``: ``ps.members``), whose membership then decides each step."""
        if (self.mode == "async" and other.mode == "async") or (
            resizable and self.mode == other.mode == "sync"
        ):
            return replace(self, num_replicas=other.num_replicas) == other
        return self == other

    @property
    def replicas_per_step(self) -> int:
        """N: the pushes one sync step averages."""
        return self.num_replicas - self.backup_workers

    def too_stale(self, staleness: int) -> bool:
        """Whether an async push ``staleness`` versions old is past ``max_staleness``
        (then ``stale_policy`` drops it or scales it)."""
        return self.max_staleness is not None and staleness > self.max_staleness

    def async_lr_scale(self, staleness: int) -> float:
        """The learning-rate scale of an async push that is applied: 1/staleness past
        ``max_staleness``, at most 1/max(1, staleness) with ``staleness_aware_lr``.
        One rule for dense variables (``store.py``) and embedding rows (``tables.py``)."""
        scale = 1.0 / staleness if self.too_stale(staleness) else 1.0
        if self.staleness_aware_lr:
            scale = min(scale, 1.0 / max(1, staleness))
        return scale

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PSConfig:
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"invalid ps config {data!r}: {exc}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class VariableSpec:
    """A variable as the worker declares it, before placement."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool = True
    device: int | None = None
    """An explicit ps task index (from ``clusterflow.device``), or None to place greedily."""

    @property
    def nbytes(self) -> int:
        from math import prod

        return prod(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """One piece of a variable on one ps task: rows [start, stop) of dimension 0."""

    variable: str
    name: str
    """The name the ps stores it under (the variable's, or ``name/part_i``)."""
    ps: int
    start: int
    stop: int
    shape: tuple[int, ...]

    @property
    def whole(self) -> bool:
        return self.name == self.variable


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every variable lives: its shards in order of dimension 0."""

    shards: dict[str, tuple[Shard, ...]] = field(default_factory=dict)

    def on_ps(self, ps: int) -> list[Shard]:
        return [s for shards in self.shards.values() for s in shards if s.ps == ps]

    def load(self, num_ps: int, specs: dict[str, VariableSpec]) -> list[int]:
        """Bytes held by each ps task."""
        out = [0] * num_ps
        for name, shards in self.shards.items():
            spec = specs[name]
            row_bytes = spec.nbytes // max(1, spec.shape[0]) if spec.shape else spec.nbytes
            for s in shards:
                out[s.ps] += row_bytes * (s.stop - s.start) if spec.shape else spec.nbytes
        return out


def _itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"variables of dtype {dtype!r} are not supported") from None
