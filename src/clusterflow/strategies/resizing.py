"""All-reduce that resizes live: the step boundary of ``CollectiveAllReduceStrategy``
in an elastic cluster (``--workers MIN:MAX``, ``clusterflow scale``; issue 32).

torchft's quorum-per-step is the model; the manager is the quorum's source of truth:

- **Who should be in.** Rank 0 watches the manager's spec on a daemon thread
  (``SpecWatcher``, one ``manager.spec`` call every ``SPEC_POLL_S``): a task that
  registered since is a newcomer, admitted once its process is up and waits to join
  (its ``ready`` key: one store call per boundary while one is starting). A worker
  that ``clusterflow scale`` stops gets SIGTERM; while it trains, that only marks it
  as leaving (:meth:`_on_term`).
- **When.** At every step boundary (``fit`` and ``TrainingSession`` call
  ``boundary``) the replicas run one all-reduce of ``[has a batch, waits for splits,
  rows, grow, leaving_0 .. leaving_n-1]``. Every replica gets the same sums, so all of
  them take the same decision at the same step: re-form; step while anyone has a batch
  (one without takes part at a loss scale of 0); wait while anyone waits for splits
  still out (a leaver's come back); end once every replica's data ended. The
  same vote gives each replica its loss scale ``rows * world / total_rows``, so an
  uneven split (shares of a global batch that does not divide, a partial batch)
  still averages to the global batch's mean.
- **How.** Rank 0 publishes the next :class:`~clusterflow.collective.elastic.Generation`
  in the store (survivors in their order, then the newcomers). The leavers give
  their leases back and end as SIGTERM would have ended them. The survivors drop
  their DDP wrappers and their process group and form generation ``n + 1`` under its
  own store prefix, keeping their process, model and optimizer; wrapping the modules
  again broadcasts rank 0's parameters and buffers (DDP), and when there are
  newcomers rank 0 broadcasts the optimizer's state and the step, which a newcomer
  receives when its session begins (``begin_session``), not from a checkpoint.
- **Batch policy.** ``elastic_batch="global"`` (the default) keeps the global batch:
  each replica's data-service batch becomes its share of it (``share_of``).
  ``"per_replica"`` keeps each replica's batch and scales every learning rate
  linearly with the world size (``lr = base_lr * world / base_world``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal

import torch
import torch.distributed as dist

from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import ENV_TASK, Torchrun
from clusterflow.collective import CommunicationOptions, Membership
from clusterflow.collective.elastic import (
    Generation,
    SpecWatcher,
    generation_name,
    joining_generation,
    mark_started,
    next_tasks,
    publish,
    read_generation,
    ready,
    share_of,
)
from clusterflow.collective.group import CollectiveGroup, connect_store
from clusterflow.collective.membership import REPLICA_JOBS
from clusterflow.strategies.api import StrategyError

if TYPE_CHECKING:
    from torch import nn
    from torch._C._distributed_c10d import Store, TCPStore

    from clusterflow.collective.bucket_worker import BucketWorker
    from clusterflow.server.manager_link import ManagerLink

__all__ = ["ElasticBatch", "Resizing", "join_if_added"]

_log = logging.getLogger(__name__)

ElasticBatch = Literal["global", "per_replica"]
ELASTIC_BATCHES: Final = ("global", "per_replica")
SPEC_POLL_S: Final = 0.5
"""How often rank 0 asks the manager for its spec: a newcomer waits at most this long
(plus one step) before the group takes it in."""
_TRUE: Final = ("1", "true", "yes")

# The vote's slots (one float64 tensor, summed over the replicas)
_GO, _WAITING, _ROWS, _GROW, _LEAVING = 0, 1, 2, 3, 4


def check_elastic_batch(value: object) -> ElasticBatch:
    if value not in ELASTIC_BATCHES:
        raise StrategyError(
            f"elastic_batch must be 'global' (keep the global batch) or 'per_replica' "
            f"(keep each replica's batch, scale the learning rate), got {value!r}"
        )
    return value  # type: ignore[return-value]


def join_if_added(
    environ: Mapping[str, str], task: TaskId | None, options: CommunicationOptions
) -> tuple[Membership | None, TCPStore | None, Generation | None]:
    """For a replica of a cluster launched by ``clusterflow start``: whether it was added
    to a running group (``clusterflow scale``), and if so the membership it joins.

    Returns ``(membership, store, generation)`` for a newcomer; ``(None, store, None)``
    for a replica of the first group (the store connection is reused for it); and
    ``(None, None, None)`` outside such a cluster (no manager's store to meet in).
    """
    master_addr, port = environ.get(Torchrun.MASTER_ADDR), environ.get(Torchrun.MASTER_PORT)
    managed = environ.get(ENV_TASK) and environ.get(Torchrun.USE_AGENT_STORE, "").lower() in _TRUE
    if not managed or task is None or task.job not in REPLICA_JOBS or not master_addr or not port:
        return None, None, None
    timeout = options.rendezvous_timeout_seconds
    probe = Membership(rank=0, world_size=1, master_addr=master_addr, master_port=int(port))
    store = connect_store(probe, timeout)
    generation = joining_generation(store, str(task), timeout)
    if generation is None:
        return None, store, None
    _log.info("%s joins the running group at generation %d", task, generation.number)
    return _membership(generation, str(task), master_addr, int(port)), store, generation


def _membership(
    generation: Generation, task: str, addr: str | None, port: int | None
) -> Membership:
    rank, world = generation.rank_of(task), len(generation.tasks)
    return Membership(
        rank=rank,
        world_size=world,
        # one host: a local cluster (the only one `scale` resizes for now)
        local_rank=rank,
        local_world_size=world,
        master_addr=addr,
        master_port=port,
        store_host=None,
        tasks=tuple(TaskId.parse(t) for t in generation.tasks),
        generation=generation_name(generation.number),
    )


class Resizing:
    """The resizing side of ``CollectiveAllReduceStrategy`` (mixed in)."""

    _group: CollectiveGroup
    _options: CommunicationOptions
    _device: torch.device
    _bucket_workers: list[BucketWorker]

    if TYPE_CHECKING:

        def _modules(self) -> list[nn.Module]: ...

        def _wrap(self, module: nn.Module) -> None: ...

        def _unwrap_all(self) -> list[nn.Module]: ...

        def shutdown(self) -> None: ...

    def _init_resizing(self, joined: Generation | None, elastic_batch: ElasticBatch) -> None:
        self._joined = joined
        """A newcomer's generation, until its session begins and receives the state."""
        self._elastic = False
        self._elastic_batch = elastic_batch
        self._generation = joined.number if joined else 0
        self._global_batch = joined.global_batch if joined else 0
        self._base_world = joined.base_world if joined else 0
        self._base_lrs: list[float] = []
        self._watcher: SpecWatcher | None = None
        self._departed: set[str] = set()
        """Rank 0: tasks that left, until a spec without them shows the manager let
        them go (until then the spec still lists them: they are no newcomers)."""
        self._leaving = False
        self._previous_term: Any = None
        store = self._group.store
        if joined is None and self._group.rank == 0 and store is not None:
            mark_started(store)  # whoever connects from now on was added later

    # The session's side ----------------------------------------------------------------

    @property
    def resizes(self) -> bool:
        """Whether this run resizes live (an elastic cluster, through fit/TrainingSession)."""
        return self._elastic

    def begin_session(self, session: Any, *, resizable: bool) -> None:
        """When a ``TrainingSession`` opens: declares to the manager that the workers
        resize live (``resizable``: the loop supports it), and learns (agreed across the
        replicas) whether the cluster is elastic. A newcomer receives the model's
        optimizer state and the step here instead."""
        if self._joined is not None:
            self._receive_state(session)
            self._joined = None
            self._elastic = True
            self._start_watching()
            self._apply_batch_policy(session)
            return
        elastic = self._declare(resizable)
        if self._group.world_size > 1:
            flag = torch.tensor([1 if elastic else 0], dtype=torch.int32)
            elastic = bool(self._group.broadcast_(flag, 0).item())
        if not elastic:
            return
        if self._group.store is None or self._group.membership.tasks is None:
            _log.warning("this group was not formed by clusterflow: it will not resize live")
            return
        self._elastic = True
        self._base_world = self._group.world_size
        self._global_batch = _batch_size(session.data) * self._base_world
        optimizer = session.optimizer
        self._base_lrs = (
            [float(g["lr"]) for g in optimizer.param_groups] if optimizer is not None else []
        )
        self._start_watching()

    def _declare(self, resizable: bool) -> bool:
        from clusterflow.server.manager_link import ManagerLink

        link = ManagerLink.from_env()
        if link is None:
            return False
        try:
            reply = link.declare(respawnable=False, resizable=resizable)
        finally:
            link.close()
        return bool(resizable and reply is not None and reply.elastic)

    def _start_watching(self) -> None:
        if self._group.rank == 0 and self._watcher is None:
            from clusterflow.server.manager_link import ManagerLink

            link = ManagerLink.from_env()
            if link is not None:
                self._watcher = SpecWatcher(lambda: _spec_body(link), SPEC_POLL_S).start()
        if threading.current_thread() is threading.main_thread() and self._previous_term is None:
            self._previous_term = signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: Any) -> None:
        """SIGTERM while training: ``clusterflow scale`` takes this worker out. It leaves
        at the next step boundary, when the others know, rather than mid-collective."""
        self._leaving = True
        _log.info("asked to leave: leaving the group at the next step boundary")

    def end_resizing(self, *, deliver: bool = True) -> None:
        """The run ended: stop watching, give SIGTERM its handler back; one that came
        meanwhile ends the process now (``deliver``), as it would have at once."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._previous_term is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None
            if self._leaving and deliver:
                os.kill(os.getpid(), signal.SIGTERM)

    # The boundary ------------------------------------------------------------------------

    def boundary(
        self, session: Any, go: bool | None, rows: int | None
    ) -> tuple[bool, bool, float] | None:
        """The step boundary: ``(step, end, this replica's loss scale)``; None when this
        run does not resize (the caller then votes as before). ``go``: this replica has
        a batch (True), its data ended (False), it waits for splits still out (None).
        There is a step while any replica has a batch (one without takes part at a loss
        scale of 0: ``fit`` does so); the end once none has one and none waits.

        Re-forms the group first when a replica leaves or a newcomer waits, and votes
        again in the new group (the newcomers' first vote). A leaving replica does not
        return: it ends its process as SIGTERM would have.
        """
        if not self._elastic:
            return None
        while True:
            world = self._group.world_size
            vote = torch.zeros(_LEAVING + 2 * world, dtype=torch.float64)
            vote[_GO] = 1.0 if go else 0.0
            vote[_WAITING] = 1.0 if go is None else 0.0
            vote[_ROWS] = float(rows or 0)
            vote[_GROW] = 1.0 if self._group.rank == 0 and self._newcomers() else 0.0
            # Not while a split is half trained: given back whole, its trained records
            # would be trained again. The next batch takes all it holds instead (no new
            # split), so it leaves one or two steps later, inside the stop's grace.
            leaves = self._leaving and not getattr(session, "holds_partial_splits", False)
            if self._leaving and not leaves:
                _drain(session.data)
            vote[_LEAVING + self._group.rank] = 1.0 if leaves else 0.0
            has_sample = getattr(session, "sit_in_sample", None) is not None
            vote[_LEAVING + world + self._group.rank] = 1.0 if has_sample else 0.0
            self._group.all_reduce_(vote, "sum")
            leaving = [r for r in range(world) if vote[_LEAVING + r] > 0]
            if vote[_GROW] == 0 and not leaving:
                total = float(vote[_ROWS])
                scale = rows * world / total if rows and total > 0 else 1.0
                step = bool(vote[_GO] > 0)
                if step:
                    holders = [r for r in range(world) if vote[_LEAVING + world + r] > 0]
                    if len(holders) < world:  # a step one replica could not take part in
                        self._share_sample(session, holders[0])
                return step, bool(not step and vote[_WAITING] == 0), scale
            self._resize(session, leaving)

    def _share_sample(self, session: Any, source: int) -> None:
        """Sends rank ``source``'s sit-in batch to the replicas that have none.

        A replica with no batch of its own takes part in its peers' steps with a batch
        at a loss scale of 0 (its backward pass joins the gradient all-reduce). One that
        never read a batch (a newcomer that joined once every split was lent out, whose
        data client waits for splits still out) has none to do it with; without this its
        step would fail and, with it, its peers'. Every replica decides from the same
        vote, so they all take part in this broadcast. (``source``: a replica with a
        batch now has one, and a step means one has.)
        """
        mine = getattr(session, "sit_in_sample", None)
        box = [_to_cpu(mine) if self._group.rank == source else None]
        with self._group.guard("sending a batch to sit in with to a replica without one"):
            dist.broadcast_object_list(box, src=source)
        if mine is None:
            session.sit_in_sample = _to_device(box[0], self._device)
            _log.info("received a batch from rank %d to take part in steps with", source)

    def _newcomers(self) -> tuple[str, ...]:
        latest = self._watcher.latest() if self._watcher is not None else None
        if latest is None:
            return ()
        replicas = latest[1]
        self._departed.intersection_update(replicas)
        current = {str(t) for t in self._group.membership.tasks or ()}
        waiting = [t for t in replicas if t not in current and t not in self._departed]
        # only those whose process is up: the others train on meanwhile
        store = self._group.store
        return ready(store, waiting) if waiting and store is not None else ()

    def _resize(self, session: Any, leaving: list[int]) -> None:
        membership = self._group.membership
        current = [str(t) for t in membership.tasks or ()]
        number = self._generation + 1
        store = self._group.store
        assert store is not None
        if membership.rank == 0:
            latest = self._watcher.latest() if self._watcher is not None else None
            version = latest[0] if latest is not None else 0
            joining = self._newcomers()
            leavers = [current[r] for r in leaving]
            self._departed.update(leavers)
            tasks, newcomers = next_tasks(current, leavers, (*current, *joining))
            publish(
                store,
                Generation(
                    number=number,
                    tasks=tasks,
                    newcomers=newcomers,
                    spec_version=version,
                    step=session.step,
                    global_batch=self._global_batch,
                    base_world=self._base_world,
                ),
            )
        generation = read_generation(store, number, self._options.rendezvous_timeout_seconds)
        me = current[membership.rank]
        _log.info(
            "step %d: generation %d of %d replicas (%s)%s",
            generation.step,
            number,
            len(generation.tasks),
            ", ".join(generation.tasks),
            f", newcomers {', '.join(generation.newcomers)}" if generation.newcomers else "",
        )
        if me not in generation.tasks:
            self._leave(session)
        self._reform(generation, me, store)
        self._generation = number
        if generation.newcomers:
            self._send_state(session)
        self._apply_batch_policy(session)
        if self._group.rank == 0:
            self._start_watching()

    def _reform(self, generation: Generation, me: str, store: Store) -> None:
        """Leaves the old group and forms ``generation``'s, keeping the process, the
        modules (wrapped again: DDP broadcasts rank 0's parameters) and the optimizer."""
        old = self._group.membership
        modules = self._unwrap_all()
        self._group.shutdown()
        self._group = CollectiveGroup.form(
            _membership(generation, me, old.master_addr, old.master_port),
            self._options,
            self._device,
            store=store,
        )
        for module in modules:
            self._wrap(module)

    def _leave(self, session: Any) -> None:
        """This replica is out of the next generation: its leases go back at once (its
        data client closes), then it ends as SIGTERM would have ended it."""
        _log.info("leaving the group at step %d", session.step)
        self.end_resizing(deliver=False)
        self.shutdown()
        data = session.data
        if data is not None and hasattr(data, "close"):
            with contextlib.suppress(Exception):
                data.close()
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM)  # only if SIGTERM is ignored

    # The state a newcomer receives ---------------------------------------------------

    def _send_state(self, session: Any) -> None:
        optimizer = session.optimizer
        payload = {
            "step": session.step,
            "modules": [_to_cpu(m.state_dict()) for m in self._modules()],
            "optimizer": _to_cpu(optimizer.state_dict()) if optimizer is not None else None,
            "base_lrs": self._base_lrs,
        }
        self._broadcast_object(payload)

    def _receive_state(self, session: Any) -> None:
        payload = self._broadcast_object(None)
        # Wrapping the modules broadcast rank 0's parameters already; a restoring hook
        # (Checkpoint) may have loaded an older checkpoint over them since.
        for module, state in zip(self._modules(), payload["modules"], strict=True):
            module.load_state_dict(state)
        optimizer = session.optimizer
        if optimizer is not None and payload.get("optimizer") is not None:
            optimizer.load_state_dict(payload["optimizer"])
        self._base_lrs = list(payload.get("base_lrs") or [])
        session.restored(int(payload["step"]))
        _log.info("received the optimizer state and step %d from rank 0", payload["step"])

    def _broadcast_object(self, payload: Any) -> Any:
        box = [payload]
        if self._group.world_size > 1:
            with self._group.guard("broadcasting the optimizer state to the newcomers"):
                dist.broadcast_object_list(box, src=0)
        return box[0]

    def _apply_batch_policy(self, session: Any) -> None:
        world, rank = self._group.world_size, self._group.rank
        if self._elastic_batch == "global":
            data = session.data
            if self._global_batch and data is not None and hasattr(data, "set_batch_size"):
                data.set_batch_size(max(1, share_of(self._global_batch, world, rank)))
            return
        optimizer = session.optimizer
        if optimizer is None or not self._base_world:
            return
        for group, base in zip(optimizer.param_groups, self._base_lrs, strict=False):
            group["lr"] = base * world / self._base_world


def _spec_body(link: ManagerLink) -> dict[str, Any] | None:
    """The manager's newest spec in the wire form ``SpecWatcher`` reads: the watcher is
    the collective layer's, below the link, and takes no type of the server side."""
    reply = link.spec()
    return None if reply is None else reply.to_wire()


def _drain(data: Any) -> None:
    held = data.held_records() if hasattr(data, "held_records") else 0
    if held > 0:
        data.set_batch_size(held)


def _batch_size(data: Any) -> int:
    config = getattr(data, "config", None)
    size = getattr(config, "batch_size", 0)
    return int(size) if isinstance(size, int) else 0


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value
