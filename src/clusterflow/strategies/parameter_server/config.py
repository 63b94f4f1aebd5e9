"""``ParameterServerConfig``: every setting of ``ParameterServerStrategy`` in one value.

The strategy takes one frozen, keyword-only config (torchtitan's habit, STYLE.md): a
run's settings can be built, compared, logged and passed around whole, and a bad value
fails here, when the config is built, not in the middle of training. The fields that
every ps task must agree on travel to the ps as ``clusterflow.ps.api.PSConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from clusterflow._checks import seconds, whole
from clusterflow.errors import ConfigError
from clusterflow.ps.api import Mode, PSConfig, StalePolicy, WireDtype
from clusterflow.ps.placement import Partitioner
from clusterflow.ps.rows import Init, Sharding


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterServerConfig:
    """How a ``ParameterServerStrategy`` trains. ``ParameterServerStrategy(mode="sync")``
    builds one from its keyword arguments; pass ``config=`` to share one value."""

    mode: Mode = "async"
    """async: apply each push on arrival. sync: average the pushes of one step."""
    backup_workers: int = 0
    """sync only: a step takes the first N = replicas - k pushes; the k slowest drop."""
    max_staleness: int | None = None
    """async only: a push computed from values more than this many versions old is stale;
    one exactly this many versions old is applied as is (0: only a push from the current
    values is fresh)."""
    stale_policy: StalePolicy = "drop"
    """``drop`` a stale push (its splits go back to the data service), or ``scale``
    its learning rate by 1/staleness."""
    staleness_aware_lr: bool = False
    """async only: every push's learning rate is scaled by 1/staleness."""
    warmup_steps: int = 0
    """async only: the chief alone takes the first W global steps."""
    reject_nonfinite: bool = True
    """The ps refuses gradients holding NaN or Inf (nothing of such a push is applied)."""
    variable_partitioner: Partitioner | None = None
    """Splits large variables into shards across the ps tasks (None: whole variables)."""
    gradient_wire_dtype: WireDtype = "float32"
    """``bfloat16`` halves the bytes of every push."""
    value_wire_dtype: WireDtype = "float32"
    """``bfloat16`` halves the bytes of every pull."""
    overlap_push: bool = True
    """async only: a push travels while the next step computes (at most one in flight;
    the step uses the newest values that arrived, so it reads values at most one of its
    own pushes old: one version of staleness more). Its splits are acked when its reply
    comes, so exactly-once costs the step nothing. Off by itself under
    ``max_staleness=0``, which leaves no room for that version."""
    deadline_s: float = 120.0
    """Every call to a ps must answer within this many seconds."""
    dense: Literal["ps", "allreduce"] = "ps"
    """Where the dense parameters live: on the ps tasks like any variable, or on every
    worker, averaged by the collective engine each step (``allreduce``; docs/embeddings.md).
    Embedding tables built in the scope are on the ps tasks either way."""
    table_sharding: Sharding = "hash"
    """How tables are cut by rows over the ps tasks: ``hash`` (row % P) or ``range``."""
    table_init: Init = "normal"
    """The tables' initial rows: ``normal`` as nn.Embedding, ``uniform``, or ``zeros``."""
    table_seed: int = 0
    """Seeds the rows each ps task draws for its shards."""
    row_cache_steps: int = 0
    """A worker serves rows it pulled at most this many steps ago from its cache (0: off)."""
    row_cache_rows: int = 0
    """How many rows per table that cache holds."""

    def __post_init__(self) -> None:
        for name in ("gradient_wire_dtype", "value_wire_dtype"):
            value = getattr(self, name)
            if value not in ("float32", "bfloat16"):
                raise ConfigError(f"{name} must be float32 or bfloat16, got {value!r}")
        seconds("deadline_s", self.deadline_s)
        if self.dense not in ("ps", "allreduce"):
            raise ConfigError(f"dense must be 'ps' or 'allreduce', got {self.dense!r}")
        for name in ("row_cache_steps", "row_cache_rows"):
            whole(name, getattr(self, name))
        whole("table_seed", self.table_seed, least=-(2**63))
        if self.table_sharding not in ("hash", "range"):
            raise ConfigError(
                f"table_sharding must be 'hash' or 'range', got {self.table_sharding!r}"
            )
        if self.table_init not in ("normal", "uniform", "zeros"):
            raise ConfigError(
                f"table_init must be 'normal', 'uniform' or 'zeros', got {self.table_init!r}"
            )
        whole("backup_workers", self.backup_workers)
        self.ps_config(self.backup_workers + 1)  # the fields the ps checks, checked now

    def ps_config(self, num_replicas: int) -> PSConfig:
        """What every ps task applies pushes by, for ``num_replicas`` replicas."""
        return PSConfig(
            mode=self.mode,
            num_replicas=max(1, num_replicas),
            backup_workers=self.backup_workers,
            max_staleness=self.max_staleness,
            stale_policy=self.stale_policy,
            staleness_aware_lr=self.staleness_aware_lr,
            warmup_steps=self.warmup_steps,
            reject_nonfinite=self.reject_nonfinite,
        )

    def replica_options(self) -> dict[str, Any]:
        """The options that make another process's strategy push and pull as one of this
        config (``ParameterServerStrategy.replica_options``); not the partitioner."""
        names = "mode max_staleness stale_policy staleness_aware_lr reject_nonfinite"
        names += " gradient_wire_dtype value_wire_dtype deadline_s"
        return {name: getattr(self, name) for name in names.split()}

    @classmethod
    def of(cls, options: dict[str, Any]) -> ParameterServerConfig:
        """A config from keyword arguments; an unknown one is a ``ConfigError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"ParameterServerStrategy has no option {unknown[0]!r}; "
                f"options: {', '.join(sorted(known))}"
            )
        return cls(**options)
