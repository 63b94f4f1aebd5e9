"""Where each rank sits: which pipeline, which stage, which model chunks (pure values).

Rank ``r`` of ``W`` replicas with ``S`` stages per pipeline is stage ``r % S`` of
pipeline ``r // S``: a pipeline's stages are consecutive ranks (consecutive tasks), and
the same stage of every pipeline forms a data-parallel group whose gradients are
averaged. Under the interleaved schedule a task holds ``v`` chunks: chunk ``c`` of
``S * v`` sits on stage ``c % S`` (torch's loop order).
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.strategies.pipeline.api import PipelineError

__all__ = ["Layout"]


@dataclass(frozen=True, slots=True)
class Layout:
    """One rank's place in the pipelines.

    Raises:
        PipelineError: from :meth:`of`, for more stages than tasks, or a stage count
            that does not divide the tasks.
    """

    rank: int
    world: int
    stages: int
    chunks_per_task: int = 1

    @classmethod
    def of(cls, rank: int, world: int, stages: int | None, chunks_per_task: int = 1) -> Layout:
        count = world if stages is None else stages
        if count > world:
            raise PipelineError(
                f"stages={count} but the cluster has {world} replica task"
                f"{'s' if world != 1 else ''}: each stage needs a task of its own"
            )
        if world % count:
            raise PipelineError(
                f"stages={count} does not divide the {world} replica tasks into whole "
                f"pipelines; use a divisor of {world}"
            )
        return cls(rank, world, count, chunks_per_task)

    @property
    def pipelines(self) -> int:
        return self.world // self.stages

    @property
    def pipeline(self) -> int:
        return self.rank // self.stages

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def chunks(self) -> int:
        """Model chunks in one pipeline."""
        return self.stages * self.chunks_per_task

    def my_chunks(self) -> list[int]:
        return [c for c in range(self.chunks) if c % self.stages == self.stage]

    def owner(self, chunk: int, pipeline: int | None = None) -> int:
        """The global rank holding ``chunk`` in ``pipeline`` (default: this rank's)."""
        base = (self.pipeline if pipeline is None else pipeline) * self.stages
        return base + chunk % self.stages

    def pipeline_ranks(self, pipeline: int) -> list[int]:
        return list(range(pipeline * self.stages, (pipeline + 1) * self.stages))

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage, self.world, self.stages))

    @property
    def first(self) -> int:
        return self.owner(0)

    @property
    def last(self) -> int:
        return self.owner(self.chunks - 1)
