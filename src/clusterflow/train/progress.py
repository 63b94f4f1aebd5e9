"""The ``Progress`` hook: step, loss and samples/s on the chief's stderr.

Library code logs rather than prints; a progress display is the exception this hook
exists for. On a terminal it is a live ``rich`` bar; otherwise (a file, a pipe, the
output that ``clusterflow start`` routes and prefixes) plain lines, one per interval,
since a bar's carriage returns would make a log unreadable.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

from clusterflow._checks import whole
from clusterflow.train.api import Hook, Session, StepInfo, TrainConfigError

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID


__all__ = ["Progress"]


class Progress(Hook):
    """Shows the chief's step, loss and samples/s every ``every_steps`` steps.

    Args:
        every_steps: the step interval of updates (lines, when not on a terminal).
        stream: where to write; default ``sys.stderr`` as it is when the run begins.

    Raises:
        TrainConfigError: ``every_steps`` is not a positive integer.
    """

    def __init__(self, every_steps: int = 10, *, stream: TextIO | None = None) -> None:
        self.every_steps = whole("every_steps", every_steps, least=1, error=TrainConfigError)
        self._stream = stream
        self._out: TextIO | None = None
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._total: int | None = None

    def begin(self, session: Session) -> None:
        if not session.is_chief:
            return
        out = self._stream or sys.stderr
        self._out = out
        self._total = session.max_steps
        if _is_terminal(out):
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} samples/s"),
                TimeElapsedColumn(),
                console=Console(file=out),
                transient=False,
            )
            self._task = self._bar.add_task(
                "train", total=self._total, completed=session.step, loss="-", rate="-"
            )
            self._bar.start()

    def after_step(self, session: Session, info: StepInfo) -> None:
        if self._out is None or (info.step % self.every_steps and info.step != self._total):
            return
        loss = "-" if info.raw_loss is None else f"{info.loss:.4f}"
        rate = "-" if info.samples_per_s is None else f"{info.samples_per_s:.0f}"
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=info.step, loss=loss, rate=rate)
            return
        total = f"/{self._total}" if self._total is not None else ""
        self._line(f"step {info.step}{total} loss {loss} samples/s {rate}")

    def after_epoch(self, session: Session, epoch: int, logs: Mapping[str, float]) -> None:
        if self._out is None:
            return
        figures = " ".join(f"{name} {value:.4f}" for name, value in logs.items())
        text = f"epoch {epoch} {figures}".rstrip()
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            self._line(text)

    def end(self, session: Session, error: BaseException | None) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.stop()
        self._out = None

    def _line(self, text: str) -> None:
        out = self._out
        if out is not None:
            out.write(text + "\n")
            out.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
