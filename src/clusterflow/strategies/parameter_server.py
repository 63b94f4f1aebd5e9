"""``ParameterServerStrategy`` (between-graph) and ``CentralStorageStrategy``.

Every worker runs the same script::

    strategy = ParameterServerStrategy(mode="sync")
    with strategy.scope():
        model = Net()                                  # variables go to the ps tasks
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()                               # applied on the ps
        optimizer.zero_grad()
        return loss

    for x, y in strategy.distribute(batches):
        strategy.run(step, args=(x, y))

``run`` pulls the current values into the model, runs the step, and when the step
calls ``optimizer.step()`` a global optimizer pre-hook pushes the gradients (one
message per ps task) and clears them, so torch's local step does nothing: the update
happens on the ps, with the optimizer's current hyper-parameters (a schedule's lr).
In async mode each push's reply carries the shard's fresh values, so the next step
needs no pull; in sync mode the pull of the next version starts right after the push,
in the background, and the next ``run`` waits for it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from clusterflow.data.api import SplitKey
from clusterflow.errors import ConfigError
from clusterflow.ps.api import (
    Mode,
    Placement,
    PSConfig,
    Shard,
    StalePolicy,
    VariableSpec,
    VersionTimeout,
    WireDtype,
)
from clusterflow.ps.client import LocalPS, PSConnection, RemotePS
from clusterflow.ps.optimizer import OptimizerSpec, hyperparameters
from clusterflow.ps.placement import Partitioner, place
from clusterflow.ps.protocol import PullRequest, PushReply, PushRequest
from clusterflow.server.manager_link import ManagerLink
from clusterflow.strategies.api import (
    ReduceOp,
    Settled,
    Strategy,
    StrategyError,
    parse_reduce_op,
)
from clusterflow.strategies.batches import is_data_client
from clusterflow.strategies.resolver import ClusterResolver, TFConfigClusterResolver
from clusterflow.strategies.variables import Recorded, recording

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Var:
    tensor: torch.Tensor
    spec: VariableSpec
    shards: tuple[Shard, ...]


class ParameterServerStrategy(Strategy):
    """Variables on ps tasks; workers pull values and push gradients.

    Args:
        cluster_resolver: the cluster; by default from ``TF_CONFIG``.
        mode: ``async`` (apply each push on arrival) or ``sync`` (average N replicas).
        backup_workers: sync only; a step takes the first N = replicas - k pushes.
        max_staleness: async only; pushes from values older than this are stale.
        stale_policy: ``drop`` stale pushes, or ``scale`` their lr by 1/staleness.
        staleness_aware_lr: async only; every push's lr is scaled by 1/staleness.
        warmup_steps: async only; the chief alone takes the first W global steps.
        variable_partitioner: splits large variables into shards across ps tasks.
        gradient_wire_dtype: ``bfloat16`` halves the bytes of every push.
        value_wire_dtype: ``bfloat16`` halves the bytes of every pull.
        reject_nonfinite: the ps refuses NaN/Inf gradients.
        overlap_push: async only; a push travels while the next step computes (at most
            one in flight; the step uses the newest values that have arrived). The keys
            a step completes settle when its push's reply arrives (``settled()``).
        deadline_s: every call to a ps must answer within this many seconds.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        *,
        mode: Mode = "async",
        backup_workers: int = 0,
        max_staleness: int | None = None,
        stale_policy: StalePolicy = "drop",
        staleness_aware_lr: bool = False,
        warmup_steps: int = 0,
        variable_partitioner: Partitioner | None = None,
        gradient_wire_dtype: WireDtype = "float32",
        value_wire_dtype: WireDtype = "float32",
        reject_nonfinite: bool = True,
        overlap_push: bool = True,
        deadline_s: float = 120.0,
        _connection: PSConnection | None = None,
    ) -> None:
        self._resolver = cluster_resolver or TFConfigClusterResolver()
        task = self._resolver.task
        self._worker = str(task) if task is not None else "local:0"
        replicas = self._resolver.num_workers()
        self.config = PSConfig(
            mode=mode,
            num_replicas=max(1, replicas),
            backup_workers=backup_workers,
            max_staleness=max_staleness,
            stale_policy=stale_policy,
            staleness_aware_lr=staleness_aware_lr,
            warmup_steps=warmup_steps,
            reject_nonfinite=reject_nonfinite,
        )
        for name, value in (("gradient", gradient_wire_dtype), ("value", value_wire_dtype)):
            if value not in ("float32", "bfloat16"):
                raise ConfigError(f"{name}_wire_dtype must be float32 or bfloat16, got {value!r}")
        self._grad_dtype = gradient_wire_dtype
        self._value_dtype = value_wire_dtype
        self._partitioner = variable_partitioner
        self._deadline = deadline_s
        self._ps: PSConnection = _connection or RemotePS(
            self._resolver.cluster_spec(), self._resolver.require_credentials(), deadline=deadline_s
        )
        self._vars: list[_Var] = []
        self._by_tensor: dict[int, _Var] = {}
        self.placement = Placement()
        self._versions = [0] * self._ps.num_ps
        self._overlap = overlap_push and mode == "async"
        # sync: the background pull of the next version.
        self._next: Future[tuple[list[int], dict[str, torch.Tensor]]] | None = None
        # async: the push in flight; its thread writes only _bg_values, which the
        # main thread reads after collecting the future.
        self._inflight: Future[None] | None = None
        self._bg_values: tuple[list[int], dict[str, torch.Tensor]] | None = None
        # Values that arrived and wait to be copied into the model (main thread only).
        self._staged: tuple[list[int], dict[str, torch.Tensor]] | None = None
        self._optimizers: set[int] = set()
        self._in_run = False
        self._pushed = False
        self._warm = self.config.warmup_steps == 0 or self.is_chief
        self.steps = 0
        self.dropped_pushes = 0
        self.last_push_applied = False
        """Whether the last answered push was applied on every ps task."""
        self._keys: tuple[SplitKey, ...] = ()
        # Decided keys, written by the push thread too: (applied, dropped) batches.
        self._decided: list[tuple[tuple[SplitKey, ...], tuple[SplitKey, ...]]] = []
        self._decided_lock = threading.Lock()
        # sync: keys counted into step v, settled once ps 0 reached v + 1.
        self._in_step: list[tuple[int, tuple[SplitKey, ...]]] = []
        self._left = False
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="ps-prefetch")
        self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)
        if task is not None and task.job == "worker" and _connection is None:
            # A worker holds nothing the others need: the manager may relaunch it alone
            # (its leases go back to the queue; each ps applies a lease at most once).
            link = ManagerLink.from_env()
            if link is not None:
                link.declare(respawnable=True)
                link.close()

    # Strategy API ------------------------------------------------------------------

    @property
    def num_replicas_in_sync(self) -> int:
        return (
            self.config.replicas_per_step
            if self.config.mode == "sync"
            else self.config.num_replicas
        )

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
        with recording() as recorder:
            yield self
        self._create(recorder.items)

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
        if not self._vars:
            raise StrategyError("no variables: create the model inside strategy.scope() first")
        self._wait_warmup()
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
            self._decide(self._keys, ())  # no gradients: nothing to apply, nothing to lose
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
            if self._in_step and self._next is not None:
                self._load_values()  # the step's commit: ps 0 moved past it
        else:
            self._collect_inflight(wait=False)
        self._settle_steps()
        with self._decided_lock:
            decided, self._decided = self._decided, []
        applied = tuple(k for a, _ in decided for k in a)
        dropped = tuple(k for _, d in decided for k in d)
        return Settled(applied=applied, dropped=dropped)

    def _decide(self, applied: Sequence[SplitKey], dropped: Sequence[SplitKey]) -> None:
        if applied or dropped:
            with self._decided_lock:
                self._decided.append((tuple(applied), tuple(dropped)))

    def _settle_steps(self) -> None:
        """sync: the keys of every step ps 0 has moved past are applied."""
        if not self._in_step:
            return
        reached = self._versions[0]
        done = [keys for version, keys in self._in_step if version < reached]
        self._in_step = [(v, k) for v, k in self._in_step if v >= reached]
        for keys in done:
            self._decide(keys, ())

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
        if is_data_client(dataset):
            yield from dataset
            return
        count, index = self.config.num_replicas, self.worker_index
        for i, element in enumerate(dataset):
            if i % count == index:
                yield element

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "versions": list(self._versions)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))

    # Extras ------------------------------------------------------------------------

    def global_step(self) -> int:
        """Steps applied so far: the version of ps 0."""
        body, _ = self._ps.call(0, "stats")
        return int(body["version"])

    def ps_stats(self) -> list[dict[str, Any]]:
        """Per ps task: version, pushes, applied, dropped_stale, dropped_late, ..."""
        return [self._ps.call(i, "stats")[0] for i in range(self._ps.num_ps)]

    def placed(self, module: torch.nn.Module) -> bool:
        """Whether every parameter of ``module`` lives on the ps tasks (made in ``scope()``)."""
        return any(True for _ in module.parameters()) and not self.unplaced(module)

    def unplaced(self, module: torch.nn.Module) -> list[str]:
        """Names of ``module``'s parameters that were made outside ``scope()``."""
        return [name for name, p in module.named_parameters() if id(p) not in self._by_tensor]

    # For replicas built elsewhere: all that strategies/coordinator/ uses -------------

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The cluster, as TensorFlow's ``strategy.cluster_resolver``."""
        return self._resolver

    def replica_options(self) -> dict[str, Any]:
        """Keyword arguments that make another process's strategy push and pull as this one.

        Not the partitioner: the placement travels with ``variables()``.
        """
        c = self.config
        return {
            "mode": c.mode,
            "max_staleness": c.max_staleness,
            "stale_policy": c.stale_policy,
            "staleness_aware_lr": c.staleness_aware_lr,
            "reject_nonfinite": c.reject_nonfinite,
            "gradient_wire_dtype": self._grad_dtype,
            "value_wire_dtype": self._value_dtype,
            "deadline_s": self._deadline,
        }

    def variables(self) -> list[tuple[torch.Tensor, VariableSpec, tuple[Shard, ...]]]:
        """Every variable tracked here, in creation order: (local tensor, spec, shards)."""
        return [(v.tensor, v.spec, v.shards) for v in self._vars]

    def adopt_variable(
        self, tensor: torch.Tensor, spec: VariableSpec, shards: tuple[Shard, ...]
    ) -> None:
        """Tracks ``tensor`` as the local copy of a variable another replica placed on the ps.

        Nothing is sent to the ps; ``run`` loads it and pushes its gradients from now on.
        """
        var = _Var(tensor, spec, shards)
        self._vars.append(var)
        self._by_tensor[id(tensor)] = var

    def discard_staged_values(self) -> None:
        """The next ``run`` pulls the newest values, not those the last push brought back."""
        self._staged = None

    # Checkpoints (the consistent cut; see clusterflow.strategies.checkpointer) ---------

    @property
    def num_ps(self) -> int:
        return self._ps.num_ps

    def quiesce(self, timeout: float = 60.0) -> list[int]:
        """Holds every ps task's updates (pushes wait, none in flight); their versions.

        ps 0 first: it decides sync steps and fans each out to the other shards, and its
        quiesce waits for that fan-out, so once it holds no shard can still move. The
        calls go one by one on the control connections, never through the pool: in sync
        mode the pool's threads may be waiting in a prefetch for a step that cannot
        finish until this checkpoint lets the held pushes through.
        """
        self.flush()
        return [
            int(self._ps.call(i, "quiesce", {"timeout": timeout})[0]["version"])
            for i in range(self._ps.num_ps)
        ]

    def resume(self) -> None:
        """Lets held updates through again (after :meth:`quiesce`)."""
        for index in range(self._ps.num_ps):
            self._ps.call(index, "resume")

    def ps_states(self) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        """Every ps task's full state (variables, slots, version, applied leases)."""
        return [self._ps.call(i, "state") for i in range(self._ps.num_ps)]

    def load_ps_states(self, states: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
        """Replaces every ps task's state; then this worker pulls the loaded values."""
        if len(states) != self._ps.num_ps:
            raise StrategyError(
                f"a state of {len(states)} ps task(s) cannot load into {self._ps.num_ps}"
            )
        self._ps.map(
            lambda i: self._ps.call(i, "load_state", dict(states[i][0]), dict(states[i][1])),
            range(self._ps.num_ps),
        )
        self._versions = [int(meta["version"]) for meta, _ in states]
        self._next = None
        self._staged = self._pull(self._versions)
        self._load_values()

    def pull_values(self) -> None:
        """Copies the newest values from the ps into the local model (before evaluating).

        Waits for the step this replica pushed last, if it is not applied yet.
        """
        self.flush()
        if self._next is None:  # sync: the prefetch already waits for the newest version
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
            self._ps.call(0, "leave", {"worker": self._worker})

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
        specs = [
            VariableSpec(
                name=item.name,
                shape=tuple(item.tensor.shape),
                dtype=str(item.tensor.dtype).removeprefix("torch."),
                trainable=item.trainable,
                device=item.device,
            )
            for item in items
        ]
        self.placement = place(specs, self._ps.num_ps, self._partitioner)
        for item, spec in zip(items, specs, strict=True):
            var = _Var(item.tensor, spec, self.placement.shards[spec.name])
            self._vars.append(var)
            self._by_tensor[id(item.tensor)] = var

        def create(index: int) -> None:
            shards = self.placement.on_ps(index)
            if not shards:
                return
            decl = [
                {
                    "name": s.name,
                    "shape": list(s.shape),
                    "dtype": self._spec_of(s).dtype,
                    "trainable": self._spec_of(s).trainable,
                }
                for s in shards
            ]
            values = {s.name: self._slice(self._var_of(s).tensor.detach(), s) for s in shards}
            self._ps.call(index, "create", {"config": self.config.to_dict(), "vars": decl}, values)

        self._ps.map(create, range(self._ps.num_ps))
        # Whoever created first, everyone now starts from the same values.
        self._staged = self._pull([0] * self._ps.num_ps)

    def _spec_of(self, shard: Shard) -> VariableSpec:
        return self._var_of(shard).spec

    def _var_of(self, shard: Shard) -> _Var:
        return next(v for v in self._vars if v.spec.name == shard.variable)

    @staticmethod
    def _slice(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
        return tensor if shard.whole else tensor[shard.start : shard.stop]

    # Values ------------------------------------------------------------------------

    def _pull(self, min_versions: list[int]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Pulls every shard; in sync mode, all at one version.

        ps 0 applies a step before it fans the step out, so a pull in between sees ps 0
        one version ahead of the others. Gradients from such mixed values must not join
        a step: lagging shards are pulled again up to the newest version seen (they
        reach it as soon as the fan-out lands, since no shard runs ahead of ps 0).
        """

        def pull(index: int, min_version: int) -> tuple[int, dict[str, torch.Tensor]]:
            request = PullRequest(
                min_version=min_version, dtype=self._value_dtype, timeout=self._deadline
            )
            reply = self._ps.pull(index, request)
            return reply.version, reply.values

        results = self._ps.map(lambda i: pull(i, min_versions[i]), range(self._ps.num_ps))
        if self.config.mode == "sync":
            newest = max(r[0] for r in results)
            for _ in range(3):
                lagging = [i for i, r in enumerate(results) if r[0] < newest]
                if not lagging:
                    break
                repulled = self._ps.map(functools.partial(_pull_at, pull, newest), lagging)
                for i, again in zip(lagging, repulled, strict=True):
                    results[i] = again
                newest = max(r[0] for r in results)
        values: dict[str, torch.Tensor] = {}
        for _, tensors in results:
            values.update(tensors)
        return [r[0] for r in results], values

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
        with torch.no_grad():
            for var in self._vars:
                parts = [values[s.name] for s in var.shards]
                value = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
                var.tensor.copy_(value)

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
        """Waits, in rounds shorter than the call deadline, for the chief's warm-up steps.

        Each round is bounded on both sides (the ps gives up waiting before the client
        does), so a dead ps fails the worker within one deadline, while a long warm-up
        just takes more rounds.
        """
        if self._warm:
            return
        from clusterflow.rpc import RemoteError

        body = {"version": self.config.warmup_steps, "timeout": self._deadline / 2}
        while True:
            try:
                self._ps.call(0, "wait_version", body)
                break
            except VersionTimeout:
                continue  # in process (CentralStorage): a round that ran out
            except RemoteError as exc:
                if exc.error_type != VersionTimeout.__name__:  # a real error, not a round
                    raise
        self._warm = True

    # Pushing -----------------------------------------------------------------------

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._in_run:
            return
        tracked = [
            (g, self._by_tensor[id(p)])
            for g, group in enumerate(optimizer.param_groups)
            for p in group["params"]
            if id(p) in self._by_tensor
        ]
        if not tracked:
            return
        if id(optimizer) not in self._optimizers:
            self._register_optimizer(optimizer, tracked)
        hyper = [hyperparameters(g) for g in optimizer.param_groups]
        per_ps: list[dict[str, torch.Tensor]] = [{} for _ in range(self._ps.num_ps)]
        for _, var in tracked:
            grad = var.tensor.grad
            if grad is None or not var.spec.trainable:
                continue
            grad = grad.detach()
            if self._grad_dtype == "bfloat16" and grad.is_floating_point():
                grad = grad.to(torch.bfloat16)
            for shard in var.shards:
                per_ps[shard.ps][shard.name] = self._slice(grad, shard)
        buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(self._ps.num_ps)]
        if self.is_chief:
            for var in self._vars:
                if not var.spec.trainable:
                    for shard in var.shards:
                        # A copy: the next forward updates buffers in place while a
                        # background push may still be sending them.
                        value = self._slice(var.tensor.detach(), shard).clone()
                        buffers[shard.ps][shard.name] = value
        self._push(per_ps, buffers, hyper)
        for _, var in tracked:
            var.tensor.grad = None  # torch's own step then leaves the tensor alone
        self._pushed = True

    def _register_optimizer(
        self, optimizer: torch.optim.Optimizer, tracked: list[tuple[int, _Var]]
    ) -> None:
        spec = OptimizerSpec.of(optimizer)
        group_of = {shard.name: g for g, var in tracked for shard in var.shards}
        self._ps.map(
            lambda i: self._ps.call(i, "optimizer", {"spec": spec.to_dict(), "group_of": group_of}),
            range(self._ps.num_ps),
        )
        self._optimizers.add(id(optimizer))

    def _push(
        self,
        per_ps: list[dict[str, torch.Tensor]],
        buffers: list[dict[str, torch.Tensor]],
        hyper: list[dict[str, Any]],
    ) -> None:
        sync = self.config.mode == "sync"
        # sync: one step version on every shard; if the pull was mixed, the push is late
        # at ps 0 (which decides), so it is never counted with gradients missing.
        step_version = min(self._versions)
        versions, keys = list(self._versions), self._keys
        wire_keys = tuple((k.dataset, k.epoch, k.split) for k in keys)

        def push(index: int, commit: bool = False) -> PushReply:
            request = PushRequest(
                worker=self._worker,
                version=step_version if sync else versions[index],
                grads=per_ps[index],
                buffers=buffers[index],
                hyper=hyper,
                commit=commit,
                keys=wire_keys,
                want_values=not sync,
                values_dtype=self._value_dtype,
                timeout=self._deadline,
            )
            return self._ps.push(index, request)

        if sync:
            others = [i for i in range(self._ps.num_ps) if i != 0]
            replies = self._ps.map(push, others)
            replies.insert(0, push(0, commit=True))
            # ps 0 decides the step: a commit it counted is in the step on every shard.
            decision = replies[0]
            self._settle_sync(keys, decision, step_version)
            targets = [step_version + 1] * self._ps.num_ps
            self._next = self._prefetcher.submit(self._pull, targets)
            return

        def push_all() -> None:
            replies = self._ps.map(push, range(self._ps.num_ps))
            self._settle_async(keys, replies)
            if all(r.values or not self.placement.on_ps(i) for i, r in enumerate(replies)):
                values: dict[str, torch.Tensor] = {}
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

    def _settle_async(self, keys: tuple[SplitKey, ...], replies: list[PushReply]) -> None:
        """A key is applied once every shard applied it, now or before (a duplicate)."""
        self.last_push_applied = all(r.applied for r in replies)
        if not self.last_push_applied:
            self.dropped_pushes += 1
        if not keys:
            return
        done = [set(keys) if r.applied else {SplitKey(*d) for d in r.duplicates} for r in replies]
        applied = [k for k in keys if all(k in d for d in done)]
        self._decide(applied, [k for k in keys if k not in applied])

    def _settle_sync(
        self, keys: tuple[SplitKey, ...], decision: PushReply, step_version: int
    ) -> None:
        """ps 0's reply: counted in step ``step_version``, a duplicate, or late."""
        duplicates = {SplitKey(*d) for d in decision.duplicates}
        counted = decision.applied and not duplicates
        self.last_push_applied = counted
        if not counted:
            self.dropped_pushes += 1
        if not keys:
            return
        if counted:
            self._in_step.append((step_version, keys))
            return
        # Duplicates were applied in an earlier step; with them the push added nothing,
        # so the rest of its keys go back, as a late push's keys do.
        self._decide([k for k in keys if k in duplicates], [k for k in keys if k not in duplicates])


def _pull_at(pull: Callable[[int, int], Any], version: int, index: int) -> Any:
    return pull(index, version)


class CentralStorageStrategy(ParameterServerStrategy):
    """One local ps holding the variables, synchronous updates (TensorFlow's name).

    The variables and the optimizer's slots live in an in-process store rather than in
    the module itself, exactly as on a ps task; nothing crosses a socket.
    """

    def __init__(self, *, reject_nonfinite: bool = True) -> None:
        from clusterflow.strategies.resolver import SimpleClusterResolver

        super().__init__(
            SimpleClusterResolver({"chief": ["127.0.0.1:1"]}, task_type="chief", task_id=0),
            mode="sync",
            reject_nonfinite=reject_nonfinite,
            _connection=LocalPS(),
        )
