"""The embedding-table shards of one ps task, and the rules that apply sparse pushes.

Beside a ps task's ``VariableStore`` (dense variables), a ``RowStore`` holds this task's
rows of every table. A worker pulls the unique rows its batch uses and pushes their
gradients as ``(ids, values)``; the rules are the dense ones (``store.py``):

* async: a push applies on arrival; staleness is the number of row steps applied since
  the worker's pull; over ``max_staleness`` it is dropped or scaled (``stale_policy``).
* sync: a step applies once every present replica pushed (the average of their
  gradients, row by row). Each shard decides alone, which is sound because a table
  step takes *every* replica (backup workers are refused with tables): every shard
  waits for the same set. So every row push commits on its own shard.
* exactly-once: a push names the ``(dataset, epoch, split)`` keys it completes, and a
  key is applied at most once (``AppliedKeys``), in the checkpointed state too.

Those rules are written once, in ``engine.py``, for the dense variables too; this
module checks row gradients, averages them row by row and steps the row optimizers.
Pure of networking, as ``VariableStore``; ``protocol.py`` serves it as ``ps.rows_*``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from clusterflow.ps.api import PSConfig, PSError, PushRejected
from clusterflow.ps.applied import AppliedKeys, Key
from clusterflow.ps.engine import Applied, ApplyEngine, Part, PushResult
from clusterflow.ps.rows import RowOptimizer, RowOptimizerSpec, TableSpec, coalesce

Rows = tuple[torch.Tensor, torch.Tensor]
"""One table's (ids, gradient rows)."""
RowGrads = dict[str, Rows]
"""Per table: (global ids, gradient rows)."""


@dataclass(slots=True)
class TableShard:
    spec: TableSpec
    shard: int
    values: torch.Tensor
    optimizer: RowOptimizer | None = None


class RowStore(Applied):
    """Every table's rows held by one ps task; see the module docstring."""

    def __init__(self, ps_index: int = 0) -> None:
        self.ps_index = ps_index
        self._engine: ApplyEngine[Rows] = ApplyEngine(f"ps:{ps_index} (tables)", self._apply)
        self._cond = self._engine.cond
        self.config: PSConfig | None = None
        self.tables: dict[str, TableShard] = {}

    # Set-up -----------------------------------------------------------------------

    def create(
        self, config: PSConfig, specs: list[TableSpec], shard: int | None = None
    ) -> list[str]:
        """Draws this shard's rows of each table; tables that exist are kept.

        ``shard``: the index the worker addresses this task by (its place in the
        cluster spec's ps job); the first creator's sets it, as a ps started outside a
        cluster (``create_local_server``) knows no index of its own.

        Raises:
            PSError: another config or shard than the first creator's, a table
                redeclared with another shape, or backup workers (a table step takes
                every replica).
        """
        if config.backup_workers:
            raise PSError("embedding tables take every replica per sync step: no backup_workers")
        created = []
        with self._cond:
            if self.config is None:
                self.config = config
                self.ps_index = self.ps_index if shard is None else shard
                self._engine.name = f"ps:{self.ps_index} (tables)"
            elif shard is not None and shard != self.ps_index:
                raise PSError(
                    f"ps:{self.ps_index} was created as shard {self.ps_index}, not {shard}"
                )
            elif not self.config.agrees_with(config, resizable=self._engine.resizable):
                raise PSError(
                    f"ps:{self.ps_index} tables run {self.config.to_dict()}; a worker asked "
                    f"for {config.to_dict()}"
                )
            for spec in specs:
                have = self.tables.get(spec.name)
                if have is not None:
                    if have.spec != spec:
                        raise PSError(f"table {spec.name!r} exists as {have.spec}; got {spec}")
                    continue
                if not 0 <= self.ps_index < spec.num_shards:
                    raise PSError(f"table {spec.name!r} has no shard {self.ps_index}")
                values = spec.initial_rows(self.ps_index)
                self.tables[spec.name] = TableShard(spec, self.ps_index, values)
                created.append(spec.name)
        return created

    def set_optimizer(self, specs: Mapping[str, RowOptimizerSpec]) -> None:
        """Builds each table's row optimizer once; a second identical request is a no-op."""
        with self._cond:
            for name, spec in specs.items():
                table = self._table(name)
                if table.optimizer is None:
                    table.optimizer = RowOptimizer(
                        RowOptimizerSpec(name=spec.name, hyper=dict(spec.hyper)),
                        table.values.shape[0],
                        table.spec.dim,
                    )
                elif table.optimizer.spec.name != spec.name:
                    raise PSError(
                        f"table {name!r} is trained by {table.optimizer.spec.name}; a worker "
                        f"sent {spec.name}"
                    )

    def _table(self, name: str) -> TableShard:
        table = self.tables.get(name)
        if table is None:
            raise PSError(f"ps:{self.ps_index} holds no table {name!r}")
        return table

    # Reads ------------------------------------------------------------------------

    def pull(
        self, wanted: Mapping[str, torch.Tensor], min_version: int = 0, timeout: float = 60.0
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """The rows of each table at the given global ids, once ``version >= min_version``.

        Raises:
            TableIndexError: an id outside its table (the ps keeps serving).
            PSError: an unknown table, or an id that lives on another shard.
            VersionTimeout: the version did not come in time.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            local = {name: self._local(name, ids) for name, ids in wanted.items()}
            self._engine.wait_version(min_version, deadline, timeout)
            self.stats["rows_pulled"] += sum(int(ix.numel()) for ix in local.values())
            out = {name: self.tables[name].values[ix] for name, ix in local.items()}
            return self.version, out

    def _local(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        table = self._table(name)
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise PushRejected(f"table {name!r}: ids must be a 1-d int64 tensor")
        table.spec.check_ids(ids)
        if ids.numel() and bool((table.spec.shard_of(ids) != self.ps_index).any()):
            raise PSError(f"table {name!r}: ids sent to ps:{self.ps_index} live on another shard")
        return table.spec.local(ids, self.ps_index)

    def read_rows(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(global ids, values) of this shard of a table, whole (export, tests)."""
        with self._cond:
            table = self._table(name)
            return table.spec.global_ids(self.ps_index), table.values.clone()

    # Pushes -----------------------------------------------------------------------

    def push(
        self,
        *,
        worker: str,
        version: int,
        grads: RowGrads,
        keys: list[Key] | tuple[Key, ...] = (),
        hyper: Mapping[str, Any] | None = None,
        timeout: float = 60.0,
    ) -> PushResult:
        """Applies (async) or buffers and maybe applies (sync) one worker's row gradients.

        ``hyper`` maps a table to its group's current hyper-parameters (an lr schedule).

        Raises:
            PushRejected: an unknown table, ids out of range or of another shard, a shape
                that is not ``(len(ids), dim)``, or non-finite values; nothing is applied.
            PSError: no config or optimizer yet, or the ps stayed quiesced past timeout.
        """
        checked = self._check(grads)
        deadline = time.monotonic() + timeout
        with self._cond:
            config = self.config
            if config is None:
                raise PSError(f"ps:{self.ps_index} has no tables yet")
            admitted = self._engine.admit(config, worker, keys, deadline, timeout)
            self.stats["row_pushes"] += 1
            if admitted.refused is not None:
                return admitted.refused
            part = Part(checked if not admitted.duplicates else {}, admitted.keys, hyper or {})
            if config.mode == "async":
                return self._engine.apply_async(config, version, part)
            result = self._engine.buffer_sync(config, worker, version, part, commit=True)
            # Tables alone: this reply decides the step's keys (``KeyLedger.sync_reply``);
            # without the duplicates its new keys would count as applied, and be acked,
            # although the push joined the step empty.
            result.duplicates = admitted.duplicates
            return result

    def _check(self, grads: RowGrads) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        reject = self.config is None or self.config.reject_nonfinite
        for name, (ids, raw) in grads.items():
            try:
                local = self._local(name, ids)
            except PSError as exc:
                raise PushRejected(str(exc)) from None
            table = self.tables[name]
            if table.optimizer is None:
                raise PSError(f"table {name!r} on ps:{self.ps_index} has no optimizer yet")
            if tuple(raw.shape) != (ids.numel(), table.spec.dim):
                raise PushRejected(
                    f"table {name!r}: gradient rows of shape {tuple(raw.shape)} for "
                    f"{ids.numel()} ids of dim {table.spec.dim}"
                )
            values = raw.to(torch.float32)
            if reject and not bool(torch.isfinite(values).all()):
                raise PushRejected(f"gradient rows of table {name!r} hold NaN or Inf; refused")
            out[name] = coalesce(local, values)
        return out

    def _step(
        self,
        grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        hyper: Mapping[str, Any],
        scale: float,
    ) -> None:
        """One optimizer step of every table: those without rows still count the step,
        as ``torch.optim.SparseAdam`` counts one for a table every step."""
        empty = torch.empty(0, dtype=torch.int64)
        for name, table in self.tables.items():
            opt = table.optimizer
            if opt is None:
                continue
            if name in hyper:
                opt.set_hyper(hyper[name])
            local, values = grads.get(name, (empty, torch.empty(0, table.spec.dim)))
            opt.apply(table.values, local, values, scale)
            self.stats["rows_applied"] += int(local.numel())

    def _apply(self, parts: list[Part[Rows]], lr_scale: float) -> None:
        """The engine's step: one over the row-wise average of ``parts`` (the lock is held)."""
        if len(parts) == 1:
            self._step(parts[0].grads, parts[0].hyper, lr_scale)
            return
        summed: dict[str, list[Rows]] = {}
        for part in parts:
            for name, pair in part.grads.items():
                summed.setdefault(name, []).append(pair)
        averaged = {}
        for name, pairs in summed.items():
            ids, values = coalesce(
                torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
            )
            averaged[name] = (ids, values.div_(len(parts)))
        self._step(averaged, parts[0].hyper, lr_scale)

    def leave(self, worker: str) -> None:
        """A replica will push no more: sync steps stop waiting for it."""
        self._engine.leave(self.config, worker)

    def members(
        self, workers: Sequence[str], version: int | None, previous: Sequence[str] = ()
    ) -> int:
        """From table step ``version`` on (None: the next), a sync step takes ``workers``."""
        return self._engine.set_members(workers, version, previous)

    # Checkpoint hooks -------------------------------------------------------------

    def quiesce(self, timeout: float = 60.0) -> int:
        return self._engine.quiesce(timeout)

    def resume(self) -> None:
        self._engine.resume()

    def add_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Adds the tables' rows, optimizer state, version and applied keys to a ps state."""
        with self._cond:
            if self.config is None:
                return
            tables: dict[str, Any] = {}
            for name, table in self.tables.items():
                tensors[f"table/{name}/rows"] = table.values.clone()
                opt = table.optimizer
                entry: dict[str, Any] = {"spec": table.spec.to_dict(), "optimizer": None}
                if opt is not None:
                    entry["optimizer"] = opt.spec.to_dict()
                    entry["step"] = opt.step_count
                    tensors.update(opt.slots.state(f"table/{name}/slot/"))
                tables[name] = entry
            meta["tables"] = {
                "config": self.config.to_dict(),
                "version": self.version,
                "applied_keys": self.applied.to_state(),
                "tables": tables,
            }

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """Replaces every table with the state ``add_state`` wrote (nothing if it wrote none)."""
        saved = meta.get("tables")
        with self._cond:
            self.tables.clear()
            if not saved:
                self.config = None
                self._engine.restore(0, AppliedKeys())
                return
            self.config = PSConfig.from_dict(saved["config"])
            self._engine.restore(
                int(saved["version"]), AppliedKeys.from_state(saved.get("applied_keys"))
            )
            for name, entry in saved["tables"].items():
                spec = TableSpec.from_dict(entry["spec"])
                table = TableShard(spec, self.ps_index, tensors[f"table/{name}/rows"].clone())
                if entry.get("optimizer"):
                    opt_spec = RowOptimizerSpec.from_dict(entry["optimizer"])
                    opt = RowOptimizer(opt_spec, table.values.shape[0], spec.dim)
                    opt.step_count = int(entry.get("step", 0))
                    opt.slots.load(f"table/{name}/slot/", dict(tensors))
                    table.optimizer = opt
                self.tables[name] = table
            self._cond.notify_all()

    def snapshot_stats(self) -> dict[str, Any]:
        with self._cond:
            return {"version": self.version, "tables": len(self.tables), **dict(self.stats)}


def join_tables(
    parts: Sequence[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """Every table of a checkpoint's ps parts joined into its whole weight, by name.

    For ``load_module``: the one place a table is built whole, for serving.
    """
    out: dict[str, torch.Tensor] = {}
    for index, (meta, tensors) in enumerate(parts):
        for name, entry in ((meta.get("tables") or {}).get("tables") or {}).items():
            spec = TableSpec.from_dict(entry["spec"])
            whole = out.get(name)
            if whole is None:
                whole = out[name] = torch.empty(spec.rows, spec.dim)
            whole[spec.global_ids(index)] = tensors[f"table/{name}/rows"]
    return out
