"""``StopAtStep``: end the run at a global step, also across a restart."""

from __future__ import annotations

from clusterflow._checks import whole
from clusterflow.train.api import Hook, Session, StepInfo, TrainConfigError

__all__ = ["StopAtStep"]


class StopAtStep(Hook):
    """Requests a stop once the step reaches ``last_step`` (counted from the run's start).

    The bound is on the global step, not on the steps of this process: a run restored
    at step 700 with ``StopAtStep(1000)`` takes 300 more steps, and one restored at or
    past it takes none, as TensorFlow's ``StopAtStepHook(last_step=...)``. Every replica
    counts the same steps, so all stop together.

    Raises:
        TrainConfigError: ``last_step`` is not a non-negative integer.
    """

    def __init__(self, last_step: int) -> None:
        self.last_step = whole("StopAtStep(last_step)", last_step, error=TrainConfigError)

    def begin(self, session: Session) -> None:
        if session.step >= self.last_step:
            session.request_stop()

    def after_step(self, session: Session, info: StepInfo) -> None:
        if info.step >= self.last_step:
            session.request_stop()
