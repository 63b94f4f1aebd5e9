"""The one ``Strategy`` API every distribution strategy implements (docs/architecture.md section 5).

Call order, as in ``tf.distribute``: build the strategy; create the model (and, for
strategies that own the optimizer's placement, the optimizer) inside ``scope()``; then
call ``run(step_fn, args)`` once per step with this replica's batch. ``distribute``
gives each replica its slice of the data; ``reduce`` combines per-replica values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from enum import StrEnum
from typing import Any

from clusterflow.errors import ClusterflowError


class ReduceOp(StrEnum):
    SUM = "sum"
    MEAN = "mean"


class StrategyError(ClusterflowError):
    """A strategy was used out of order or with inputs it cannot take."""


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
    ) -> Any:
        """Runs one step of ``fn`` on this replica; gradients are shared as the strategy says."""

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
