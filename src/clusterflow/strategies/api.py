"""The one ``Strategy`` API every distribution strategy implements (docs/architecture.md section 5).

Call order, as in ``tf.distribute``: build the strategy; create the model (and, for
strategies that own the optimizer's placement, the optimizer) inside ``scope()``; then
call ``run(step_fn, args)`` once per step with this replica's batch. ``distribute``
gives each replica its slice of the data; ``reduce`` combines per-replica values.

Exactly-once data (docs/failure-semantics.md): a step fed by the data service passes
the keys of the splits its batch completes (``run(..., completes=batch.keys)``); the
strategy says through ``settled()`` when each key's update was applied (ack it) or
dropped (give it back). A strategy that applies its update before ``run`` returns
(all-reduce, one process) settles every key as applied right away; a parameter server
settles them when the ps answers, which may be a step later (``overlap_push``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from clusterflow.data.api import SplitKey
from clusterflow.errors import ClusterflowError

if TYPE_CHECKING:
    import torch
    from torch import nn


class ReduceOp(StrEnum):
    SUM = "sum"
    MEAN = "mean"


class StrategyError(ClusterflowError):
    """A strategy was used out of order or with inputs it cannot take."""


@dataclass(frozen=True, slots=True)
class Settled:
    """Split keys whose update was decided since the last ``Strategy.settled()``."""

    applied: tuple[SplitKey, ...] = ()
    """Their update is applied (or was applied before): ack them."""
    dropped: tuple[SplitKey, ...] = ()
    """Their update was dropped (a late or backup replica's push in a sync step, or a
    push over ``max_staleness``): give them back to the data service for another try."""

    def __bool__(self) -> bool:
        return bool(self.applied or self.dropped)


@dataclass(frozen=True, slots=True)
class Replicas:
    """This process's place among the replicas that share each global batch."""

    rank: int
    """Which slice of every global batch this replica takes."""
    count: int
    """Replicas the global batch is split across."""
    averaged: bool
    """Whether one update is the mean of exactly these ``count`` replicas' gradients.
    Then an uneven split (a final partial batch) is corrected by scaling each replica's
    loss by its share, as TensorFlow's ``compute_average_loss`` divides by the global
    batch size; async updates and sync steps with backup workers are not a mean over
    the split, so their losses are left alone."""
    collective: bool
    """Whether replicas meet in collectives (all-reduce), so all must make the same calls."""
    independent_steps: bool = False
    """Whether each replica's update is a global step of its own (async parameter
    servers): a restored global step then stands for about ``1/count`` of it per replica."""

    def own_steps(self, global_step: int) -> int:
        """Steps this replica took of ``global_step``: where its data resumes."""
        return global_step // self.count if self.independent_steps else global_step


ALONE = Replicas(rank=0, count=1, averaged=True, collective=False)
"""One process, or a strategy whose replicas each walk the whole data."""


Part = tuple[str, dict[str, Any], "dict[str, torch.Tensor]"]
"""One part of a checkpoint: its name, JSON metadata and named tensors."""
ReadPart = Callable[[str], "tuple[dict[str, Any], dict[str, torch.Tensor]]"]
"""Reads a part of the checkpoint being restored, by name."""


@dataclass(frozen=True, slots=True)
class CutRole:
    """How a strategy's processes take part in a consistent checkpoint."""

    kind: str
    """Written into the manifest (``replicated``, ``parameter_server``, a new strategy's
    own): a checkpoint restores only into a job of its kind."""
    rank: int
    """Which ``worker-<rank>`` part this process writes."""
    replicas: int
    """Processes that each write a part and meet at the barrier before the commit."""
    holds_model: bool
    """The strategy holds the model's state (its ``parts()``), so the cut writes no
    ``model`` part and needs no model to restore."""


class CheckpointParticipant(Protocol):
    """What the consistent cut (``train/cut.py``) needs of a strategy; no more.

    The cut calls, on the chief: ``quiesce`` (updates held; the cut's step), ``parts``
    and ``cut_meta`` (written with the cut), ``resume``; on every process ``barrier``
    once every part is written, and ``restore`` before training. A new strategy (a
    pipeline's stages) takes part by implementing these, without the cut knowing it.
    """

    def cut_role(self) -> CutRole: ...

    def agree(self, flag: bool) -> bool:
        """The chief's ``flag`` on every process (a time-based save happens together)."""
        ...

    def quiesce(self) -> int | None:
        """Holds updates until ``resume``; the step the cut stands at (None: the loop's)."""
        ...

    def parts(self) -> list[Part]:
        """The strategy's own state as checkpoint parts, while quiesced (chief only)."""
        ...

    def own_parts(self) -> list[Part]:
        """Parts this process writes itself (a pipeline stage's layers); every process."""
        ...

    def own_part_names(self) -> list[str]:
        """The names of every process's ``own_parts``, for the chief to collect."""
        ...

    def cut_meta(self) -> dict[str, Any]:
        """Facts for the manifest that a restore checks (shard counts, mode)."""
        ...

    def resume(self) -> None: ...

    def barrier(self) -> None:
        """Waits until every process of the cut wrote its part."""
        ...

    def restore(self, meta: dict[str, Any], read: ReadPart, *, named: bool) -> None:
        """Loads the strategy's parts of a checkpoint whose manifest meta is ``meta``.

        ``named``: the manager chose this checkpoint for a restart, so tasks that load
        their own state as they start (ps tasks) may have done so already.
        """
        ...


class SoloParticipant:
    """The consistent cut's part of one process alone: rank 0 of 1, nothing to agree
    on or quiesce, no parts of its own (the cut writes the model part itself).

    The defaults of every ``Strategy``, and the participant of a run with no strategy.
    """

    def cut_role(self) -> CutRole:
        return CutRole("replicated", rank=0, replicas=1, holds_model=False)

    def agree(self, flag: bool) -> bool:
        return flag

    def quiesce(self) -> int | None:
        return None

    def parts(self) -> list[Part]:
        return []

    def own_parts(self) -> list[Part]:
        return []

    def own_part_names(self) -> list[str]:
        return []

    def cut_meta(self) -> dict[str, Any]:
        return {}

    def resume(self) -> None:
        pass

    def barrier(self) -> None:
        pass

    def restore(self, meta: dict[str, Any], read: ReadPart, *, named: bool) -> None:
        pass


class Strategy(SoloParticipant, ABC):
    """How replicas share parameters. Subclasses: collective and parameter-server engines.

    Its ``CheckpointParticipant`` methods default to ``SoloParticipant``'s.
    """

    @property
    @abstractmethod
    def num_replicas_in_sync(self) -> int:
        """Replicas whose gradients are combined into one update."""

    @property
    @abstractmethod
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints, summaries and the saved model."""

    @abstractmethod
    def scope(self) -> AbstractContextManager[Strategy]:
        """Variables (module parameters and buffers) created inside are placed by the strategy."""

    @abstractmethod
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        completes: Sequence[SplitKey] = (),
    ) -> Any:
        """Runs one step of ``fn`` on this replica; gradients are shared as the strategy says.

        ``completes``: the keys of the data-service splits whose last records are in
        this step's batch (``Batch.keys``). Their fate comes back from ``settled()``.
        """

    # What a training loop asks of any strategy (train/ branches on none of them) ----

    def replicas(self) -> Replicas:
        """This replica's rank and how a global batch is split across the replicas.

        The default: every replica walks the whole data (a strategy of the user's own,
        whose ``distribute()`` is not the loop's to second-guess).
        """
        return ALONE

    def train_step(
        self, model: nn.Module, loss_fn: Callable[[Any, Any], Any], optimizer: Any
    ) -> Callable[[Any, Any, float], tuple[torch.Tensor, Any]] | None:
        """The step ``fit`` runs instead of its own, or None (the default: fit's own).

        A strategy whose schedule runs the forward, backward and update itself (a
        pipeline's) returns ``step(inputs, targets, loss_scale) -> (loss, outputs)``.
        Call before training (before a restore, which may load ``optimizer``).
        """
        return None

    def check_placed(self, model: nn.Module) -> None:
        """Fails unless ``model``'s variables were created in ``scope()``.

        A model built outside the scope would train, but wrongly (its gradients never
        averaged, or its updates kept local). Call before training.

        Raises:
            StrategyError: the model was not created in the scope; the message says how.
        """

    def begin_session(self, session: Any, *, resizable: bool) -> None:
        """A ``TrainingSession`` opened, its hooks begun (restored). ``resizable``: the
        session's loop can go on at another world size (``fit`` with a data-service
        client, or a custom loop). The all-reduce strategies declare it to the manager
        here and, on a worker added to a running cluster, receive the state."""

    def boundary(
        self, session: Any, go: bool | None, rows: int | None
    ) -> tuple[bool, bool, float] | None:
        """A step boundary of a run that resizes live (its membership may change here):
        ``(step, end, loss scale)``. ``go``: this replica has a batch (True), its data
        ended (False), or it waits for splits still out (None). None (the default): the
        run does not resize, and the loop agrees on ``go`` as it always did."""
        return None

    def refresh_model(self) -> None:
        """Makes the local model hold the shared parameters' newest values (before
        evaluating it): a replica whose values lag the shared ones pulls them here."""

    def finish(self, error: BaseException | None, leave: bool) -> None:
        """What a replica does when its training run ends.

        ``error``: what ended it, if anything: then the replica drops out at once, so
        no peer waits on it until a deadline. ``leave``: this replica's data ran out
        while others may go on (they must stop waiting for it). Errors are raised only
        when ``error`` is None.
        """

    # Exactly-once data --------------------------------------------------------------

    def settled(self, *, wait: bool = False) -> Settled:
        """The keys given to ``run`` whose update has since been applied or dropped.

        Each key comes back once. With ``wait``, first waits until every step this
        replica ran is decided (at the end of training). This default serves strategies
        whose ``run`` returns with its update applied: call ``_applied_now`` in ``run``.
        """
        keys = self.__dict__.pop("_settled_keys", [])
        return Settled(applied=tuple(keys))

    def _applied_now(self, keys: Sequence[SplitKey]) -> None:
        """For ``run``: the step's update is applied; ``settled()`` reports ``keys``."""
        if keys:
            self.__dict__.setdefault("_settled_keys", []).extend(keys)

    @abstractmethod
    def reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Combines a per-replica value (a tensor or number) across the replicas in sync."""

    @abstractmethod
    def distribute(
        self, dataset: Iterable[Any], global_batch_size: int | None = None
    ) -> Iterator[Any]:
        """This replica's share of ``dataset`` (each replica sees different elements)."""

    def state_dict(self) -> dict[str, Any]:
        """Worker-side state to checkpoint (step counters, versions); empty by default."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` returned (nothing, by default)."""


def parse_reduce_op(op: ReduceOp | str) -> ReduceOp:
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        raise StrategyError(f"unknown reduce op {op!r}; expected 'sum' or 'mean'") from None
