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


def test_the_first_stage_sends_its_first_forward_before_it_posts_any_receive() -> None:
    """The first stage's receives (gradients only) wait until its first forward is on
    its way to the stage that waits for it; elsewhere they go first, as before."""
    from clusterflow.strategies.pipeline.overlap import receives_after_first_send

    RECV_B, SEND_B = _ComputationType.RECV_B, _ComputationType.SEND_B
    first = [
        _Action(0, F, 0),
        _Action(0, SEND_F, 0),
        _Action(0, F, 1),
        _Action(0, SEND_F, 1),
        _Action(0, RECV_B, 0),
        _Action(0, B, 0),
        _Action(0, RECV_B, 1),
        _Action(0, B, 1),
    ]
    assert _names(receives_after_first_send(first)) == (
        "0F0 0SEND_F0 0RECV_B0 0RECV_B1 0F1 0SEND_F1 0B0 0B1"
    )
    middle = [
        _Action(1, RECV_F, 0),
        _Action(1, F, 0),
        _Action(1, SEND_F, 0),
        _Action(1, RECV_F, 1),
        _Action(1, F, 1),
    ]
    assert receives_after_first_send(middle) == receives_first(middle)
    last = [_Action(1, RECV_F, 0), _Action(1, F, 0), _Action(1, B, 0), _Action(1, SEND_B, 0)]
    assert receives_after_first_send(last) == receives_first(last)


@pytest.mark.parametrize(("rows", "m"), [(16, 4), (10, 4), (7, 7), (9, 2)])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_one_tensor_splits_into_the_views_torchs_generic_split_makes(
    rows: int, m: int, requires_grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OverlappedSingle._split_inputs`` skips torch's walk over the arguments for one
    tensor; the micro-batches must be the very views torch's split gives (uneven
    sizes included), or the results would change."""
    import torch
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from clusterflow.strategies.pipeline.overlap import OverlappedSingle

    schedule = OverlappedSingle.__new__(OverlappedSingle)  # no stage, no process group
    schedule._n_microbatches = m
    schedule._args_chunk_spec = None
    schedule._kwargs_chunk_spec = None
    x = torch.randn(rows, 3, requires_grad=requires_grad)
    expected_args, expected_kwargs = split_args_kwargs_into_chunks((x,), {}, m)

    def generic(*args: object) -> object:
        raise AssertionError("torch's generic split ran for one tensor")

    monkeypatch.setattr(schedules, "split_args_kwargs_into_chunks", generic)
    args, kwargs = schedule._split_inputs((x,), {})
    assert kwargs == expected_kwargs
    assert len(args) == len(expected_args) == m
    for (got,), (want,) in zip(args, expected_args, strict=True):
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.data_ptr() == want.data_ptr()
        assert got.retains_grad == want.retains_grad == requires_grad


def test_anything_but_one_tensor_takes_torchs_own_split() -> None:
    import torch
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from clusterflow.strategies.pipeline.overlap import OverlappedSingle

    schedule = OverlappedSingle.__new__(OverlappedSingle)
    schedule._n_microbatches = 2
    schedule._args_chunk_spec = None
    schedule._kwargs_chunk_spec = None
    x, mask = torch.randn(4, 3), torch.ones(4)
    args, kwargs = schedule._split_inputs((x,), {"mask": mask})
    expected_args, expected_kwargs = split_args_kwargs_into_chunks((x,), {"mask": mask}, 2)
    assert [a[0].data_ptr() for a in args] == [a[0].data_ptr() for a in expected_args]
    assert [k["mask"].data_ptr() for k in kwargs] == [k["mask"].data_ptr() for k in expected_kwargs]
