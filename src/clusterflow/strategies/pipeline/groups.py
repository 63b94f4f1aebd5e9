"""The process groups of a rank's pipeline and of its stage across pipelines."""

from __future__ import annotations

import torch.distributed as dist

from clusterflow.strategies.pipeline.layout import Layout

__all__ = ["subgroups"]


def subgroups(
    layout: Layout,
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's pipeline group and its stage's data-parallel group.

    Every rank creates every group, in the same order (torch's rule for ``new_group``).
    """
    if layout.world == 1:
        return None, None
    pipe = stage = None
    for p in range(layout.pipelines):
        group = dist.new_group(layout.pipeline_ranks(p))
        if p == layout.pipeline:
            pipe = group
    for s in range(layout.stages):
        group = dist.new_group(layout.stage_ranks(s))
        if s == layout.stage:
            stage = group
    return pipe, stage
