"""The engine of both all-reduce strategies: ``CollectiveAllReduceStrategy``.

One process per device (docs/architecture.md section 5); each process is one replica,
holding a full copy of the model. Gradients are all-reduced by
``DistributedDataParallel`` (bucketed, overlapped with the backward pass), over the group
that :mod:`clusterflow.collective` forms. This module is what a replica does once it
knows who the replicas are (scope, DDP wrapping, ``run``, ``reduce``, ``distribute``,
saving); ``mirrored.py`` holds the two TensorFlow-named strategies, which decide that.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from clusterflow.collective import (
    CollectiveError,
    CommunicationOptions,
    Membership,
)
from clusterflow.collective.bucket_worker import BucketWorker
from clusterflow.collective.group import CollectiveGroup, select_device
from clusterflow.collective.hooks import register_communication
from clusterflow.data.api import SplitKey
from clusterflow.strategies.api import (
    CutRole,
    ReduceOp,
    Replicas,
    Strategy,
    StrategyError,
    parse_reduce_op,
)
from clusterflow.strategies.batches import batch_to_device, distribute_batches, is_data_client
from clusterflow.strategies.module_scope import (
    ModuleRecorder,
    forward_check,
    is_prepared,
    prepare_module,
    replica_wrapper,
    trainable,
    unprepare_class,
)
from clusterflow.strategies.resizing import (
    ElasticBatch,
    Resizing,
    check_elastic_batch,
)
from clusterflow.strategies.resolver import ClusterResolver

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

    from clusterflow.collective.elastic import Generation

__all__ = ["CollectiveAllReduceStrategy", "unwrap"]

_log = logging.getLogger(__name__)

_active_scope: Strategy | None = None
# Gradients as views into DDP's buckets: one copy fewer per step and per parameter.
_GRADIENT_AS_BUCKET_VIEW: Final = True


class CollectiveAllReduceStrategy(Resizing, Strategy):
    """Synchronous data parallelism over an all-reduce group; the engine of both strategies.

    Not built directly: use :class:`MultiWorkerMirroredStrategy` or
    :class:`MirroredStrategy`, which decide who the replicas are. In an elastic cluster
    trained through ``fit`` or a ``TrainingSession`` the group resizes live at step
    boundaries (``strategies/resizing.py``).
    """

    def __init__(
        self,
        membership: Membership,
        *,
        communication_options: CommunicationOptions | None = None,
        devices: Sequence[str] | None = None,
        cluster_resolver: ClusterResolver | None = None,
        elastic_batch: ElasticBatch = "global",
        store: TCPStore | None = None,
        joined: Generation | None = None,
    ) -> None:
        self._options = communication_options or CommunicationOptions()
        self._resolver = cluster_resolver
        self._device = select_device(membership, devices)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        self._group = CollectiveGroup.form(membership, self._options, self._device, store=store)
        atexit.register(self.shutdown)  # after the group's own: runs before it (LIFO)
        self._scope_depth = 0
        self._prepared: list[weakref.ref[nn.Module]] = []
        self._bucket_workers: list[BucketWorker] = []
        self._init_resizing(joined, check_elastic_batch(elastic_batch))

    # Who we are -------------------------------------------------------------------------

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas whose gradients are averaged into each update."""
        return self._group.world_size

    @property
    def is_chief(self) -> bool:
        """Rank 0: the chief task when the cluster has one, else ``worker:0``."""
        return self._group.rank == 0

    @property
    def rank(self) -> int:
        """This replica's rank in the group (0 is the chief)."""
        return self._group.rank

    @property
    def device(self) -> torch.device:
        """This replica's device; models and distributed batches are placed on it."""
        return self._device

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The cluster, as TensorFlow's ``strategy.cluster_resolver``; None without a spec."""
        return self._resolver

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._options

    # Variables ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Modules created inside are mirrored: placed on this replica's device, made equal
        to rank 0's and wrapped in DDP when the block ends.

        The user keeps the module object: calling it runs through DDP whenever gradients
        are enabled. Modules that gain a parameter or a submodule inside the block are
        recorded; the outermost ones (not a submodule of another) are prepared, those
        without trainable parameters (loss functions, frozen modules) are left alone.
        Every replica must create the same modules, since preparing broadcasts them.

        Raises:
            StrategyError: another strategy's scope is open.
            PeerLost: a replica died while the parameters were broadcast.
        """
        global _active_scope
        if _active_scope is not None and _active_scope is not self:
            raise StrategyError(
                "another strategy's scope() is open; one strategy places a model's variables"
            )
        if self._scope_depth:  # nested: the outermost scope prepares
            self._scope_depth += 1
            try:
                yield self
            finally:
                self._scope_depth -= 1
            return
        recorder = ModuleRecorder()
        self._scope_depth, _active_scope = 1, self
        try:
            with recorder.recording():
                yield self
        finally:
            self._scope_depth, _active_scope = 0, None
        for root in recorder.roots():
            if trainable(root):
                self.prepare(root)

    def prepare(self, module: nn.Module) -> nn.Module:
        """Mirrors a module created outside ``scope()``; returns the same object.

        Call before creating its optimizer (parameters move to this replica's device)
        and on every replica, since it broadcasts rank 0's parameters and buffers.

        Raises:
            StrategyError: ``module`` is already a DDP wrapper.
            PeerLost: a replica died during the broadcast.
        """
        if is_prepared(module):
            return module
        if isinstance(module, DistributedDataParallel):
            raise StrategyError(
                "prepare() takes the module itself, not a DistributedDataParallel wrapper: "
                "the strategy wraps it"
            )
        module.to(self._device)
        self._wrap(module)
        self._prepared.append(weakref.ref(module))
        _log.info(
            "mirrored %s over %d replicas on %s",
            type(module).__name__,
            self.num_replicas_in_sync,
            self._device,
        )
        return module

    def _wrap(self, module: nn.Module) -> None:
        """Routes ``module`` through a DDP wrapper over the current group (constructing
        it broadcasts rank 0's parameters and buffers); alone, marks it only."""
        wrapper: nn.Module | None = None
        if self.num_replicas_in_sync > 1 and trainable(module):
            with self._group.guard("broadcasting rank 0's parameters and forming groups"):
                ddp = DistributedDataParallel(
                    module,
                    device_ids=[self._device.index] if self._device.type == "cuda" else None,
                    bucket_cap_mb=self._bucket_cap_mb(),
                    gradient_as_bucket_view=_GRADIENT_AS_BUCKET_VIEW,
                )
                place = self._group.membership
                worker = register_communication(
                    ddp, self._options, place.local_rank, place.local_world_size
                )
            if worker is not None:
                self._bucket_workers.append(worker)
            wrapper = ddp
        prepare_module(module, wrapper)

    def _modules(self) -> list[nn.Module]:
        """The prepared modules that are still alive, in the order they were prepared."""
        return [m for m in (ref() for ref in self._prepared) if m is not None]

    def _unwrap_all(self) -> list[nn.Module]:
        """Drops every DDP wrapper (and bucket worker) over the current group; returns
        the prepared modules, each still marked as mirrored.

        Each wrapper's process group is held from Python until its wrappers are gone, and
        let go last, here. A reducer may hold a group's last reference (another strategy
        over the same group shut down first and destroyed it): freed by the reducer, the
        group's destructor would run with the GIL held and join a gloo thread that waits
        for the GIL to drop a finished collective's tensor, forever. Let go from Python,
        it runs with the GIL released (``CollectiveGroup.shutdown`` says the same of the
        group it owns). No ``gc.collect`` here: a resize re-forms the group through this,
        and a full collection with torch loaded held every resize long enough that a
        second leaver's step came first (``test_ray_elastic``'s 2 -> 4 -> 2 never ran at 4).
        """
        while self._bucket_workers:
            self._bucket_workers.pop().close()
        modules = self._modules()
        groups = []
        for module in modules:
            wrapper = replica_wrapper(module)
            if wrapper is not None:
                groups.append(getattr(wrapper, "process_group", None))
                del wrapper
                prepare_module(module, None)
        groups.clear()  # the last references, perhaps: GIL released (see above)
        return modules

    def _bucket_cap_mb(self) -> float | None:
        packed = self._options.bytes_per_pack
        return packed / 2**20 if packed else None

    def _wrappers(self) -> list[DistributedDataParallel]:
        modules = (ref() for ref in self._prepared)
        wrappers = (replica_wrapper(m) for m in modules if m is not None)
        return [w for w in wrappers if isinstance(w, DistributedDataParallel)]

    # Steps -------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        completes: Sequence[SplitKey] = (),
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` as one step of this replica and returns its result.

        The update is applied when ``fn`` returns, so the splits in ``completes`` settle
        as applied at once (``settled()``): the data cursor and the model move together,
        and a checkpoint holds both (the cut in ``train/``).

        The backward pass inside ``fn`` all-reduces the gradients (their mean over the
        replicas), so ``optimizer.step()`` inside ``fn`` applies the same update on every
        replica. Call ``backward`` inside ``run``, so a peer's failure is reported as one.

        Raises:
            StrategyError: a module with trainable parameters ran that the strategy does
                not mirror (created outside ``scope()``, or a submodule called apart from
                its model), before its gradients could make the replicas drift apart.
            PeerLost: a replica died or hung; the message names its rank and task.
            CollectiveError: the all-reduce failed otherwise.
        """
        with forward_check(self._describe_unmirrored):
            try:
                result = fn(*args, **(kwargs or {}))
                self._applied_now(completes)
                return result
            except (StrategyError, CollectiveError):
                raise
            except Exception as exc:
                error = self._group.translate(exc, "the step's gradient all-reduce")
                if error is None:
                    raise
                raise error from exc

    def _describe_unmirrored(self, module: nn.Module) -> str:
        for ref in self._prepared:
            root = ref()
            if root is not None and any(m is module for m in root.modules()):
                return (
                    f"{type(module).__name__} is part of the mirrored "
                    f"{unprepare_class(root).__name__} but was called on its own inside "
                    "strategy.run(), which bypasses the gradient all-reduce; call the model "
                    "itself"
                )
        return (
            f"a module with trainable parameters, {type(module).__name__}, ran inside "
            "strategy.run() but was created outside strategy.scope(): its gradients would "
            "not be all-reduced and the replicas would drift apart. Create the model inside "
            "`with strategy.scope():`, or call strategy.prepare(model) before the first step"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without an all-reduce.

        For gradient accumulation: run the first ``k - 1`` micro-batches inside
        ``no_sync()`` and the last outside it; that last backward all-reduces the sum of
        all ``k``, so the update equals one step on the ``k`` micro-batches together.
        """
        with contextlib.ExitStack() as stack:
            for wrapper in self._wrappers():
                stack.enter_context(wrapper.no_sync())
            yield

    # Values ------------------------------------------------------------------------------

    def reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Sum or mean of ``value`` over the replicas; every replica gets the result.

        Takes a tensor (returned as a tensor on the same device), a number (returned as
        a number), or a dict, list or tuple of those. A one-replica run returns the
        value itself (the mean of one is a float).

        Raises:
            StrategyError: ``op`` is not "sum" or "mean", or ``value`` is of another type.
            PeerLost: a replica died or hung.
        """
        reduce_op = parse_reduce_op(op)
        if isinstance(value, torch.Tensor):
            return self._reduce_tensor(reduce_op, value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            if isinstance(value, Mapping):
                return type(value)({k: self.reduce(reduce_op, v) for k, v in value.items()})  # type: ignore[call-arg]
            if isinstance(value, list | tuple):
                return type(value)(self.reduce(reduce_op, v) for v in value)
            raise StrategyError(
                f"reduce() takes a tensor, a number, or a dict/list/tuple of them; got "
                f"{type(value).__name__}"
            )
        total = self._reduce_tensor(reduce_op, torch.tensor(value, dtype=torch.float64)).item()
        if reduce_op is ReduceOp.SUM and isinstance(value, int):
            return round(total)
        return total

    def _reduce_tensor(self, op: ReduceOp, value: torch.Tensor) -> torch.Tensor:
        tensor = value.detach().to(self._device, copy=True)
        self._group.all_reduce_(tensor, "sum")
        if op is ReduceOp.MEAN:
            tensor = tensor / self.num_replicas_in_sync
        return tensor.to(value.device)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrites ``tensor`` with replica ``src``'s on every replica (a decision the
        chief takes for all, such as when to checkpoint)."""
        return self._group.broadcast_(tensor, src)

    def barrier(self) -> None:
        """Waits until every replica reaches this call.

        Raises:
            PeerLost: a replica died or hung.
        """
        self._group.barrier()

    # The training loop's questions (strategies/api.py) -----------------------------------

    def replicas(self) -> Replicas:
        return Replicas(self.rank, self.num_replicas_in_sync, averaged=True, collective=True)

    def check_placed(self, model: nn.Module) -> None:
        if not is_prepared(model):
            raise StrategyError(
                "the model was created outside strategy.scope(); build it inside "
                "`with strategy.scope():` (or call strategy.prepare(model) before the "
                "optimizer)"
            )

    def cut_role(self) -> CutRole:
        return CutRole("replicated", self.rank, self.num_replicas_in_sync, holds_model=False)

    def agree(self, flag: bool) -> bool:
        """The chief's ``flag`` on every replica: their clocks differ, and a time-based
        save must happen together (they meet at its barrier)."""
        if self.num_replicas_in_sync == 1:
            return flag
        return bool(self.broadcast_(torch.tensor([1 if flag else 0], dtype=torch.int32)).item())

    def finish(self, error: BaseException | None, leave: bool) -> None:
        """On error this replica leaves its group at once, so no peer waits on it."""
        self.end_resizing()
        if error is None:
            return
        try:
            self.shutdown()
        except Exception as exc:
            _log.warning("could not leave the all-reduce group after an error: %s", exc)

    # Data --------------------------------------------------------------------------------

    def distribute(
        self,
        dataset: Iterable[Any] | Dataset[Any],
        global_batch_size: int | None = None,
        *,
        drop_remainder: bool = False,
    ) -> Iterator[Any]:
        """This replica's slice of each global batch, on this replica's device.

        ``dataset`` is either an iterable of global batches (a ``DataLoader`` whose
        ``batch_size`` is the global batch size; every replica must see the same batches,
        so seed its shuffling alike), sliced here; or a map-style ``Dataset``, batched
        here by ``global_batch_size`` in index order, each replica reading only its
        rows. Replica ``r`` takes the ``r``-th contiguous block of each batch. A final
        partial batch is split as evenly as it goes (dropped if ``drop_remainder``, or
        when it has fewer rows than there are replicas).

        A ``clusterflow.data`` client is already this replica's share (the dispatcher
        lends each split to one replica; its ``batch_size`` is the per-replica batch):
        its batches pass through whole. Replicas may then run out at different steps,
        so they agree on every step (a one-integer all-reduce) and all stop when the first
        runs out: none waits in a gradient all-reduce that its peers never join. Batches
        left unread are never acked, so their leases go back to the queue.

        Call once per epoch; the iterator makes one pass.

        Raises:
            StrategyError: ``global_batch_size`` is not divisible by
                ``num_replicas_in_sync`` (the message names both), a map-style dataset
                comes without it, or a batch is larger than it.
        """
        if is_data_client(dataset):
            return self._in_step(iter(dataset))
        return distribute_batches(
            dataset,
            rank=self._group.rank,
            replicas=self.num_replicas_in_sync,
            global_batch_size=global_batch_size,
            drop_remainder=drop_remainder,
            device=self._device,
        )

    # Chief-only side effects -------------------------------------------------------------

    def _in_step(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Yields ``batches`` while every replica still has one (see :meth:`distribute`)."""
        have = torch.zeros(1, dtype=torch.int32)
        while True:
            batch = next(batches, None)
            have.fill_(0 if batch is None else 1)
            if not self._group.all_reduce_(have, "min").item():
                return
            yield batch if self._device.type == "cpu" else batch_to_device(batch, self._device)

    def save_model(self, model: nn.Module, path: str | os.PathLike[str]) -> None:
        """Writes ``model``'s state dict to ``path`` on the chief; every replica must call it.

        The file holds a plain state dict (CPU tensors, no ``module.`` prefix) that
        ``Net().load_state_dict(torch.load(path, weights_only=True))`` loads into a
        single-device module. The write is atomic (a temporary file renamed). The other
        replicas write nothing and wait until the chief has written, so the file exists
        on return everywhere that shares the chief's filesystem.

        Raises:
            StrategyError: the chief failed to write (on the other replicas too).
            PeerLost: a replica died or hung.
        """
        module = unwrap(model)
        failure: BaseException | None = None
        if self.is_chief:
            try:
                _write_state_dict(module, Path(path))
            except Exception as exc:
                failure = exc
        failed = self._group.all_reduce_(torch.tensor([1.0 if failure else 0.0]), "max")
        if failure is not None:
            raise StrategyError(
                f"the chief could not save the model to {path}: {failure}"
            ) from failure
        if failed.item():
            raise StrategyError(f"the chief could not save the model to {path}; see its log")

    def shutdown(self) -> None:
        """Stops the heartbeats and leaves the group this strategy formed; idempotent.

        Also runs at interpreter exit (registered when the group formed). The prepared
        modules then run alone: their DDP wrappers are dropped first, since a wrapper's
        reducer holding the group's last reference would free it with the GIL held
        (``CollectiveGroup.shutdown`` says why that hangs or aborts).
        """
        atexit.unregister(self.shutdown)
        if self._watcher is not None:
            self._watcher.stop()
        self._unwrap_all()
        self._group.shutdown()


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose state dict a plain single-device module loads (DDP unwrapped).

    A mirrored module is its own plain form (its state dict has the user's keys); a DDP
    wrapper gives its ``module``.
    """
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _write_state_dict(module: nn.Module, path: Path) -> None:
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    torch.save(state, partial)
    os.replace(partial, path)
    _log.info("saved the model (%d tensors) to %s", len(state), path)
