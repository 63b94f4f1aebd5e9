"""The ``Checkpoint`` hook: restore on entering, save on schedule and at the end.

The hook holds no checkpoint logic of its own: it drives
``clusterflow.train.cut.Checkpointer``, which cuts a globally consistent
checkpoint across the tasks (every ps shard, every worker's state, the data cursor).
It adds what only the loop knows: the step to resume from, when the run ends, and a
small ``FINAL.json`` marker the chief writes after the last checkpoint of a finished
run, so an evaluator task knows it has seen the last one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

from clusterflow._checks import seconds, whole
from clusterflow.checkpoint.names import ENV_CHECKPOINT_DIR
from clusterflow.cluster.contract import ENV_CLUSTER_ID
from clusterflow.strategies.api import Strategy
from clusterflow.train.api import Hook, Session, StepInfo, TrainConfigError
from clusterflow.train.cut import DEFAULT_DIRECTORY, Checkpointer

if TYPE_CHECKING:
    import torch
    from torch import nn


__all__ = [
    "Checkpoint",
    "CheckpointerLike",
    "clear_final",
    "open_checkpointer",
    "read_final",
    "resolve_directory",
    "write_final",
]

_log = logging.getLogger(__name__)

FINAL_MARKER: Final = "FINAL.json"
"""Written by the chief after a run's last checkpoint: ``{"step": N, "run": id}``."""


class CheckpointerLike(Protocol):
    """What the hook and the evaluator use of ``Checkpointer``."""

    def restore(self) -> int: ...

    def maybe_save(self, step: int) -> bool: ...

    def save(self, step: int) -> None: ...

    def close(self) -> None: ...


def resolve_directory(directory: str | os.PathLike[str] | None) -> str:
    """The checkpoint directory: as given, else ``$CLUSTERFLOW_CHECKPOINT_DIR``, else
    ``./checkpoints`` (the Checkpointer's own default, resolved here so the evaluator
    and the final marker agree with it)."""
    if directory:
        return os.fspath(directory)
    return os.environ.get(ENV_CHECKPOINT_DIR) or DEFAULT_DIRECTORY


def open_checkpointer(
    strategy: Strategy | None,
    *,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    directory: str,
    every_steps: int | None = None,
    every_secs: float | None = None,
    keep: int = 3,
    state: Mapping[str, Any] | None = None,
    data: Any = None,
) -> CheckpointerLike:
    """A ``Checkpointer`` (``train/cut.py``) for these objects."""
    return Checkpointer(
        strategy,
        model=model,
        optimizer=optimizer,
        directory=directory,
        every_steps=every_steps,
        every_secs=every_secs,
        keep=keep,
        state=state,
        data=data,
    )


class Checkpoint(Hook):
    """Restores the newest checkpoint on entering; saves every N steps or seconds.

    On a clean end the last step is saved too (unless the schedule just did), so a
    finished run can always be resumed or evaluated at its final step. After an error
    nothing is saved: the other tasks may be gone, and the last scheduled checkpoint is
    the consistent one to restart from.

    Args:
        directory: where checkpoints go (a path or fsspec URL); default
            ``$CLUSTERFLOW_CHECKPOINT_DIR``, else ``./checkpoints``.
        every_steps: save when the step is a multiple of this.
        every_secs: save when this many seconds passed since the last save.
        keep: committed checkpoints kept; older ones are deleted.

    Raises:
        TrainConfigError: a schedule value is not positive.
    """

    restores = True

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        every_steps: int | None = None,
        every_secs: float | None = None,
        keep: int = 3,
    ) -> None:
        if every_steps is not None:
            whole("every_steps", every_steps, least=1, error=TrainConfigError)
        if every_secs is not None:
            seconds("every_secs", every_secs, error=TrainConfigError)
        whole("keep", keep, least=1, error=TrainConfigError)
        self.directory = directory
        self.every_steps = every_steps
        self.every_secs = every_secs
        self.keep = keep
        self._checkpointer: CheckpointerLike | None = None
        self._saved_step = -1

    @property
    def resolved_directory(self) -> str:
        return resolve_directory(self.directory)

    def begin(self, session: Session) -> None:
        directory = self.resolved_directory
        self._checkpointer = open_checkpointer(
            session.strategy,
            model=session.model,
            optimizer=session.optimizer,
            directory=directory,
            every_steps=self.every_steps,
            every_secs=self.every_secs,
            keep=self.keep,
            state=session.state or None,
            data=session.data,
        )
        step = self._checkpointer.restore()
        self._saved_step = step
        session.restored(step)
        if session.is_chief:
            clear_final(directory)  # this run goes on: an evaluator must wait for its end

    def after_step(self, session: Session, info: StepInfo) -> None:
        if self._checkpointer is not None and self._checkpointer.maybe_save(info.step):
            self._saved_step = info.step

    def end(self, session: Session, error: BaseException | None) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is None:
            return
        try:
            if error is None:
                if session.step != self._saved_step:
                    checkpointer.save(session.step)
                    self._saved_step = session.step
                if session.is_chief:
                    # The committed step: under parameter servers, the ps version.
                    saved = getattr(checkpointer, "last_saved_step", None)
                    write_final(self.resolved_directory, session.step if saved is None else saved)
        finally:
            checkpointer.close()


# The final marker ----------------------------------------------------------------------


def write_final(directory: str, step: int) -> None:
    """Marks ``step`` as the finished run's last checkpoint (the chief calls it)."""
    fs, path = _fs(directory)
    fs.makedirs(path, exist_ok=True)
    body = {"step": int(step), "run": os.environ.get(ENV_CLUSTER_ID)}
    fs.pipe_file(_join(path, FINAL_MARKER), json.dumps(body).encode())


def read_final(directory: str) -> int | None:
    """The finished run's last step; None while the run goes on.

    Inside a cluster, a marker another cluster wrote (an earlier run that this one
    continues, before its chief cleared the marker) does not count. A torn marker reads
    as none: the next look finds it whole.
    """
    fs, path = _fs(directory)
    try:
        data = json.loads(fs.cat_file(_join(path, FINAL_MARKER)))
        step = int(data["step"])
        run = data.get("run")
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None
    mine = os.environ.get(ENV_CLUSTER_ID)  # this run, not an earlier one in the directory
    if mine and run != mine:
        return None
    return step


def clear_final(directory: str) -> None:
    """Removes the marker of an earlier run that this run continues."""
    fs, path = _fs(directory)
    marker = _join(path, FINAL_MARKER)
    try:
        if fs.exists(marker):
            fs.rm_file(marker)
    except FileNotFoundError:
        pass


def _fs(directory: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs  # type: ignore[import-untyped]

    fs, path = url_to_fs(directory)
    return fs, str(path)


def _join(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"
