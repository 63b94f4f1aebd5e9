"""Cutting an ``nn.Sequential`` into consecutive chunks: by split points, by the tasks of
``cf.device`` blocks, or balanced by parameters or measured time.

A chunk is a run of the model's children, ``range(begin, end)``; every chunk must hold
at least one child. Pure functions over counts and costs, so every rule is tested
without processes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from clusterflow.cluster import TaskId
from clusterflow.strategies.pipeline.api import PipelineError

__all__ = [
    "balanced",
    "by_owner",
    "by_points",
    "children_of",
    "measure_times",
    "owners",
    "parameter_costs",
]

Bounds = list[range]


def children_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in the order they run.

    Raises:
        PipelineError: the model is not an ``nn.Sequential`` (its order is unknown).
    """
    if not isinstance(model, nn.Sequential):
        raise PipelineError(
            f"PipelineStrategy cuts an nn.Sequential (its children run in order); got "
            f"{type(model).__name__}: wrap the layers in nn.Sequential"
        )
    return list(model.named_children())


def _check_count(layers: int, chunks: int) -> None:
    if layers < chunks:
        raise PipelineError(
            f"the model has {layers} layer{'s' if layers != 1 else ''}, too few for "
            f"{chunks} pipeline stages: every stage needs at least one"
        )


def by_points(points: Sequence[int | str], names: Sequence[str], chunks: int) -> Bounds:
    """Chunks that begin at each split point (a child's index or name).

    Raises:
        PipelineError: a point names no child, the points are not increasing, their
            count is not ``chunks - 1``, or a chunk would be empty.
    """
    indices: list[int] = []
    for point in points:
        if isinstance(point, str):
            if point not in names:
                raise PipelineError(f"split point {point!r} names no layer of the model")
            indices.append(list(names).index(point))
        else:
            indices.append(point)
    if len(indices) != chunks - 1:
        raise PipelineError(
            f"split {list(points)} makes {len(indices) + 1} stages; the pipeline has "
            f"{chunks}: give {chunks - 1} split points"
        )
    edges = [0, *indices, len(names)]
    for stage, (begin, end) in enumerate(itertools.pairwise(edges)):
        if not 0 <= begin < end <= len(names):
            raise PipelineError(
                f"split {list(points)} leaves stage {stage} empty (layers {begin}..{end} "
                f"of {len(names)}): split points must increase strictly within 1..{len(names) - 1}"
            )
    return [range(b, e) for b, e in itertools.pairwise(edges)]


def by_owner(owners: Sequence[int | None], chunks: int) -> Bounds:
    """Chunks from each layer's stage (``cf.device`` blocks); an unplaced layer stays
    with the layer before it (the first with stage 0).

    Raises:
        PipelineError: the stages go backwards, name a stage out of range, or leave one
            empty.
    """
    stages: list[int] = []
    for layer, owner in enumerate(owners):
        stage = owner if owner is not None else (stages[-1] if stages else 0)
        if not 0 <= stage < chunks:
            raise PipelineError(
                f"layer {layer} was built for stage {stage}, but the pipeline has {chunks}"
            )
        if stages and stage < stages[-1]:
            raise PipelineError(
                f"layer {layer} was built for stage {stage} after a layer of stage "
                f"{stages[-1]}: cf.device blocks must follow the stages in order"
            )
        stages.append(stage)
    for stage in range(chunks):
        if stage not in stages:
            raise PipelineError(
                f"the cf.device blocks leave stage {stage} empty: no layer was built for it"
            )
    return [range(stages.index(s), len(stages) - stages[::-1].index(s)) for s in range(chunks)]


def balanced(costs: Sequence[float], chunks: int) -> Bounds:
    """Consecutive chunks whose largest total cost is as small as can be.

    The linear-partition dynamic program: ``best[k][i]`` is the smallest largest chunk
    cost of the first ``i`` layers cut into ``k`` chunks. Ties keep earlier chunks short.

    Raises:
        PipelineError: fewer layers than chunks.
    """
    n = len(costs)
    _check_count(n, chunks)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    edges = [n]
    for k in range(chunks, 0, -1):
        edges.append(cut[k][edges[-1]])
    edges.reverse()
    return [range(b, e) for b, e in itertools.pairwise(edges)]


def parameter_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Each layer's parameter count (at least 1, so parameter-free layers spread too)."""
    return [float(max(1, sum(p.numel() for p in layer.parameters()))) for layer in layers]


def measure_times(
    layers: Sequence[nn.Module], example: torch.Tensor, repeats: int = 3
) -> list[float]:
    """Each layer's measured forward and backward seconds on ``example`` (best of
    ``repeats``), passing each layer's output to the next."""
    times: list[float] = []
    value = example.detach()
    for layer in layers:
        best = float("inf")
        out = value
        for _ in range(repeats):
            given = value.detach().requires_grad_(value.is_floating_point())
            started = time.perf_counter()
            out = layer(given)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            best = min(best, time.perf_counter() - started)
        layer.zero_grad(set_to_none=True)
        times.append(best)
        value = out.detach()
    return times


def owners(
    modules: Sequence[nn.Module],
    placed: Mapping[int, TaskId],
    stage_of: Callable[[TaskId], int],
) -> list[int | None]:
    """Each layer's stage from the ``cf.device`` blocks it was built in (None: none)."""
    owners: list[int | None] = []
    for index, module in enumerate(modules):
        tasks = {placed[id(m)] for m in module.modules() if id(m) in placed}
        if len(tasks) > 1:
            raise PipelineError(
                f"layer {index} was built under several cf.device blocks "
                f"({', '.join(sorted(str(t) for t in tasks))}); a layer runs on one task"
            )
        owners.append(stage_of(tasks.pop()) if tasks else None)
    return owners
