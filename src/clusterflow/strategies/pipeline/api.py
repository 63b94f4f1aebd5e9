"""The pipeline strategy's value types and errors (docs/pipeline.md).

A pipeline cuts one model into consecutive *stages*, one per replica task, and streams
*micro-batches* through them so that the stages compute at the same time. These are the
choices a user makes, validated when made, so a bad value fails at the edge with one
line that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from clusterflow._checks import listed, whole
from clusterflow.errors import ConfigError
from clusterflow.strategies.api import StrategyError

__all__ = ["Balance", "PipelineConfig", "PipelineError", "Schedule"]


class PipelineError(StrategyError, ConfigError):
    """A pipeline that cannot be built or run as asked (the message names the value)."""


class Schedule(StrEnum):
    """Which order the stages run micro-batches' forward and backward passes in."""

    GPIPE = "gpipe"
    """All forwards, then all backwards, then one update (torch's ``ScheduleGPipe``)."""
    ONE_F_ONE_B = "1f1b"
    """One forward, one backward in turn after a warm-up; one update per batch; fewer
    activations alive than GPipe (torch's ``Schedule1F1B``)."""
    INTERLEAVED = "interleaved"
    """1F1B over several model chunks per task, a smaller bubble (torch's
    ``ScheduleInterleaved1F1B``)."""
    PIPEDREAM = "pipedream"
    """Asynchronous 1F1B without a flush: one update per micro-batch, each backward on
    the weights its forward used (weight stashing); built here, torch has none."""

    @property
    def synchronous(self) -> bool:
        return self is not Schedule.PIPEDREAM


Balance = Literal["parameters", "time"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """How ``PipelineStrategy`` cuts and runs a model.

    Raises:
        PipelineError: on construction, for a value out of range (named in the message).
    """

    schedule: Schedule = Schedule.ONE_F_ONE_B
    """The schedule; a string (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"pipedream"``)
    is accepted."""
    microbatches: int = 4
    """Micro-batches each replica's batch is cut into; they must divide it."""
    stages: int | None = None
    """Tasks per pipeline; None: every replica task is a stage of one pipeline. Fewer
    stages than tasks make ``tasks / stages`` pipelines, data-parallel."""
    split: tuple[int | str, ...] | None = None
    """Explicit split points: the child (index or name) of the ``nn.Sequential`` where
    each stage after the first begins. None: ``cf.device`` blocks, else ``balance``."""
    balance: Balance = "parameters"
    """With no split and no device blocks: balance stages by parameter count, or by the
    measured time of each layer's forward and backward (needs ``example_input``)."""
    virtual_stages: int = 2
    """Model chunks per task under the interleaved schedule."""
    two_bw: bool = False
    """PipeDream-2BW: under ``pipedream``, one update per batch (the mean of its
    micro-batches' gradients, each taken on its forward's weights) instead of one per
    micro-batch; at most two weight versions alive. Fewer copies and optimizer steps."""
    overlap: bool = True
    """GPipe, 1F1B, interleaved: post every receive of a step at its start, so the next
    micro-batch's activations and gradients arrive while this one computes
    (``pipeline/overlap.py``); False runs torch's schedules as they are. PipeDream
    posts its receives ahead always."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "schedule", Schedule(str(self.schedule).lower()))
        except ValueError:
            raise PipelineError(
                f"unknown pipeline schedule {self.schedule!r}; expected one of "
                + ", ".join(repr(s.value) for s in Schedule)
            ) from None
        whole("microbatches", self.microbatches, least=1, error=PipelineError)
        if self.stages is not None:
            whole("stages", self.stages, least=1, error=PipelineError)
        whole("virtual_stages", self.virtual_stages, least=1, error=PipelineError)
        if self.balance not in ("parameters", "time"):
            raise PipelineError(
                f"unknown balance {self.balance!r}; expected 'parameters' or 'time'"
            )
        for name in ("two_bw", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise PipelineError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.two_bw and self.schedule is not Schedule.PIPEDREAM:
            raise PipelineError(
                f"two_bw is PipeDream-2BW; the {self.schedule.value!r} schedule already "
                "updates once per batch"
            )
        if self.split is not None:
            listed("split", self.split, "split points", error=PipelineError)
            points = tuple(self.split)
            for point in points:
                if isinstance(point, bool) or not isinstance(point, int | str):
                    raise PipelineError(
                        f"split point {point!r} is neither a child's index nor its name"
                    )
            object.__setattr__(self, "split", points)

    @property
    def chunks_per_task(self) -> int:
        """Model chunks one task holds: ``virtual_stages`` when interleaved, else 1."""
        return self.virtual_stages if self.schedule is Schedule.INTERLEAVED else 1


def check_microbatches(rows: int, microbatches: int) -> int:
    """Rows per micro-batch of a batch of ``rows``.

    Raises:
        PipelineError: ``microbatches`` does not divide ``rows``.
    """
    if rows % microbatches:
        raise PipelineError(
            f"{microbatches} micro-batches do not divide a batch of {rows} rows; use a "
            f"batch size that is a multiple of {microbatches} per pipeline"
        )
    return rows // microbatches
