"""The synchronous schedules with every receive posted ahead of the compute it feeds.

torch's ``Schedule1F1B`` and ``ScheduleGPipe`` post a micro-batch's receive right before
its compute and wait for it there, and 1F1B waits for its last send together with the
next receive: the transfer runs in series with the compute on both ends. Here each
schedule computes in the order torch's schedule does (GPipe and 1F1B written out below;
interleaved: torch's own), lowered to communication actions by torch's own
``_add_send_recv``, and then every receive of the step moves to the step's start:

* a receive is an ``irecv``; its wait stays where torch put it, before the compute
  that reads it, so the order in which each rank computes, and so the result, is
  unchanged (each micro-batch has its own buffers);
* the receives between two ranks keep their order, which is the order their sends
  come in, so each matches the same send as before;
* sends are ``isend``s waited for at the step's end (torch's runtime), so a stage that
  sent goes on computing while the bytes travel.

So while a stage computes micro-batch ``i``, the activations of ``i + 1`` (and the
gradients the next stage sends back) arrive into buffers already posted.

This leans on ``_PipelineScheduleRuntime``, a private class of torch 2.13
(``torch.distributed.pipelining.schedules``), the runtime torch's interleaved and
zero-bubble schedules run on; the pin in ``ci/constraints.txt`` holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import (
    RECV_B,
    RECV_F,
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
)

__all__ = [
    "OverlappedInterleaved1F1B",
    "OverlappedSingle",
    "gpipe_order",
    "one_f_one_b_order",
    "receives_first",
]

F = _ComputationType.FORWARD
B = _ComputationType.FULL_BACKWARD


def receives_first(actions: list[_Action]) -> list[_Action]:
    """One rank's actions with every receive moved to the front, in its own order."""
    receives = [a for a in actions if a.computation_type in (RECV_F, RECV_B)]
    return receives + [a for a in actions if a.computation_type not in (RECV_F, RECV_B)]


def gpipe_order(stage: int, microbatches: int) -> list[_Action]:
    """GPipe: every forward, then every backward, as ``ScheduleGPipe`` runs them."""
    forwards = [_Action(stage, F, m) for m in range(microbatches)]
    return forwards + [_Action(stage, B, m) for m in range(microbatches)]


def one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[_Action]:
    """1F1B as ``Schedule1F1B._step_microbatches`` runs it: ``stages - stage`` warm-up
    forwards, then a backward and a forward in turn, then the remaining backwards.

    Written here because torch's ``Schedule1F1B.pipeline_order`` (which only its
    visualiser reads) numbers the last stage's forwards from 1, not 0.
    """
    warmup = min(microbatches, stages - stage)
    order = [_Action(stage, F, m) for m in range(warmup)]
    forward = warmup
    for backward in range(microbatches):
        order.append(_Action(stage, B, backward))
        if forward < microbatches:
            order.append(_Action(stage, F, forward))
            forward += 1
    return order


class _ReceivesFirst(_PipelineScheduleRuntime):
    """Lowers a compute order as torch does, then posts every receive first."""

    def _prepare_schedule_with_comms(self, actions: Any, format: Any = "compute_only") -> None:
        super()._prepare_schedule_with_comms(actions, format)
        self.pipeline_order_with_comms = {
            rank: receives_first(order) for rank, order in self.pipeline_order_with_comms.items()
        }


class OverlappedSingle(_ReceivesFirst):
    """GPipe or 1F1B over one stage per rank, receives posted ahead (module docstring)."""

    def __init__(
        self, stage: PipelineStage, microbatches: int, loss_fn: Callable[..., Any], *, gpipe: bool
    ) -> None:
        super().__init__([stage], microbatches, loss_fn=loss_fn)  # type: ignore[no-untyped-call]
        stages = stage.num_stages
        self.pipeline_order = {
            rank: list(
                gpipe_order(rank, microbatches)
                if gpipe
                else one_f_one_b_order(rank, stages, microbatches)
            )
            for rank in range(stages)
        }
        self._prepare_schedule_with_comms(self.pipeline_order)


class OverlappedInterleaved1F1B(_ReceivesFirst, ScheduleInterleaved1F1B):
    """torch's interleaved 1F1B, receives posted ahead (module docstring)."""
