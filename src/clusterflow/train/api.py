"""What the training loop and its hooks share: the ``Hook`` base, the step record, the errors.

A hook is TensorFlow's ``SessionRunHook`` cut down to what a PyTorch loop needs. The
session calls, in this order::

    begin(session)                      # on entering; restoring hooks run first
    after_step(session, info)           # after every step, info.step counts from 1
    after_epoch(session, epoch, logs)   # fit() only, after each epoch
    end(session, error)                 # on leaving, also when the loop raised

Every task calls every hook: a hook that should act on the chief alone (summaries, the
progress bar) checks ``session.is_chief`` itself, so that hooks which must run on every
task (checkpoints are a consistent cut across tasks) follow the same order everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from clusterflow.errors import ClusterflowError, ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from clusterflow.strategies.api import Strategy

__all__ = ["Hook", "Session", "StepInfo", "TrainConfigError", "TrainError"]


class TrainError(ClusterflowError):
    """Training could not go on: a hook or the loop found a state it cannot continue from."""


class TrainConfigError(ConfigError):
    """``fit``, a session or a hook got a value it cannot use; the message names it."""


@dataclass(slots=True)
class StepInfo:
    """One finished step, as hooks see it.

    The loss is kept as given (often a tensor) and converted on first read: turning a
    GPU tensor into a float waits for the device, so steps no hook looks at stay free.
    """

    step: int
    """The step just finished: 1 after the first step of a fresh run."""
    samples: int | None
    """Samples this replica trained on in the step, when the loop said."""
    samples_per_s: float | None
    """This replica's recent throughput (over the last second or so)."""
    raw_loss: Any = None
    """The loss as the loop passed it: a tensor, a number or None."""
    raw_metrics: Mapping[str, Any] = field(default_factory=dict)
    """Per-step metrics as passed: name -> tensor or number."""
    _loss: float | None = None
    _converted: bool = False

    @property
    def loss(self) -> float | None:
        """The step's loss as a float (None when the loop gave none)."""
        if not self._converted:
            self._loss = None if self.raw_loss is None else float(self.raw_loss)
            self._converted = True
        return self._loss

    def metrics(self) -> dict[str, float]:
        """The step's metrics as floats."""
        return {name: float(value) for name, value in self.raw_metrics.items()}


class Session(Protocol):
    """What a hook sees of the run it is in (``TrainingSession`` is one).

    A protocol here, not the session class, so that hooks and the session import in one
    direction only: the session imports the hooks, never the other way round.
    """

    strategy: Strategy | None
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    data: Any
    state: dict[str, Any]
    max_steps: int | None

    @property
    def is_chief(self) -> bool: ...

    @property
    def step(self) -> int: ...

    def restored(self, step: int) -> None:
        """Sets the step the run resumes from (a restoring hook, in ``begin``)."""
        ...

    def request_stop(self) -> None: ...


class Hook:
    """Base of every hook; each method does nothing unless overridden.

    Attributes:
        restores: whether ``begin`` may move ``session.step`` (by restoring a
            checkpoint). The session begins such hooks before the others, so every
            other hook's ``begin`` sees the step the run resumes from.
    """

    restores: ClassVar[bool] = False

    def begin(self, session: Session) -> None:
        """Called once on entering the session, before the first step."""

    def after_step(self, session: Session, info: StepInfo) -> None:
        """Called after every step (``session.step_done``), on every task."""

    def after_epoch(self, session: Session, epoch: int, logs: Mapping[str, float]) -> None:
        """Called by ``fit`` after each epoch with its loss, metrics and validation figures."""

    def end(self, session: Session, error: BaseException | None) -> None:
        """Called once on leaving the session; ``error`` is what the loop raised, if anything.

        Called even when the loop failed, so a hook can release what it holds; it should
        not start work that needs the other tasks (they may be gone) when ``error`` is set.
        """
