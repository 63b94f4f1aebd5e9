"""``PipelineStrategy``: one model cut into stages on tasks, micro-batches streamed through.

Use, as the other strategies::

    strategy = cf.PipelineStrategy(schedule="1f1b", microbatches=8)
    with strategy.scope():
        model = nn.Sequential(...)        # cut into one stage per task
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cf.fit(model, loss_fn, optimizer, data, strategy=strategy)

Under ``clusterflow start --workers 4``: 4 stages; with ``stages=2``, 2 pipelines of 2
stages, data-parallel (each pipeline takes its slice of every global batch and the
same stage of both pipelines averages its gradients). Every task builds the whole model
(the same code) and keeps it; each computes and updates only its own chunks, and
:meth:`refresh_model` (before an evaluation, and at the end) copies every chunk from
its owner, so ``model`` is whole again on every task.

The synchronous schedules are torch's (``sync.py``); PipeDream is ours
(``pipedream.py``). A custom loop gets the step with :meth:`train_step`, called before
the ``TrainingSession`` is entered (a restore loads the optimizer it names).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_hooks

from clusterflow.cluster import TaskId, TFConfig
from clusterflow.collective import CommunicationOptions, Membership
from clusterflow.collective.group import CollectiveGroup, select_device
from clusterflow.data.api import SplitKey
from clusterflow.strategies.api import (
    ReduceOp,
    Replicas,
    Strategy,
    StrategyError,
    parse_reduce_op,
)
from clusterflow.strategies.batches import distribute_batches
from clusterflow.strategies.module_scope import ModuleRecorder, trainable
from clusterflow.strategies.pipeline import split as cutting
from clusterflow.strategies.pipeline.api import (
    PipelineConfig,
    PipelineError,
    Schedule,
    check_microbatches,
)
from clusterflow.strategies.pipeline.groups import subgroups
from clusterflow.strategies.pipeline.layout import Layout
from clusterflow.strategies.pipeline.outputs import OutputShare
from clusterflow.strategies.pipeline.pipedream import PipeDreamEngine
from clusterflow.strategies.pipeline.state import StageCut
from clusterflow.strategies.pipeline.sync import LocalEngine, SyncEngine
from clusterflow.strategies.resolver import (
    ClusterResolver,
    TFConfigClusterResolver,
    checked_resolver,
)
from clusterflow.strategies.variables import current_placement, pipeline_scope

__all__ = ["PipelineStrategy"]

_log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]
Step = Callable[[Any, Any, float], tuple[torch.Tensor, Any]]


class PipelineStrategy(StageCut, Strategy):
    """Pipeline parallelism: GPipe, 1F1B, interleaved 1F1B (torch's), PipeDream (ours).

    Args:
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"pipedream"``.
        microbatches: micro-batches per replica batch (they must divide it).
        stages: tasks per pipeline (default: all replica tasks, one pipeline).
        split: split points (child indices or names where stages 1.. begin).
        balance: with no split and no ``cf.device`` blocks: ``"parameters"`` or
            ``"time"`` (measured on ``example_input``).
        virtual_stages: chunks per task under the interleaved schedule.
        two_bw: PipeDream-2BW, one update per batch (``pipedream`` only).
        overlap: post each step's receives ahead of the compute they feed (GPipe, 1F1B,
            interleaved; default True); False runs torch's schedules unchanged.
        example_input: one micro-batch of inputs, for ``balance="time"``.
        record_stashes: PipeDream keeps a record of every micro-batch's weight versions.

    Raises:
        PipelineError: a bad value, more stages than tasks, or stages that do not divide
            the tasks (one line naming it).
        CollectiveError: the replicas did not all join in time.
    """

    def __init__(
        self,
        schedule: str = "1f1b",
        microbatches: int = 4,
        *,
        stages: int | None = None,
        split: Sequence[int | str] | None = None,
        balance: str = "parameters",
        virtual_stages: int = 2,
        two_bw: bool = False,
        overlap: bool = True,
        example_input: torch.Tensor | None = None,
        record_stashes: bool = False,
        communication_options: CommunicationOptions | None = None,
        cluster_resolver: ClusterResolver | None = None,
    ) -> None:
        self.config = PipelineConfig(
            schedule=schedule,  # type: ignore[arg-type]
            microbatches=microbatches,
            stages=stages,
            split=split,  # type: ignore[arg-type]  # any sequence: the config makes it a tuple
            balance=balance,  # type: ignore[arg-type]
            virtual_stages=virtual_stages,
            two_bw=two_bw,
            overlap=overlap,
        )
        if self.config.balance == "time" and example_input is None and split is None:
            raise PipelineError("balance='time' measures the layers on example_input; give one")
        resolver = checked_resolver(cluster_resolver, "PipelineStrategy")
        if resolver is None and TFConfig.from_env() is not None:
            resolver = TFConfigClusterResolver()
        membership = Membership.from_env(
            os.environ,
            resolver.cluster_spec() if resolver else None,
            resolver.task if resolver else None,
        )
        # Validate before any socket opens: a bad layout must not wait on a rendezvous.
        self.layout = Layout.of(
            membership.rank, membership.world_size, stages, self.config.chunks_per_task
        )
        self._membership = membership
        _declare_fixed_size()
        self._device = select_device(membership, None)
        self._group = CollectiveGroup.form(
            membership, communication_options or CommunicationOptions(), self._device
        )
        self._pipe_group, self._stage_group = subgroups(self.layout)
        self._example = example_input
        self._record = record_stashes
        self._model: nn.Module | None = None
        self._chunks: list[nn.Module] = []
        self._bounds: list[range] = []
        self._names: list[str] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._loss_fn: LossFn | None = None
        self._engine: SyncEngine | PipeDreamEngine | None = None
        self._shapes: dict[tuple[int, ...], list[tuple[torch.Size, torch.dtype]]] = {}
        self._share = (
            OutputShare(self.layout, self._pipe_group, self._device)
            if self.layout.stages > 1
            else None
        )
        self._scope_open = False
        _log.info(
            "pipeline %s: stage %d of %d in pipeline %d of %d, %d micro-batches",
            self.config.schedule.value,
            self.layout.stage,
            self.layout.stages,
            self.layout.pipeline,
            self.layout.pipelines,
            self.config.microbatches,
        )

    # Who we are -------------------------------------------------------------------------

    @property
    def num_replicas_in_sync(self) -> int:
        """Pipelines whose gradients are averaged into each update."""
        return self.layout.pipelines

    @property
    def is_chief(self) -> bool:
        return self.layout.rank == 0

    @property
    def stage(self) -> int:
        return self.layout.stage

    @property
    def engine(self) -> SyncEngine | PipeDreamEngine | None:
        """The schedule's engine once the first step built it (PipeDream's records)."""
        return self._engine

    # Cutting the model ------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """The model built inside (an ``nn.Sequential``) is cut into the pipeline's stages.

        Layers built under ``cf.device("/job:worker/task:k")`` go to that task's stage.

        Raises:
            PipelineError: no model, several models, a model that is no
                ``nn.Sequential``, or a cut that leaves a stage empty.
        """
        if self._scope_open:
            yield self
            return
        recorder = ModuleRecorder()
        placed: dict[int, TaskId] = {}

        def note(module: nn.Module, name: str, param: Any) -> None:
            task = current_placement()
            if task is not None:
                placed[id(module)] = task

        handle = module_hooks.register_module_parameter_registration_hook(note)
        self._scope_open = True
        try:
            with recorder.recording(), pipeline_scope():
                yield self
        finally:
            handle.remove()
            self._scope_open = False
        roots = [m for m in recorder.roots() if trainable(m)]
        if len(roots) != 1:
            raise PipelineError(
                f"PipelineStrategy cuts one model; {len(roots)} models with trainable "
                "parameters were built in its scope"
            )
        self.prepare(roots[0], placed)

    def prepare(self, model: nn.Module, placed: Mapping[int, TaskId] | None = None) -> nn.Module:
        """Cuts ``model`` into this pipeline's chunks; every task calls it with the same
        model. Rank 0's values are copied to every task first."""
        layers = cutting.children_of(model)
        names = [name for name, _ in layers]
        modules = [module for _, module in layers]
        chunks = self.layout.chunks
        owners = cutting.owners(modules, placed or {}, self._stage_of)
        if len(modules) < chunks:
            raise PipelineError(
                f"the model has {len(modules)} layers, too few for {chunks} pipeline stages: "
                "every stage needs at least one"
            )
        if self.config.split is not None:
            bounds = cutting.by_points(self.config.split, names, chunks)
        elif any(o is not None for o in owners):
            if self.config.chunks_per_task > 1:
                raise PipelineError(
                    "cf.device blocks give one chunk per task; the interleaved schedule "
                    "needs split points or a balance"
                )
            bounds = cutting.by_owner(owners, chunks)
        elif self.config.balance == "time":
            assert self._example is not None
            costs = torch.tensor(cutting.measure_times(modules, self._example))
            self._group.all_reduce_(costs, "sum")  # every task cuts alike
            bounds = cutting.balanced(costs.tolist(), chunks)
        else:
            bounds = cutting.balanced(cutting.parameter_costs(modules), chunks)
        model.to(self._device)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                self._group.broadcast_(tensor, 0)
        self._model = model
        self._names = names
        self._bounds = bounds
        self._chunks = [nn.Sequential(*(modules[i] for i in b)) for b in bounds]
        _log.info("cut %d layers into chunks %s", len(modules), [(b.start, b.stop) for b in bounds])
        return model

    def _stage_of(self, task: TaskId) -> int:
        tasks = self._membership.tasks
        if tasks is not None:
            if task not in tasks:
                raise PipelineError(f"cf.device names {task}, which is not a replica task")
            rank = tasks.index(task)
        else:
            rank = task.index
        if rank >= self.layout.world:
            raise PipelineError(
                f"cf.device names {task}, but the cluster has {self.layout.world} replica tasks"
            )
        return rank % self.layout.stages

    @property
    def bounds(self) -> list[range]:
        """Each chunk's layers (indices into the model's children)."""
        return list(self._bounds)

    # Steps ------------------------------------------------------------------------------

    def train_step(
        self, model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer
    ) -> Step:
        """The step ``fit`` runs: ``step(inputs, targets, scale) -> (loss, outputs)``.

        Every task of a pipeline calls it with the same batch; the schedule runs the
        forward and backward passes and the update. The loss and outputs come back on
        every task (from the last stage), for the loop's figures.
        """
        self.check_placed(model)
        self._optimizer = optimizer
        self._loss_fn = loss_fn
        return self._step

    def _step(self, inputs: Any, targets: Any, scale: float = 1.0) -> tuple[torch.Tensor, Any]:
        if not isinstance(inputs, torch.Tensor):
            raise PipelineError(
                f"a pipeline's inputs must be one tensor, got {type(inputs).__name__}"
            )
        assert self._loss_fn is not None and self._optimizer is not None
        rows = inputs.shape[0]
        per = check_microbatches(rows, self.config.microbatches)
        loss_fn = self._loss_fn
        scaled = loss_fn if scale == 1.0 else (lambda o, t: loss_fn(o, t) * scale)
        shapes = self._boundary_shapes((per, *inputs.shape[1:]), inputs.dtype)
        engine = self._ensure_engine()
        share = self._share
        optimizer = self._optimizer

        def expect() -> None:
            if share is not None:
                shape, dtype = shapes[-1]
                share.expect((rows, *shape[1:]), dtype)

        if isinstance(engine, PipeDreamEngine):
            expect()
            # The last stage sends the outputs before its last backward (outputs.py).
            ready = share.send if share is not None else None
            outputs = engine.step(inputs, targets, scaled, self.config.microbatches, ready)
        else:

            def prepare() -> None:
                # Nothing before the first backward reads the gradients, and the last
                # stage sends its outputs after its step: on the first stage both wait
                # until its first forward is on its way (SyncEngine.step).
                expect()
                optimizer.zero_grad(set_to_none=True)

            outputs = engine.step(inputs, targets, scaled, prepare)
            if share is not None and outputs is not None:
                share.send(outputs)
            self._average_gradients()
            self._optimizer.step()
        if share is not None:
            with self._group.guard("sharing the last stage's outputs"):
                outputs = share.result()
        assert outputs is not None
        with torch.no_grad():
            loss = loss_fn(outputs, targets).reshape(())
        return loss.detach(), outputs

    def _ensure_engine(self) -> SyncEngine | PipeDreamEngine:
        if self._engine is not None:
            return self._engine
        if self.config.schedule is Schedule.PIPEDREAM:
            (chunk,) = [self._chunks[c] for c in self.layout.my_chunks()]
            self._engine = PipeDreamEngine(
                self.layout,
                chunk,
                self._apply_one,
                lambda shape: self._shapes[shape],
                group=self._pipe_group,
                accumulate=self.config.microbatches if self.config.two_bw else 1,
                record=self._record,
            )
        elif self.layout.chunks == 1:
            self._engine = LocalEngine(self._chunks[0], self.config.microbatches)  # type: ignore[assignment]
        else:
            self._engine = SyncEngine(
                self.layout,
                self._chunks,
                self.config.schedule,
                self.config.microbatches,
                self._pipe_group,
                self._device,
                overlap=self.config.overlap,
            )
        return self._engine  # type: ignore[return-value]

    def _apply_one(self) -> None:
        """PipeDream's update of one micro-batch: averaged across pipelines, applied."""
        assert self._optimizer is not None
        self._average_gradients()
        self._optimizer.step()

    def _my_parameters(self) -> list[nn.Parameter]:
        return [p for c in self.layout.my_chunks() for p in self._chunks[c].parameters()]

    def _average_gradients(self) -> None:
        if self.layout.pipelines == 1:
            return
        grads = [p.grad for p in self._my_parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        with self._group.guard("averaging a stage's gradients across pipelines"):
            dist.all_reduce(flat, group=self._stage_group)
        flat /= self.layout.pipelines
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _boundary_shapes(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> list[tuple[torch.Size, torch.dtype]]:
        """Each chunk's output shape for a micro-batch of ``shape`` (a local dry run)."""
        found = self._shapes.get(shape)
        if found is None:
            value = torch.zeros(shape, dtype=dtype, device=self._device)
            found = []
            with torch.no_grad():
                for chunk in self._chunks:
                    value = chunk(value)
                    found.append((value.shape, value.dtype))
            self._shapes[shape] = found
        return found

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        completes: Sequence[SplitKey] = (),
    ) -> Any:
        """Runs ``fn`` (a step that calls the function :meth:`train_step` gave).

        Raises:
            PipelineError: ``completes`` is given: the data service does not feed
                pipelines yet (the stages of one pipeline must see the same batch).
            PeerLost: a stage died or hung.
        """
        if completes:
            raise PipelineError(
                "PipelineStrategy takes tensors, datasets or global batches; a data-service "
                "client cannot feed the stages of one pipeline the same batch yet"
            )
        try:
            return fn(*args, **(kwargs or {}))
        except StrategyError:
            raise
        except Exception as exc:
            error = self._group.translate(exc, "a pipeline step")
            if error is None:
                raise
            raise error from exc

    # Values ------------------------------------------------------------------------------

    def reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Sum or mean over the pipelines (the stages of one pipeline hold the same)."""
        reduce_op = parse_reduce_op(op)
        if isinstance(value, Mapping):
            return type(value)({k: self.reduce(reduce_op, v) for k, v in value.items()})  # type: ignore[call-arg]
        if isinstance(value, list | tuple):
            return type(value)(self.reduce(reduce_op, v) for v in value)
        if isinstance(value, bool) or not isinstance(value, int | float | torch.Tensor):
            raise StrategyError(
                f"reduce() takes a tensor, a number, or a dict/list/tuple of them; got "
                f"{type(value).__name__}"
            )
        dtype = None if isinstance(value, torch.Tensor) else torch.float64
        tensor = torch.as_tensor(value, dtype=dtype)
        tensor = tensor.detach().clone()
        if self.layout.pipelines > 1:
            with self._group.guard("reduce across pipelines"):
                dist.all_reduce(tensor, group=self._stage_group)
        if reduce_op is ReduceOp.MEAN:
            tensor = tensor / self.layout.pipelines
        if isinstance(value, torch.Tensor):
            return tensor
        result = tensor.item()
        return round(result) if reduce_op is ReduceOp.SUM and isinstance(value, int) else result

    def distribute(
        self, dataset: Iterable[Any], global_batch_size: int | None = None
    ) -> Iterator[Any]:
        """This pipeline's slice of each global batch (every stage of it the same)."""
        return distribute_batches(
            dataset,
            rank=self.layout.pipeline,
            replicas=self.layout.pipelines,
            global_batch_size=global_batch_size,
            drop_remainder=False,
            device=self._device,
        )

    def replicas(self) -> Replicas:
        return Replicas(self.layout.pipeline, self.layout.pipelines, averaged=True, collective=True)

    def check_placed(self, model: nn.Module) -> None:
        if self._model is None or model is not self._model:
            raise StrategyError(
                "the model was not built in this PipelineStrategy's scope(); build it inside "
                "`with strategy.scope():` (or call strategy.prepare(model))"
            )

    def refresh_model(self) -> None:
        """Finishes PipeDream's micro-batches in flight, then copies every chunk from the
        task that trains it, so the whole model is current on every task. Every task of
        every pipeline calls it together."""
        self._drain()
        if self.layout.stages == 1:
            return
        with torch.no_grad(), self._group.guard("gathering the stages' weights"):
            for c, chunk in enumerate(self._chunks):
                for tensor in chunk.state_dict().values():
                    dist.broadcast(tensor, src=self.layout.owner(c), group=self._pipe_group)

    def _drain(self) -> None:
        with self._group.guard("draining the pipeline"):
            if isinstance(self._engine, PipeDreamEngine):
                self._engine.drain()
            if self._share is not None:
                self._share.drain()

    def finish(self, error: BaseException | None, leave: bool) -> None:
        """At the end every task gets the whole trained model; on error this task leaves
        the group at once, so no stage waits on it."""
        if error is None:
            if self._model is not None:
                self.refresh_model()
            return
        try:
            self._group.shutdown()
        except Exception as exc:
            _log.warning("could not leave the pipeline's group after an error: %s", exc)


def _declare_fixed_size() -> None:
    """Tells the manager that this job's workers do not resize: a pipeline's stage count
    is the model's cut, so ``clusterflow scale`` must refuse it. Said when the strategy
    is built, before any step: a worker that has declared nothing is taken for an
    unmodified script, which a ``scale`` restarts at the new size (manager/elastic.py).
    Nothing to tell outside a cluster; never raises."""
    from clusterflow.server.manager_link import ManagerLink

    link = ManagerLink.from_env()
    if link is None:
        return
    try:
        link.declare(respawnable=False, resizable=False)
    finally:
        link.close()
