"""The ``Summary`` hook: TensorBoard event files, written by the chief alone.

Every replica computes the same figures (or its own share of them), so one writer is
enough, and several would interleave events into files TensorBoard reads as one run.
On the other tasks the hook creates nothing: no writer, no folder, no file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from clusterflow._checks import whole
from clusterflow.cluster.contract import ENV_STATE_DIR, TENSORBOARD_FILE
from clusterflow.train.api import Hook, Session, StepInfo, TrainConfigError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


__all__ = ["Summary"]

log = logging.getLogger(__name__)


class Summary(Hook):
    """Writes scalars to TensorBoard event files in ``log_dir``, on the chief only.

    Every ``every_steps`` steps: ``loss``, ``samples_per_s`` (the chief's own), ``lr``
    (the optimizer's first parameter group) and each per-step metric. After each epoch of
    ``fit``: ``epoch/<name>`` for its loss, metrics and validation figures, at the global
    step the epoch ended on. Read them with TensorBoard (``tensorboard --logdir``) or
    ``EventAccumulator``.

    Args:
        log_dir: the run's TensorBoard directory (a path; created on the chief).
        every_steps: the step interval of the per-step scalars.

    Raises:
        TrainConfigError: ``every_steps`` is not a positive integer.
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, every_steps: int = 10) -> None:
        every_steps = whole("every_steps", every_steps, least=1, error=TrainConfigError)
        self.log_dir = os.fspath(log_dir)
        self.every_steps = every_steps
        self._writer: SummaryWriter | None = None

    def begin(self, session: Session) -> None:
        if not session.is_chief:
            return
        # Imported here: tensorboard is paid for by the chief, and only when summaries are on.
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(self.log_dir)
        _tell_the_cluster(self.log_dir)

    def after_step(self, session: Session, info: StepInfo) -> None:
        writer = self._writer
        if writer is None or info.step % self.every_steps:
            return
        step = info.step
        if info.raw_loss is not None:
            writer.add_scalar("loss", info.loss, step)
        if info.samples_per_s is not None:
            writer.add_scalar("samples_per_s", info.samples_per_s, step)
        lr = _learning_rate(session)
        if lr is not None:
            writer.add_scalar("lr", lr, step)
        for name, value in info.metrics().items():
            writer.add_scalar(name, value, step)

    def after_epoch(self, session: Session, epoch: int, logs: Mapping[str, float]) -> None:
        writer = self._writer
        if writer is None:
            return
        for name, value in logs.items():
            writer.add_scalar(f"epoch/{name}", value, session.step)
        writer.flush()

    def end(self, session: Session, error: BaseException | None) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def _learning_rate(session: Session) -> float | None:
    optimizer = session.optimizer
    if optimizer is None or not optimizer.param_groups:
        return None
    lr = optimizer.param_groups[0].get("lr")
    try:
        return None if lr is None else float(lr)
    except (TypeError, ValueError):
        return None


def _tell_the_cluster(log_dir: str) -> None:
    """Names the TensorBoard folder in the cluster's folder, for ``clusterflow ui``.

    Only under ``clusterflow start`` (which sets ``CLUSTERFLOW_STATE_DIR``); a folder that
    cannot be written costs the run nothing but the dashboard's line.
    """
    state_dir = os.environ.get(ENV_STATE_DIR)
    if not state_dir:
        return
    try:
        (Path(state_dir) / TENSORBOARD_FILE).write_text(os.path.abspath(log_dir) + "\n")
    except OSError as exc:
        log.debug("could not name the TensorBoard folder in %s: %s", state_dir, exc)
