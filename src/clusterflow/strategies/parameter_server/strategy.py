"""``ParameterServerStrategy`` (between-graph; its one-process form,
``CentralStorageStrategy``, is in ``strategies/central_storage.py``).

Every worker runs the same script (docs/parameter-server.md has it whole): build the
strategy, create the model in ``strategy.scope()`` (its variables go to the ps tasks),
then ``strategy.run(step, args)`` per batch, where ``step`` computes the loss, calls
``backward()`` and ``optimizer.step()``.

``run`` pulls the current values into the model, runs the step, and when the step
calls ``optimizer.step()`` a global optimizer pre-hook pushes the gradients (one
message per ps task) and clears them, so torch's local step does nothing: the update
happens on the ps, with the optimizer's current hyper-parameters (a schedule's lr).
In async mode each push's reply carries the shard's fresh values, so the next step
needs no pull; in sync mode the pull of the next version starts right after the push,
in the background, and the next ``run`` waits for it. Helpers, beside it in this
package: ``config.py`` (the settings), ``shards.py`` (moving shards), ``keys.py``
(exactly-once data).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from clusterflow.data.api import SplitKey
from clusterflow.errors import ConfigError
from clusterflow.ps.api import (
    Placement,
    Shard,
    VariableSpec,
)
from clusterflow.ps.client import PSConnection, RemotePS, send
from clusterflow.ps.membership import LeaveRequest
from clusterflow.ps.optimizer import hyperparameters
from clusterflow.ps.placement import place
from clusterflow.ps.protocol import STATS
from clusterflow.ps.wire import Tensors
from clusterflow.server.manager_link import ManagerLink
from clusterflow.strategies.api import (
    ReduceOp,
    Replicas,
    Settled,
    Strategy,
    StrategyError,
    parse_reduce_op,
)
from clusterflow.strategies.batches import deal_out
from clusterflow.strategies.embedding import intercepting
from clusterflow.strategies.parameter_server.config import ParameterServerConfig
from clusterflow.strategies.parameter_server.cut import PSCut
from clusterflow.strategies.parameter_server.keys import KeyLedger
from clusterflow.strategies.parameter_server.shards import (
    Push,
    TrackedVar,
    Values,
    buffers,
    declare,
    gradients,
    load_into,
    pull_all,
    register_optimizer,
    specs_of,
    tracked_in,
    wait_for_version,
)
from clusterflow.strategies.parameter_server.sparse import SparseSide
from clusterflow.strategies.parameter_server.staging import HostStaging
from clusterflow.strategies.parameter_server.tables import RowsPush
from clusterflow.strategies.resolver import (
    ClusterResolver,
    TFConfigClusterResolver,
    checked_resolver,
)
from clusterflow.strategies.variables import Recorded, recording

log = logging.getLogger(__name__)


class ParameterServerStrategy(PSCut, Strategy):
    """Variables on ps tasks; workers pull values and push gradients.

    Args:
        cluster_resolver: the cluster; by default from ``TF_CONFIG``.
        config: every setting (``ParameterServerConfig``: mode, backup workers,
            staleness, wire dtypes, overlap, deadline).
        **options: the fields of a ``ParameterServerConfig`` to build one from, as a
            convenience: ``ParameterServerStrategy(mode="sync", backup_workers=1)``.
            Not together with ``config``.

    Raises:
        ConfigError: an unknown option or a bad value (the message names it).
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        config: ParameterServerConfig | None = None,
        *,
        _connection: PSConnection | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ConfigError(
                f"pass either config= or options ({', '.join(sorted(options))}), not both"
            )
        if config is not None and not isinstance(config, ParameterServerConfig):
            raise ConfigError(
                f"config must be a ParameterServerConfig (or give its fields as keywords), "
                f"got {config!r}"
            )
        self.options = config if config is not None else ParameterServerConfig.of(options)
        """The strategy's settings, as given."""
        resolver = checked_resolver(cluster_resolver, "ParameterServerStrategy")
        self._resolver = resolver or TFConfigClusterResolver()
        task = self._resolver.task
        self._worker = str(task) if task is not None else "local:0"
        self.config = self.options.ps_config(self._resolver.num_workers())
        """What every ps task applies pushes by (``PSConfig``)."""
        self._grad_dtype = self.options.gradient_wire_dtype
        self._value_dtype = self.options.value_wire_dtype
        self._partitioner = self.options.variable_partitioner
        self._deadline = self.options.deadline_s
        self._ps: PSConnection = _connection or RemotePS(
            self._resolver.cluster_spec(),
            self._resolver.require_credentials(),
            deadline=self._deadline,
        )
        self._vars: list[TrackedVar] = []
        # Pinned host buffers for variables on a GPU, reused every step (staging.py).
        self._staging = HostStaging()
        self._by_tensor: dict[int, TrackedVar] = {}
        self.placement = Placement()
        self._versions = [0] * self._ps.num_ps
        # A step computed while this replica's previous push is in flight reads values
        # that push will make one version old: overlap only where max_staleness leaves
        # room for that version (with 0, every other push would be dropped as stale).
        self._overlap = (
            self.options.overlap_push
            and self.config.mode == "async"
            and not self.config.too_stale(1)
        )
        # sync: the background pull of the next version.
        self._next: Future[Values] | None = None
        # async: the push in flight; its thread writes only _bg_values, which the
        # main thread reads after collecting the future.
        self._inflight: Future[None] | None = None
        self._bg_values: Values | None = None
        # Values that arrived and wait to be copied into the model (main thread only).
        self._staged: Values | None = None
        self._optimizers: set[int] = set()
        self._in_run = False
        self._pushed = False
        self._warm = self.config.warmup_steps == 0 or self.is_chief
        self.steps = 0
        self.dropped_pushes = 0
        self.last_push_applied = False
        """Whether the last answered push was applied on every ps task."""
        self.last_step: int | None = None
        """sync: the step ps 0 took this replica's last push into (with its gradients
        when ``last_push_applied``, else as an empty part: its keys were applied
        before); None when it took none (late, or not a member of that step yet)."""
        self._keys: tuple[SplitKey, ...] = ()
        self._ledger = KeyLedger()
        self._left = False
        self._cut_versions: list[int] = []
        self._declared = _connection is not None  # in process: no manager to tell
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="ps-prefetch")
        self._sparse = SparseSide(self.options, self.config, self._ps, self._worker, self._resolver)
        self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)

    def _declare(self) -> None:
        """When training starts (the first ``run``), not when the strategy is built: a
        worker holds nothing the others need, so the manager may relaunch it alone (its
        splits go back to the queue; each ps applies a split's update at most once).

        And whether the cluster may grow and shrink around it (``clusterflow scale``):
        async, a worker is a pusher with a lease set, so workers come and go; sync, a
        step counts its replicas, and the manager tells the ps tasks who they are at
        each change (``manager/ps_membership.py``), so they follow it at a step
        boundary. Not sync with embedding tables or all-reduced dense layers: each
        table shard judges its own steps, and a membership it took a step later than
        ps 0 would refuse rows whose keys ps 0's reply acks; a collective group of
        dense replicas is formed once."""
        self._declared = True
        task = self._resolver.task
        if task is not None and task.job == "worker":
            link = ManagerLink.from_env()
            if link is not None:
                try:
                    resizable = self.config.mode == "async" or not self._sparse.active
                    link.declare(respawnable=True, resizable=resizable)
                finally:
                    link.close()

    # Strategy API ------------------------------------------------------------------

    @property
    def num_replicas_in_sync(self) -> int:
        c = self.config
        return c.replicas_per_step if c.mode == "sync" else c.num_replicas

    @property
    def is_chief(self) -> bool:
        return self._resolver.is_chief

    @property
    def worker_index(self) -> int:
        """This replica's index among the chief and the workers (chief first)."""
        spec, task = self._resolver.cluster_spec(), self._resolver.task
        if task is None:
            return 0
        order = [t for t in spec.tasks() if t.job in ("chief", "worker")]
        return order.index(task) if task in order else 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[ParameterServerStrategy]:
        """Variables created inside are placed on the ps tasks when the scope closes."""
        with recording() as recorder, intercepting() as tables:
            yield self
        self._create(self._sparse.create(recorder.items, tables))

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        completes: Sequence[SplitKey] = (),
    ) -> Any:
        """Pull, run ``fn`` (which calls ``optimizer.step()``), push.

        Args:
            fn: the step; it computes gradients and calls ``optimizer.step()``.
            args: positional arguments of ``fn`` (this replica's batch).
            kwargs: keyword arguments of ``fn``.
            completes: the keys of the data splits this batch completes
                (``Batch.keys``). Each ps task applies a key's update at most once; the
                keys come back from ``settled()`` as applied (async: the push's reply
                said so; sync: the step holding the push committed) or dropped (a late
                or backup replica's push, or a stale one: give them back).

        Raises:
            StrategyError: no variables were created in ``scope()``, or ``fn`` computed
                gradients but never called ``optimizer.step()``.
        """
        if not self._vars and not self._sparse.active:
            raise StrategyError("no variables: create the model inside strategy.scope() first")
        if not self._declared:
            self._declare()
        self._wait_warmup()
        if self._vars:
            self._load_values()
        self._in_run, self._pushed = True, False
        self._keys = tuple(completes)
        try:
            result = fn(*args, **(kwargs or {}))
        finally:
            self._in_run = False
        if not self._pushed and any(v.tensor.grad is not None for v in self._vars):
            raise StrategyError(
                "the step computed gradients but did not call optimizer.step(); under "
                "ParameterServerStrategy the update is applied on the ps when it is called"
            )
        if not self._pushed and self._keys:
            self._ledger.decide(self._keys, ())  # no gradients: nothing to apply or lose
        self.steps += 1
        return result

    def settled(self, *, wait: bool = False) -> Settled:
        """Keys given to ``run`` whose update was applied or dropped since the last call.

        Async: a push's keys are decided by its reply, which under ``overlap_push``
        arrives while the next step computes; nothing here waits for it unless ``wait``.
        Sync: a counted push's keys are applied once ps 0 reached the next version (the
        step committed); this replica's next ``run`` sees that, or ``wait`` waits for it.

        Raises:
            PSError, RpcError: with ``wait``, the push in flight or the pull failed.
        """
        if wait:
            self.flush()
            if self._ledger.waiting_for_steps and self._next is not None:
                self._load_values()  # the step's commit: ps 0 moved past it
            self._sparse.wait()
        else:
            self._collect_inflight(wait=False)
        self._ledger.reached(self._versions[0] if self._vars else self._sparse.reached())
        return self._ledger.take()

    def reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Each worker runs one replica: the reduction over this worker's replicas is the value."""
        parse_reduce_op(op)
        return value

    def distribute(
        self, dataset: Iterable[Any], global_batch_size: int | None = None
    ) -> Iterator[Any]:
        """This worker's share of ``dataset``.

        A ``clusterflow.data`` client is already this worker's share (the dispatcher
        lends each split to one worker): it passes through whole. Any other iterable is
        dealt out: every ``num_replicas``-th element, starting at this worker's index.
        """
        yield from deal_out(dataset, self.config.num_replicas, self.worker_index)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "versions": list(self._versions)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))

    # Extras ------------------------------------------------------------------------

    def global_step(self) -> int:
        """Steps applied so far: the version of ps 0."""
        return int(send(self._ps, 0, STATS)[0]["version"])

    def ps_stats(self) -> list[dict[str, Any]]:
        """Per ps task: version, pushes, applied, dropped_stale, dropped_late, ..."""
        return [send(self._ps, i, STATS)[0] for i in range(self._ps.num_ps)]

    def replicas(self) -> Replicas:
        sync, c = self.config.mode == "sync", self.config
        averaged = sync and c.backup_workers == 0  # else not a mean over the split
        return Replicas(self.worker_index, c.num_replicas, averaged, False, not sync)

    def check_placed(self, model: torch.nn.Module) -> None:
        outside = self.unplaced(model)
        if outside:
            more = ", ..." if len(outside) > 3 else ""
            raise StrategyError(
                f"the model's parameters ({', '.join(outside[:3])}{more}) were created "
                "outside strategy.scope(); build the model inside `with strategy.scope():`, "
                "so its variables live on the parameter servers"
            )

    def refresh_model(self) -> None:
        self.pull_values()  # a replica's model lags the ps by its last update

    def finish(self, error: BaseException | None, leave: bool) -> None:
        """Leaves the sync steps on error or when ``leave``; then pulls the final values."""
        try:
            if error is not None or leave:
                self.leave()
            if error is None:
                self.pull_values()
        except Exception as exc:
            if error is None:
                raise
            log.warning("could not leave the parameter servers after an error: %s", exc)

    def placed(self, module: torch.nn.Module) -> bool:
        """Whether every parameter of ``module`` lives on the ps tasks (made in ``scope()``)."""
        return any(True for _ in module.parameters()) and not self.unplaced(module)

    def unplaced(self, module: torch.nn.Module) -> list[str]:
        """Names of ``module``'s parameters that were made outside ``scope()``."""
        mine = self._by_tensor
        return [
            n for n, p in module.named_parameters() if not (id(p) in mine or self._sparse.owns(p))
        ]

    # For replicas built elsewhere: all that strategies/coordinator/ uses -------------

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The cluster, as TensorFlow's ``strategy.cluster_resolver``."""
        return self._resolver

    def replica_options(self) -> dict[str, Any]:
        """Keyword arguments that make another process's strategy push and pull as this one.

        Not the partitioner: the placement travels with ``variables()``.
        """
        return self.options.replica_options()

    def variables(self) -> list[tuple[torch.Tensor, VariableSpec, tuple[Shard, ...]]]:
        """Every variable tracked here, in creation order: (local tensor, spec, shards)."""
        return [(v.tensor, v.spec, v.shards) for v in self._vars]

    def adopt_variable(
        self, tensor: torch.Tensor, spec: VariableSpec, shards: tuple[Shard, ...]
    ) -> None:
        """Tracks ``tensor`` as the local copy of a variable another replica placed on the ps.

        Nothing is sent to the ps; ``run`` loads it and pushes its gradients from now on.
        """
        var = TrackedVar(tensor, spec, shards)
        self._vars.append(var)
        self._by_tensor[id(tensor)] = var

    def discard_staged_values(self) -> None:
        """The next ``run`` pulls the newest values, not those the last push brought back."""
        self._staged = None

    def pull_values(self) -> None:
        """Waits for this replica's last step, then pulls the ps's current values: others
        may have applied steps since (sync: the prefetch of the next version is as old as
        this replica's last step, so one that ran out of data first ended without them)."""
        self.flush()
        if self._next is not None:
            self._versions = self._next.result()[0]
            self._next = None
        self._staged = self._pull(self._versions)
        self._load_values()

    def leave(self) -> None:
        """This replica will push no more: sync steps stop waiting for it.

        Call it when the replica's data runs out (``close()`` does): replicas finish
        unevenly, and the others' last steps must not wait for this one.
        """
        self.flush()
        if not self._left:
            self._left = True
            send(self._ps, 0, LeaveRequest(worker=self._worker))
            self._sparse.leave()

    def close(self) -> None:
        """Leaves, removes the optimizer hook and closes the connections."""
        with contextlib.suppress(Exception):
            self.leave()
        self._hook.remove()
        self._prefetcher.shutdown(wait=False, cancel_futures=True)
        self._ps.close()

    # Creating variables -----------------------------------------------------------

    def _create(self, items: list[Recorded]) -> None:
        if not items:
            return
        specs = specs_of(items)
        self.placement = place(specs, self._ps.num_ps, self._partitioner)
        for item, spec in zip(items, specs, strict=True):
            var = TrackedVar(item.tensor, spec, self.placement.shards[spec.name])
            self._vars.append(var)
            self._by_tensor[id(item.tensor)] = var
        declare(self._ps, self.placement, self._vars, self.config)
        # Whoever created first, everyone now starts from the same values.
        self._staged = self._pull([0] * self._ps.num_ps)

    # Values ------------------------------------------------------------------------

    def _pull(self, min_versions: list[int]) -> Values:
        return pull_all(
            self._ps,
            min_versions,
            sync=self.config.mode == "sync",
            dtype=self._value_dtype,
            deadline=self._deadline,
        )

    def _load_values(self) -> None:
        """Copies the newest values that arrived into the local tensors.

        sync: waits for the next version's prefetch. async: takes the values a finished
        push brought back; while a push is still in flight it keeps the values at hand
        (bounded staleness), and with nothing staged or in flight it pulls.
        """
        if self._next is not None:
            ready = self._next.result()
            self._next = None
        else:
            self._collect_inflight(wait=False)
            if self._staged is not None:
                ready = self._staged
            elif self._inflight is not None:
                return
            else:
                ready = self._pull(self._versions)
        self._staged = None
        versions, values = ready
        self._versions = versions
        load_into(self._vars, values, self._staging)

    def _collect_inflight(self, *, wait: bool) -> None:
        """Takes the result of the push in flight, if done (or once done, with ``wait``)."""
        if self._inflight is None or not (wait or self._inflight.done()):
            return
        self._inflight.result()  # re-raises the push's error here, in the training loop
        self._inflight = None
        if self._bg_values is not None:
            self._staged, self._bg_values = self._bg_values, None

    def flush(self) -> None:
        """Waits until this replica's last push was answered (async overlap)."""
        self._collect_inflight(wait=True)

    def _wait_warmup(self) -> None:
        if not self._warm:
            wait_for_version(self._ps, self.config.warmup_steps, self._deadline)
            self._warm = True

    # Pushing -----------------------------------------------------------------------

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._in_run:
            return
        tracked = tracked_in(optimizer, self._by_tensor)
        # The hook is global: a local optimizer stepped in the same step, or another
        # thread's (an in-process ps applying this very push), is not this step's push.
        groups = optimizer.param_groups
        if not tracked and not any(self._sparse.owns(p) for g in groups for p in g["params"]):
            return
        rows = self._sparse.step(optimizer, [(k.dataset, k.epoch, k.split) for k in self._keys])
        if not tracked:
            if rows is not None:  # the rows decide the step's keys
                self._push_rows(rows)
            self._pushed = rows is not None
            return
        if id(optimizer) not in self._optimizers:
            register_optimizer(self._ps, optimizer, tracked)
            self._optimizers.add(id(optimizer))
        hyper = [hyperparameters(g) for g in optimizer.param_groups]
        per_ps = gradients(
            (var for _, var in tracked), self._ps.num_ps, self._grad_dtype, self._staging
        )
        held = buffers(self._vars if self.is_chief else (), self._ps.num_ps)
        self._push(per_ps, held, hyper, rows)
        for _, var in tracked:
            var.tensor.grad = None  # torch's own step then leaves the tensor alone
        self._pushed = True

    def _push_rows(self, rows: RowsPush) -> None:
        """A step of tables alone: the rows' replies decide its keys. Async with
        ``overlap_push``, the rows travel while the next step computes, as a dense push
        does (the next step's lookups read rows at most this push old)."""
        keys = self._keys

        def send() -> None:
            self._count(self._sparse.settle(self._ledger, keys, self._sparse.send(rows)))

        self._collect_inflight(wait=True)  # at most one push in flight
        if self._overlap:
            self._inflight = self._prefetcher.submit(send)
        else:
            send()

    def _push(
        self, grads: list[Tensors], held: list[Tensors], hyper: list[Any], rows: RowsPush | None
    ) -> None:
        sync = self.config.mode == "sync"
        # sync: one step version on every shard; if the pull was mixed, the push is late
        # at ps 0 (which decides), so it is never counted with gradients missing.
        step_version = min(self._versions)
        keys, wire_keys = self._keys, tuple((k.dataset, k.epoch, k.split) for k in self._keys)
        push = Push(self._worker, list(self._versions), grads, held, hyper, wire_keys)
        if sync:
            self._sparse.send(rows)  # a table step of its own; the dense reply decides
            replies = push.sync(self._ps, step_version, self._value_dtype, self._deadline)
            # ps 0 decides the step: a commit it counted is in the step on every shard.
            self._count(self._ledger.sync_reply(keys, replies[0], step_version))
            self.last_step = step_version if replies[0].applied else None
            targets = [step_version + 1] * self._ps.num_ps
            self._next = self._prefetcher.submit(self._pull, targets)
            return

        def push_all() -> None:
            row_replies = self._sparse.send(rows)
            replies = push.async_(self._ps, self._value_dtype, self._deadline)
            self._count(self._ledger.async_replies(keys, [*replies, *row_replies]))
            if all(r.values or not self.placement.on_ps(i) for i, r in enumerate(replies)):
                values: Tensors = {}
                for reply in replies:
                    values.update(reply.values)
                self._bg_values = ([r.version for r in replies], values)

        self._collect_inflight(wait=True)  # at most one push in flight
        if self._overlap:
            # The keys settle when the reply arrives (settled()), not here: acking after
            # the apply must not make the step wait for its push.
            self._inflight = self._prefetcher.submit(push_all)
        else:
            push_all()
            self._staged, self._bg_values = self._bg_values, None

    def _count(self, applied: bool) -> None:
        self.last_push_applied = applied
        if not applied:
            self.dropped_pushes += 1
