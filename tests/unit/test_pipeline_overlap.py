"""The orders the overlapped schedules compute in (``strategies/pipeline/overlap.py``).

They must be torch's: GPipe every forward then every backward; 1F1B ``stages - stage``
warm-up forwards, then one backward and one forward in turn. And moving the receives
first must keep every other action, and the receives' own order, as they were.
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from clusterflow.strategies.pipeline.overlap import gpipe_order, one_f_one_b_order, receives_first

F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
RECV_F, SEND_F = _ComputationType.RECV_F, _ComputationType.SEND_F


def _names(actions: list[_Action]) -> str:
    return " ".join(str(a) for a in actions)


def test_gpipe_runs_every_forward_then_every_backward() -> None:
    assert _names(gpipe_order(1, 3)) == "1F0 1F1 1F2 1B0 1B1 1B2"


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (0, "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"),  # 3 warm-up forwards
        (1, "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3"),
        (2, "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"),  # the last stage alternates at once
    ],
)
def test_1f1b_warms_up_stages_minus_stage_forwards_then_alternates(
    stage: int, expected: str
) -> None:
    assert _names(one_f_one_b_order(stage, 3, 4)) == expected


def test_fewer_micro_batches_than_warm_up_slots_runs_them_all_once() -> None:
    order = one_f_one_b_order(0, 4, 2)
    assert _names(order) == "0F0 0F1 0B0 0B1"


def test_receives_move_first_in_their_order_and_nothing_else_moves() -> None:
    actions = [
        _Action(1, RECV_F, 0),
        _Action(1, F, 0),
        _Action(1, SEND_F, 0),
        _Action(1, RECV_F, 1),
        _Action(1, F, 1),
    ]
    assert _names(receives_first(actions)) == "1RECV_F0 1RECV_F1 1F0 1SEND_F0 1F1"


def test_the_overlap_fits_this_torch_and_not_one_whose_private_calls_differ() -> None:
    """The plain loop calls torch's private schedule and stage methods; torch 2.11's
    ``_initialize_stages`` takes no target (seen on the GPU machine: a TypeError at the
    first step). Where a call's parameters differ, torch's own schedules run instead."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from clusterflow.strategies.pipeline.overlap import overlap_fits

    assert overlap_fits()  # the pinned torch: CI runs the plain loop

    class Older(_PipelineScheduleRuntime):
        def _initialize_stages(self, args, kwargs):  # type: ignore[no-untyped-def]  # torch 2.11's
            raise AssertionError("never called")

    owners = {"_PipelineScheduleRuntime": Older, "PipelineStage": PipelineStage}
    assert not overlap_fits(owners)
    assert not overlap_fits({"_PipelineScheduleRuntime": object, "PipelineStage": PipelineStage})
