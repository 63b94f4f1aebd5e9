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
gradients the next stage sends back) arrive into buffers already posted. Between stages
on one host the plain loop below sends and receives through shared memory instead of
gloo (``shm_link.ShmLink.batch`` in the place of torch's ``_batch_p2p``).

One exception, in GPipe and 1F1B: the first stage computes and sends its first forward
before it posts anything (``receives_after_first_send``), and the caller's own work for
the step (``OverlappedSingle.step``'s ``prepare``: zeroing the gradients, posting the
outputs' receive) runs there too, not before. Every other stage waits for that first
forward, and the first stage receives nothing (gradients, outputs) before its warm-up
forwards are done; so that work, and the split of the batch into micro-batches
(``OverlappedSingle._split_inputs``, torch's own ``_split_tensor`` without its generic
walk), no longer sits between the first stage's last backward and the next step's
first forward, where the whole pipeline waits.

GPipe and 1F1B (one stage per rank) run that lowered order in a plain loop of torch's
own stage calls (``OverlappedSingle._step_microbatches``) rather than through
``_PipelineScheduleRuntime``'s, which wraps every action (a send, a receive, a no-op
shard action) in a profiler range, a context object and checks for several stages per
rank: about 1 ms of a stage's CPU a step more than torch's ``Schedule1F1B`` in
``benchmarks.pipeline``'s setting (``benchmarks._pipeline_cpu``), on cores the stages
share with their own compute. The interleaved schedule, several stages per rank,
keeps torch's runtime.

This leans on ``_PipelineScheduleRuntime``, a private class of torch 2.13
(``torch.distributed.pipelining.schedules``), the runtime torch's interleaved and
zero-bubble schedules run on; the pin in ``ci/constraints.txt`` holds it. The plain loop
also calls private methods of the schedule and the stage whose parameters changed between
releases (torch 2.11's ``_initialize_stages`` takes no target, and its runtime's sends
failed with gloo's "Bad address" on the GPU machine): where this torch's calls differ
from what the loop passes (``OVERLAP_FITS``), the pipeline runs torch's own public
schedules instead, without the overlap (``SyncEngine``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleInterleaved1F1B,
    microbatch,
)
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.schedules import (
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    _Action,
    _batch_p2p,
    _ComputationType,
    _PipelineScheduleRuntime,
)

from clusterflow.strategies.pipeline.shm_link import ShmLink

__all__ = [
    "OverlappedInterleaved1F1B",
    "OverlappedSingle",
    "gpipe_order",
    "one_f_one_b_order",
    "receives_after_first_send",
    "receives_first",
]

F = _ComputationType.FORWARD
B = _ComputationType.FULL_BACKWARD


def receives_first(actions: list[_Action]) -> list[_Action]:
    """One rank's actions with every receive moved to the front, in its own order."""
    receives = [a for a in actions if a.computation_type in (RECV_F, RECV_B)]
    return receives + [a for a in actions if a.computation_type not in (RECV_F, RECV_B)]


def receives_after_first_send(actions: list[_Action]) -> list[_Action]:
    """The first stage's actions: its first forward and that forward's send, then every
    receive in its own order, then the rest.

    The first stage receives only gradients (and the outputs), none of them before its
    warm-up forwards end, and every other stage waits for its first forward: posting
    the step's receives (about 20 us of CPU each, on a core the stages share) before
    that forward kept the whole pipeline waiting that long. The first gradient comes
    back only after the next stage's forward and backward of micro-batch 0, long after
    the receives are posted, so no send finds its receive missing.
    """
    first_send = next((i for i, a in enumerate(actions) if a.computation_type == SEND_F), None)
    if first_send is None:  # nothing sent before it receives: post them first
        return receives_first(actions)
    head, tail = actions[: first_send + 1], actions[first_send + 1 :]
    if any(a.computation_type in (RECV_F, RECV_B) for a in head):
        return receives_first(actions)
    return head + receives_first(tail)


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


log = logging.getLogger(__name__)

PLAIN_LOOP_CALLS: dict[str, tuple[str, ...]] = {
    "_PipelineScheduleRuntime._check_inputs": ("arg_mbs", "kwarg_mbs", "target_mbs", "losses"),
    "_PipelineScheduleRuntime._initialize_stages": ("args", "kwargs", "target", "loss_kwargs"),
    "_PipelineScheduleRuntime._maybe_compute_loss": (
        "stage",
        "output",
        "target_mbs",
        "mb_index",
        "loss_kwargs",
    ),
    "_PipelineScheduleRuntime._maybe_get_loss": ("stage", "mb_index"),
    "_PipelineScheduleRuntime._update_losses": ("stages", "losses"),
    "PipelineStage.forward_one_chunk": ("fwd_chunk_id", "args", "kwargs", "save_forward_output"),
    "PipelineStage.backward_one_chunk": ("bwd_chunk_id", "loss", "full_backward", "last_backward"),
    "PipelineStage.perform_reduce_grad": ("grad_scale_factor",),
    "_PipelineScheduleRuntime._split_inputs": ("args", "kwargs"),
    "_PipelineScheduleRuntime._prepare_schedule_with_comms": ("actions", "format"),
    "microbatch._split_tensor": ("tensor", "spec", "num_chunks"),
}
"""The private torch calls ``OverlappedSingle._step_microbatches`` makes, with the
parameters it passes them (torch 2.13's, the torch the overlap was built and tested on)."""


def overlap_fits(owners: dict[str, Any] | None = None) -> bool:
    """Whether this torch's private calls take the parameters the plain loop passes
    (``PLAIN_LOOP_CALLS``): where not, the overlapped schedules are not used (module
    docstring). ``owners`` maps the class names to classes (tests)."""
    found = {
        "_PipelineScheduleRuntime": _PipelineScheduleRuntime,
        "PipelineStage": PipelineStage,
        "microbatch": microbatch,
        **(owners or {}),
    }
    for call, wanted in PLAIN_LOOP_CALLS.items():
        owner, _, name = call.partition(".")
        try:
            params = tuple(inspect.signature(getattr(found[owner], name)).parameters)
        except (AttributeError, TypeError, ValueError):
            return False
        if not inspect.ismodule(found[owner]):
            params = params[1:]  # [0] is self
        if params != wanted:
            log.info("torch's %s takes %s: the pipeline runs without the overlap", call, params)
            return False
    return True


OVERLAP_FITS = overlap_fits()


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
        self,
        stage: PipelineStage,
        microbatches: int,
        loss_fn: Callable[..., Any],
        *,
        gpipe: bool,
        scale_grads: bool = True,
        link: ShmLink | None = None,
    ) -> None:
        super().__init__([stage], microbatches, loss_fn=loss_fn, scale_grads=scale_grads)  # type: ignore[no-untyped-call]
        self._p2p: Callable[[list[dist.P2POp]], list[Any]] = (
            _batch_p2p if link is None else link.batch
        )
        stages = stage.num_stages
        self.pipeline_order = {
            rank: list(
                gpipe_order(rank, microbatches)
                if gpipe
                else one_f_one_b_order(rank, stages, microbatches)
            )
            for rank in range(stages)
        }
        self._prepare: Callable[[], None] | None = None
        self._prepare_schedule_with_comms(self.pipeline_order)

    def _prepare_schedule_with_comms(self, actions: Any, format: Any = "compute_only") -> None:
        _PipelineScheduleRuntime._prepare_schedule_with_comms(self, actions, format)
        self.pipeline_order_with_comms = {
            rank: receives_after_first_send(order)
            for rank, order in self.pipeline_order_with_comms.items()
        }

    def step(self, *args: Any, prepare: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """torch's ``step``, plus ``prepare``: the caller's own work for the step that
        nothing before the rank's first receive reads (zeroing the gradients, posting
        the outputs' receive). It runs right before the rank posts its receives, so on
        the first stage after its first forward has been sent, and in any case before
        the first backward; where torch's runtime runs the step (FSDP), first."""
        self._prepare = prepare
        try:
            return super().step(*args, **kwargs)
        finally:
            self._prepare = None

    def _run_prepare(self) -> None:
        prepare, self._prepare = self._prepare, None
        if prepare is not None:
            prepare()

    def _split_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> tuple[list[Any], list[Any]]:
        """One tensor and no keywords (what ``SyncEngine`` passes): its micro-batches by
        torch's own ``_split_tensor``, the very views torch's generic split makes,
        without its walk over the arguments' trees (0.2 ms of the first stage's CPU a
        step in ``benchmarks.pipeline``, between its last backward and its next first
        forward, while the other stages wait)."""
        m = self._n_microbatches
        if (
            len(args) == 1
            and not kwargs
            and type(args[0]) is torch.Tensor
            and args[0].dim() > 0
            and args[0].size(0) >= m
            and self._args_chunk_spec is None
            and self._kwargs_chunk_spec is None
        ):
            chunks = microbatch._split_tensor(args[0], TensorChunkSpec(0), m)  # type: ignore[no-untyped-call]
            return [(chunk,) for chunk in chunks], [{} for _ in chunks]
        return super()._split_inputs(args, kwargs)  # type: ignore[no-untyped-call,no-any-return]

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """This rank's lowered order, run by a plain loop (module docstring): what
        ``_PipelineScheduleRuntime`` does for one stage per rank, action for action."""
        stage = self._stages[0]
        if isinstance(stage.submod, FSDPModule):  # its shard actions are not no-ops
            self._run_prepare()
            # loss_kwargs only where given: torch 2.11's runtime takes no such argument
            more = () if loss_kwargs is None else (loss_kwargs,)
            super()._step_microbatches(  # type: ignore[no-untyped-call]
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, *more
            )
            return
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)  # type: ignore[no-untyped-call]
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)  # type: ignore[no-untyped-call]
        posted: dict[tuple[_ComputationType, int], list[Any]] = {}
        sends: list[Any] = []
        backwards = 0
        for action in self.pipeline_order_with_comms[self.rank]:
            kind, index = action.computation_type, action.microbatch_index
            mb = -1 if index is None else index  # None: a whole-stage action
            if kind in (RECV_F, RECV_B, B):
                self._run_prepare()
            if kind == RECV_F:
                posted[RECV_F, mb] = self._p2p(stage.get_fwd_recv_ops(mb))
            elif kind == RECV_B:
                posted[RECV_B, mb] = self._p2p(stage.get_bwd_recv_ops(mb))
            elif kind == F:
                if not stage.is_first:
                    for work in posted.pop((RECV_F, mb)):  # KeyError: computed before posted
                        work.wait()
                output = stage.forward_one_chunk(
                    mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs
                )
                self._maybe_compute_loss(stage, output, target_mbs, mb, loss_kwargs)  # type: ignore[no-untyped-call]
            elif kind == B:
                if not stage.is_last:
                    for work in posted.pop((RECV_B, mb)):
                        work.wait()
                backwards += 1
                stage.backward_one_chunk(
                    mb,
                    loss=self._maybe_get_loss(stage, mb),  # type: ignore[no-untyped-call]
                    full_backward=True,
                    last_backward=backwards == self._n_microbatches,
                )
            elif kind == SEND_F:
                sends.extend(self._p2p(stage.get_fwd_send_ops(mb)))
            elif kind == SEND_B:
                sends.extend(self._p2p(stage.get_bwd_send_ops(mb)))
            elif kind == REDUCE_GRAD:
                stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)
            elif kind not in (UNSHARD, RESHARD):  # no-ops without FSDP
                raise ValueError(f"{action} is not an action of a one-stage schedule")
        self._run_prepare()  # a step that neither receives nor goes backward
        for work in sends:  # long done, most of them: torch's runtime waits here too
            work.wait()
        self._update_losses(self._stages, losses)  # type: ignore[no-untyped-call]


class OverlappedInterleaved1F1B(_ReceivesFirst, ScheduleInterleaved1F1B):
    """torch's interleaved 1F1B, receives posted ahead (module docstring)."""
