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
from typing import Any

from clusterflow.data.api import SplitKey
from clusterflow.errors import ClusterflowError


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


class Strategy(ABC):
    """How replicas share parameters. Subclasses: collective and parameter-server engines."""

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

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027
        """Restores what ``state_dict`` returned (nothing, by default)."""


def parse_reduce_op(op: ReduceOp | str) -> ReduceOp:
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        raise StrategyError(f"unknown reduce op {op!r}; expected 'sum' or 'mean'") from None
