"""The synchronous schedules' batch mean (``strategies/pipeline/sync.py``): where the
number of micro-batches ``m`` is a power of two, each micro-batch's loss carries the
``1/m`` and torch makes no pass over the gradients to divide them; the gradients are
the very bits torch's division after the last backward gives. Elsewhere torch divides,
as before, since the two orders may differ in the last place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clusterflow.strategies.pipeline.sync import _loss_scale


def _grads(m: int, scale: float | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5))
    x, y = torch.randn(m * 7, 12), torch.randint(0, 5, (m * 7,))
    for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
        loss = nn.functional.cross_entropy(model(xs), ys)
        (loss if scale is None else loss * scale).backward()
    if scale is None:  # torch's scale_grads: every gradient divided after the last backward
        for p in model.parameters():
            assert p.grad is not None
            p.grad.div_(m)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_a_power_of_two_rides_on_the_loss_for_the_same_bits(m: int) -> None:
    scale = _loss_scale(m)
    assert scale == 1 / m
    for folded, divided in zip(_grads(m, scale), _grads(m, None), strict=True):
        assert torch.equal(folded, divided)


@pytest.mark.parametrize("m", [3, 5, 6, 12])
def test_other_counts_leave_the_division_to_torch(m: int) -> None:
    assert _loss_scale(m) is None
    # Why: here the 1/m on the loss gives other bits than torch's division.
    folded, divided = _grads(m, 1 / m), _grads(m, None)
    assert not all(torch.equal(a, b) for a, b in zip(folded, divided, strict=True))
