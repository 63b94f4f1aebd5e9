"""What ``ParameterServerStrategy`` does beside its dense variables: tables and replicas.

One object per strategy, so the strategy's own order of calls (pull, step, push,
settle) stays where it is and each place gains one call into here:

* ``create``: the scope's embedding modules become ps tables (``TableSession``); with
  ``dense="allreduce"`` the dense parameters stay on the workers (``DenseReplicas``);
  what is left goes to the ps as before.
* ``step`` (the optimizer pre-hook): all-reduce the dense gradients, take the rows'
  gradients; ``send`` pushes them (async with ``overlap_push``: beside the next step).
* the consistent cut: the rows are in each ps task's part already (``PSHandler.state``);
  the workers' dense values go into a ``dense`` part, written by the chief.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from clusterflow.data.api import SplitKey
from clusterflow.errors import ConfigError
from clusterflow.ps.api import PSConfig
from clusterflow.ps.client import PSConnection
from clusterflow.ps.protocol import PushReply
from clusterflow.strategies.api import Part, ReadPart
from clusterflow.strategies.parameter_server.config import ParameterServerConfig
from clusterflow.strategies.parameter_server.keys import KeyLedger
from clusterflow.strategies.parameter_server.tables import DenseReplicas, RowsPush, TableSession
from clusterflow.strategies.resolver import ClusterResolver
from clusterflow.strategies.variables import Recorded

DENSE_PART = "dense"


class SparseSide:
    """The tables and the all-reduced dense parameters of one strategy (or neither)."""

    def __init__(
        self,
        options: ParameterServerConfig,
        config: PSConfig,
        ps: PSConnection,
        worker: str,
        resolver: ClusterResolver,
    ) -> None:
        self._options = options
        self._config = config
        self._ps = ps
        self._worker = worker
        self._resolver = resolver
        self.tables: TableSession | None = None
        self.dense: DenseReplicas | None = None
        self._dense_names: list[tuple[str, torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return self.tables is not None or self.dense is not None

    def create(self, items: Sequence[Recorded], modules: Sequence[nn.Module]) -> list[Recorded]:
        """Makes the tables and the dense replicas; returns the items the ps still holds."""
        names = {id(item.tensor): item.name for item in items}
        if modules:
            o = self._options
            self.tables = TableSession(
                self._ps,
                self._config,
                self._worker,
                deadline=o.deadline_s,
                cache_steps=o.row_cache_steps,
                cache_rows=o.row_cache_rows,
            )
            self.tables.create(
                [(m, names[id(m.weight)]) for m in modules],
                sharding=o.table_sharding,
                init=o.table_init,
                seed=o.table_seed,
            )
        rest = [item for item in items if not item.tensor.is_meta]
        if self._options.warmup_steps and (self._options.dense == "allreduce" or not rest):
            raise ConfigError(
                "warmup_steps counts the steps of dense variables on the ps; this model has "
                "none there (dense='allreduce', or only tables): drop warmup_steps"
            )
        if self._options.dense != "allreduce" or not rest:
            return rest
        self._dense_names = [(item.name, item.tensor) for item in rest]
        task = self._resolver.task
        spec = self._resolver.cluster_spec() if task is not None else None
        self.dense = DenseReplicas([i.tensor for i in rest if i.trainable], spec, task)
        return []

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of this strategy's tables' weights or all-reduced dense
        parameters (by identity: another strategy's table weight is a meta tensor too)."""
        tables, dense = self.tables, self.dense
        return (tables is not None and id(param) in tables.weights) or (
            dense is not None and id(param) in dense.ids
        )

    def step(
        self, optimizer: torch.optim.Optimizer, keys: Sequence[tuple[str, int, int]]
    ) -> RowsPush | None:
        """In ``optimizer.step()``'s pre-hook: averages the dense gradients over the
        replicas, then takes the rows' gradients to push (None: no rows this step).
        ``send`` pushes them, in this thread or, async, beside the next step."""
        if self.dense is not None:
            self.dense.all_reduce()
        tables = self.tables
        if tables is None or not tables.pending:
            return None
        tables.register_optimizer(optimizer)
        return tables.prepare(tuple(keys), tables.hyper(optimizer))

    def send(self, rows: RowsPush | None) -> list[PushReply]:
        """Pushes what ``step`` took; the replies in ps order (none without rows)."""
        if rows is None or self.tables is None:
            return []
        return self.tables.send(rows)

    def settle(self, ledger: KeyLedger, keys: Sequence[SplitKey], replies: list[PushReply]) -> bool:
        """Decides a step's keys from the rows' replies (no dense push to decide them)."""
        if self._config.mode != "sync":
            return ledger.async_replies(keys, replies)
        assert self.tables is not None
        return ledger.sync_reply(keys, replies[0], self.tables.step_version - 1)

    def reached(self) -> int:
        """sync, tables only: the table version ps 0 is known to have reached."""
        return self.tables.versions[0] if self.tables is not None else 0

    def wait(self) -> None:
        """sync, tables only: waits until ps 0 applied this replica's last table step."""
        if self.tables is not None and self._config.mode == "sync":
            self.tables.versions[0] = max(self.tables.versions[0], self.tables.wait_applied())

    def leave(self) -> None:
        if self.tables is not None:
            self.tables.leave()

    # The consistent cut ----------------------------------------------------------

    def parts(self) -> list[Part]:
        if not self._dense_names:
            return []
        tensors = {f"var/{n}": t.detach().clone() for n, t in self._dense_names}
        return [(DENSE_PART, {}, tensors)]

    def cut_meta(self) -> dict[str, Any]:
        return {"dense_part": True} if self._dense_names else {}

    def restore(self, meta: dict[str, Any], read: ReadPart) -> None:
        """Loads the dense values every replica keeps (each reads the same part)."""
        if self.tables is not None:
            self.tables.sync_versions()
        if not meta.get("dense_part") or not self._dense_names:
            return
        _, tensors = read(DENSE_PART)
        with torch.no_grad():
            for name, tensor in self._dense_names:
                tensor.copy_(tensors[f"var/{name}"])
