"""A worker's side of the ps-sharded embedding tables: pull rows, push row gradients.

``ParameterServerStrategy`` builds one ``TableSession`` when its scope made tables
(``strategies/embedding.py``). Per step, each table module's forward asks ``lookup`` for the
unique rows of its batch: the session splits them by shard, pulls each shard's rows
(one ``ps.rows_pull`` per ps task, in parallel), and hands back a leaf tensor. At
``optimizer.step()`` the strategy calls ``push``: per ps task one ``ps.rows_push`` with
every table's (ids, gradient rows), coalesced, and the step's split keys. Dense
parameters that stay on the worker (``dense="allreduce"``) are averaged over the
replicas by the collective engine in the same hook (``DenseReplicas``).

An optional row cache keeps the rows pulled at step ``s`` and serves them until step
``s + cache_steps``: bounded staleness, fewer bytes for hot rows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from clusterflow.ps.api import PSConfig
from clusterflow.ps.client import PSConnection, send
from clusterflow.ps.membership import LeaveRequest
from clusterflow.ps.protocol import PushReply
from clusterflow.ps.rows import RowOptimizerSpec, TableSpec
from clusterflow.ps.rows_protocol import (
    RowsCreateRequest,
    RowsOptimizerRequest,
    RowsPullReply,
    RowsPullRequest,
    RowsPushReply,
    RowsPushRequest,
    RowsReadReply,
    RowsReadRequest,
)
from clusterflow.strategies.embedding import attach


@dataclass(slots=True)
class _Cache:
    ids: torch.Tensor
    rows: torch.Tensor
    step: int


@dataclass(frozen=True, slots=True)
class RowsPush:
    """One step's row gradients, split by ps task, and what goes with them."""

    per_ps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]
    """Per ps task: (ids, gradient rows) of each table it holds rows of."""
    versions: list[int]
    """The table version each task's rows were pulled at (sync: the step's)."""
    keys: tuple[tuple[str, int, int], ...]
    hyper: dict[str, Any]


@dataclass(slots=True)
class TableStats:
    """What the tables moved: the benchmark's bytes per step come from here."""

    bytes_pulled: int = 0
    bytes_pushed: int = 0
    rows_pulled: int = 0
    cache_hits: int = 0
    steps: int = 0
    staleness: list[int] = field(default_factory=list)


class TableSession:
    """The tables of one worker: their specs, this step's lookups, versions per ps task."""

    def __init__(
        self,
        ps: PSConnection,
        config: PSConfig,
        worker: str,
        *,
        deadline: float,
        cache_steps: int = 0,
        cache_rows: int = 0,
    ) -> None:
        self._ps = ps
        self._config = config
        self._worker = worker
        self._deadline = deadline
        self._cache_steps = cache_steps
        self._cache_rows = cache_rows
        self.specs: dict[str, TableSpec] = {}
        self.weights: dict[int, str] = {}
        """The table name of each meta weight, by ``id`` (the optimizer's params)."""
        self._lookups: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.versions = [0] * ps.num_ps
        self._read: list[int | None] = [None] * ps.num_ps
        """async: per ps task, the oldest table version this step's rows were pulled at.
        A push names it, not ``versions``: with ``overlap_push`` the previous push's
        reply may advance ``versions`` after this step read its rows."""
        """Per ps task, the tables' version this replica's rows came from."""
        self._floor = [0] * ps.num_ps
        """sync: per ps task, the version a pull must wait for (after this replica's step)."""
        self._optimizers: set[int] = set()
        self._cache: dict[str, _Cache] = {}
        self.stats = TableStats()

    # Creating ------------------------------------------------------------------------

    def create(
        self, modules: Sequence[tuple[nn.Module, str]], *, sharding: str, init: str, seed: int
    ) -> None:
        """Declares each table on every ps task (each draws its rows) and attaches it."""
        for module, name in modules:
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            spec = TableSpec(
                name=name,
                rows=int(weight.shape[0]),
                dim=int(weight.shape[1]),
                num_shards=self._ps.num_ps,
                sharding=sharding,  # type: ignore[arg-type]
                init=init,  # type: ignore[arg-type]
                seed=seed,
                padding_idx=getattr(module, "padding_idx", None),
            )
            self.specs[name] = spec
            self.weights[id(weight)] = name
        tables = list(self.specs.values())

        def create(index: int) -> None:
            request = RowsCreateRequest(config=self._config, tables=tables, shard=index)
            self._ps.call(index, request.METHOD, *request.to_wire())

        self._ps.map(create, range(self._ps.num_ps))
        for module, name in modules:
            attach(module, name, self)
        self.sync_versions()

    def sync_versions(self) -> None:
        """Learns each ps task's table version (after a create, a restore, a restart):
        a sync push names the step it joins, so it must start from the ps's."""
        request = RowsPullRequest(ids={}, timeout=self._deadline)
        body, tensors = request.to_wire()
        replies = self._ps.map(
            lambda i: self._ps.call(i, request.METHOD, body, tensors), range(self._ps.num_ps)
        )
        self.versions = [int(reply[0]["version"]) for reply in replies]
        self._floor = list(self.versions)

    # Per step ------------------------------------------------------------------------

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of unique ``ids``, pulled (or cached), as a leaf recording their grad.

        Raises:
            TableIndexError: an id outside the table (one line naming both).
            PSError, RpcError: a ps task refused or did not answer in time.
        """
        spec = self.specs[table]
        spec.check_ids(ids)
        rows = torch.empty(ids.numel(), spec.dim)
        missing = self._from_cache(table, ids, rows)
        if missing.numel():
            wanted = ids[missing]
            shards = spec.shard_of(wanted)
            per_ps = {i: (shards == i).nonzero().squeeze(1) for i in range(self._ps.num_ps)}
            targets = [i for i, at in per_ps.items() if at.numel()]

            def pull(index: int) -> RowsPullReply:
                at = per_ps[index]
                request = RowsPullRequest(
                    ids={table: wanted[at]},
                    min_version=self._floor[index],
                    timeout=self._deadline,
                )
                reply = RowsPullReply.from_wire(
                    *self._ps.call(index, request.METHOD, *request.to_wire())
                )
                return reply

            for index, reply in zip(targets, self._ps.map(pull, targets), strict=True):
                got = reply.rows[table]
                rows[missing[per_ps[index]]] = got
                self.versions[index] = reply.version
                read = self._read[index]
                self._read[index] = reply.version if read is None else min(read, reply.version)
                self.stats.bytes_pulled += got.numel() * 4 + per_ps[index].numel() * 8
                self.stats.rows_pulled += got.shape[0]
            self._to_cache(table, wanted, rows[missing])
        if torch.is_grad_enabled():  # evaluation (no_grad) has nothing to push
            rows.requires_grad_(True)
            self._lookups.setdefault(table, []).append((ids, rows))
        return rows

    def _from_cache(self, table: str, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fills ``out`` with fresh cached rows; the positions still to pull."""
        cache = self._cache.get(table)
        everything = torch.arange(ids.numel())
        if cache is None or self.stats.steps - cache.step > self._cache_steps:
            self._cache.pop(table, None)
            return everything
        at = torch.searchsorted(cache.ids, ids).clamp_(max=max(0, cache.ids.numel() - 1))
        hit = cache.ids[at] == ids if cache.ids.numel() else torch.zeros_like(ids, dtype=torch.bool)
        out[hit] = cache.rows[at[hit]]
        self.stats.cache_hits += int(hit.sum())
        return everything[~hit]

    def _to_cache(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if self._cache_steps <= 0 or self._cache_rows <= 0:
            return
        cache = self._cache.get(table)
        if cache is None:
            cache = self._cache[table] = _Cache(
                torch.empty(0, dtype=torch.int64), torch.empty(0, rows.shape[1]), self.stats.steps
            )
        room = self._cache_rows - cache.ids.numel()
        if room <= 0:
            return
        merged_ids = torch.cat([cache.ids, ids[:room]])
        merged_rows = torch.cat([cache.rows, rows[:room].detach()])
        order = torch.argsort(merged_ids)
        cache.ids, cache.rows = merged_ids[order], merged_rows[order]

    @property
    def pending(self) -> bool:
        """Whether this step looked rows up (and so has gradients to push)."""
        return bool(self._lookups)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Tells every ps task the row optimizer of each table in ``optimizer``'s groups."""
        if id(optimizer) in self._optimizers:
            return
        from clusterflow.ps.optimizer import hyperparameters

        specs = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self.weights.get(id(param))
                if name is not None:
                    specs[name] = RowOptimizerSpec.of(
                        type(optimizer).__name__, hyperparameters(group), name
                    )
        if specs:
            request = RowsOptimizerRequest(optimizers=specs)
            body, _ = request.to_wire()
            self._ps.map(lambda i: self._ps.call(i, request.METHOD, body), range(self._ps.num_ps))
        self._optimizers.add(id(optimizer))

    def hyper(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Each table's current lr (a schedule's), from its group in ``optimizer``."""
        out = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self.weights.get(id(param))
                if name is not None:
                    out[name] = {"lr": float(group["lr"])}
        return out

    def push(
        self, keys: tuple[tuple[str, int, int], ...], hyper: dict[str, Any]
    ) -> list[PushReply]:
        """Pushes this step's row gradients to every ps task; their replies in ps order."""
        return self.send(self.prepare(keys, hyper))

    def prepare(self, keys: tuple[tuple[str, int, int], ...], hyper: dict[str, Any]) -> RowsPush:
        """This step's row gradients, split by ps task, ready to send (``send``).

        Taken in the training thread, in the optimizer's pre-hook: it reads the rows'
        gradients and forgets the step's lookups, so the next step may look rows up
        while ``send`` runs in the background (async ``overlap_push``).
        """
        per_ps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = [
            ({}, {}) for _ in range(self._ps.num_ps)
        ]
        for table, looked in self._lookups.items():
            spec = self.specs[table]
            ids = torch.cat([i for i, _ in looked])
            grads = torch.cat(
                [r.grad if r.grad is not None else torch.zeros_like(r) for _, r in looked]
            )
            if len(looked) > 1:
                from clusterflow.ps.rows import coalesce

                ids, grads = coalesce(ids, grads)
            shards = spec.shard_of(ids)
            for index in range(self._ps.num_ps):
                at = (shards == index).nonzero().squeeze(1)
                if at.numel():
                    per_ps[index][0][table] = ids[at]
                    per_ps[index][1][table] = grads[at].detach()
        self._lookups.clear()
        sync = self._config.mode == "sync"
        # A step counts when its push is taken, not when it is answered: the row cache
        # ages by this worker's steps, and with overlap_push a reply comes a step late.
        self.stats.steps += 1
        read, self._read = self._read, [None] * self._ps.num_ps
        pushed = []
        for index, pulled in enumerate(read):
            if sync:
                pushed.append(self._floor[index])
            else:
                pushed.append(self.versions[index] if pulled is None else pulled)
        return RowsPush(per_ps, pushed, keys, hyper)

    def send(self, prepared: RowsPush) -> list[PushReply]:
        """Sends a prepared push to every ps task; their replies in ps order.

        Every task gets a push, with rows or without: a sync table step waits for every
        replica on every shard, and a table's optimizer counts its steps.
        """
        sync = self._config.mode == "sync"
        pushed = prepared.versions

        def push(index: int) -> RowsPushReply:
            ids, grads = prepared.per_ps[index]
            request = RowsPushRequest(
                worker=self._worker,
                version=pushed[index],
                ids=ids,
                grads=grads,
                keys=prepared.keys,
                hyper=prepared.hyper,
                timeout=self._deadline,
            )
            self.stats.bytes_pushed += sum(
                g.numel() * 4 + i.numel() * 8
                for i, g in zip(ids.values(), grads.values(), strict=True)
            )
            return RowsPushReply.from_wire(
                *self._ps.call(index, request.METHOD, *request.to_wire())
            )

        replies = self._ps.map(push, range(self._ps.num_ps))
        for index, reply in enumerate(replies):
            self.stats.staleness.append(reply.staleness)
            if sync:
                self._floor[index] = pushed[index] + 1
            else:
                self.versions[index] = max(self.versions[index], reply.version)
        return [
            PushReply(
                applied=r.applied,
                version=r.version,
                reason=r.reason,
                staleness=r.staleness,
                duplicates=r.duplicates,
            )
            for r in replies
        ]

    @property
    def step_version(self) -> int:
        """sync: the table step ps 0 is known to have reached or be waiting for."""
        return self._floor[0] if self._config.mode == "sync" else self.versions[0]

    def wait_applied(self) -> int:
        """sync: waits until ps 0's tables applied this replica's last step; the version."""
        request = RowsPullRequest(ids={}, min_version=self._floor[0], timeout=self._deadline)
        reply = RowsPullReply.from_wire(*self._ps.call(0, request.METHOD, *request.to_wire()))
        return reply.version

    def leave(self) -> None:
        """Tells the other ps tasks (ps 0 is told by the strategy) that no more pushes come."""
        for index in range(1, self._ps.num_ps):
            send(self._ps, index, LeaveRequest(worker=self._worker))

    def read(self, table: str) -> torch.Tensor:
        """The whole table, joined from every shard (tests, small tables only)."""
        parts = []
        for index in range(self._ps.num_ps):
            read = RowsReadReply.from_wire(*send(self._ps, index, RowsReadRequest(table=table)))
            parts.append((read.ids, read.rows))
        spec = self.specs[table]
        out = torch.empty(spec.rows, spec.dim)
        for ids, rows in parts:
            out[ids] = rows
        return out


class DenseReplicas:
    """Dense parameters kept on each worker and averaged by the collective engine.

    ``dense="allreduce"``: every replica holds the dense layers; at ``optimizer.step()``
    their gradients are all-reduced (one flat buffer, one collective), then the user's
    own optimizer applies them locally, in the same step as the rows' push.
    """

    def __init__(self, params: Sequence[torch.Tensor], spec: Any, task: Any) -> None:
        from clusterflow.collective.api import CommunicationOptions
        from clusterflow.collective.group import CollectiveGroup
        from clusterflow.collective.membership import Membership

        self.params = list(params)
        membership = Membership.from_env(os.environ, spec, task) if task else Membership.single()
        self.group = CollectiveGroup.form(membership, CommunicationOptions(), torch.device("cpu"))
        self.ids = {id(p) for p in self.params}
        with torch.no_grad():
            for p in self.params:  # every replica starts from rank 0's values
                self.group.broadcast_(p.data)

    def all_reduce(self) -> None:
        """Averages the gradients of the dense parameters over the replicas, in place."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.group.world_size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.group.all_reduce_(flat).div_(self.group.world_size)
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()
