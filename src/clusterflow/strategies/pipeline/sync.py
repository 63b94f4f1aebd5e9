"""The synchronous schedules: torch's ``PipelineStage`` and its GPipe, 1F1B and
interleaved 1F1B schedules, over this rank's chunks of the model.

Nothing of the schedules is written here: torch orders the micro-batches and sends the
activations and gradients between stages. This module builds the stages and schedules
for a micro-batch shape (a new shape, a final partial batch, gets its own, since a stage
sizes its buffers on first use) and translates torch's configuration errors into one
line.

The batch-mean gradient is each micro-batch's mean loss divided by ``m`` (the number of
micro-batches) before its backward, with the schedules' own scaling off
(``scale_grads=False``, the configuration torch documents for a loss that already
carries it), not torch's default of dividing every accumulated gradient by ``m`` after
the last backward: that was a pass over all of a stage's gradients in every step, on
the first stage between its last backward and the next step's first forward, where the
other stages wait for it. Only for ``m`` a power of two, where the gradients are the
same bits either way (scaling by a power of two commutes with every rounding); for other
``m`` torch divides as before, since the two orders may differ in the last place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from clusterflow.strategies.pipeline import overlap as overlapping
from clusterflow.strategies.pipeline.api import PipelineError, Schedule
from clusterflow.strategies.pipeline.layout import Layout
from clusterflow.strategies.pipeline.overlap import OverlappedInterleaved1F1B, OverlappedSingle
from clusterflow.strategies.pipeline.shm_link import ShmLink

__all__ = ["LocalEngine", "SyncEngine"]

LossFn = Callable[[Any, Any], torch.Tensor]


class SyncEngine:
    """Runs one synchronous pipeline step of this rank's stages.

    Call :meth:`step` on every rank of a pipeline with the same batch; on return this
    rank's chunks hold the batch-mean gradients of its pipeline (not yet averaged across
    pipelines, not yet applied).
    """

    def __init__(
        self,
        layout: Layout,
        chunks: Sequence[nn.Module],
        schedule: Schedule,
        microbatches: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        overlap: bool = True,
    ) -> None:
        self._layout = layout
        self._chunks = list(chunks)
        self._schedule = schedule
        self._microbatches = microbatches
        self._group = group
        self._device = device
        self._overlap = overlap
        self._built: dict[tuple[int, ...], Any] = {}
        self._link: ShmLink | None = None
        """Opened by the first overlapped GPipe or 1F1B schedule, shared by the later
        ones (a rank runs one step at a time, and each step ends with its transfers)."""
        self._loss_scale = _loss_scale(microbatches)

    def _build(self, shape: tuple[int, ...], loss_fn: LossFn) -> Any:
        layout = self._layout
        stages: list[Any] = [
            PipelineStage(self._chunks[c], c, layout.chunks, self._device, group=self._group)
            for c in layout.my_chunks()
        ]
        gpipe = self._schedule is Schedule.GPIPE
        # Read at each build: the overlap leans on torch's private calls, which other
        # torch releases take differently (overlap.OVERLAP_FITS).
        overlap = self._overlap and overlapping.OVERLAP_FITS
        try:
            # torch divides the gradients only where the loss does not (module docstring).
            scale = self._loss_scale is None
            m = self._microbatches
            if self._schedule is Schedule.INTERLEAVED:
                kind = OverlappedInterleaved1F1B if overlap else ScheduleInterleaved1F1B
                return kind(stages, m, loss_fn=loss_fn, scale_grads=scale)
            if overlap:
                link = self._open_link(stages[0])
                return OverlappedSingle(
                    stages[0], m, loss_fn, gpipe=gpipe, scale_grads=scale, link=link
                )
            single = ScheduleGPipe if gpipe else Schedule1F1B
            return single(stages[0], m, loss_fn=loss_fn, scale_grads=scale)
        except ValueError as exc:  # torch's own rule, e.g. micro-batches per round
            raise PipelineError(
                f"the {self._schedule.value} schedule cannot run {self._microbatches} "
                f"micro-batches on {layout.stages} stages: {str(exc).splitlines()[0]}"
            ) from None

    def _open_link(self, stage: PipelineStage) -> ShmLink:
        """The shared-memory link to this rank's neighbours on this host, opened once
        (by every rank of the pipeline together: each builds its first schedule in the
        same step). A stage that FSDP shards runs torch's own runtime, which sends
        through the backend, so it offers no link."""
        if self._link is None:
            group = self._group or dist.distributed_c10d._get_default_group()
            ranks = stage.stage_index_to_group_rank
            index = stage.stage_index
            peers = [ranks[i] for i in (index - 1, index + 1) if 0 <= i < stage.num_stages]
            offer = not isinstance(stage.submod, FSDPModule)
            self._link = ShmLink.open(group, peers, offer)
        return self._link

    def linked_peers(self) -> list[int]:
        """The ranks of the pipeline's group this rank reaches through shared memory
        (``shm_link``); empty before the first step or where none could be reached."""
        return [] if self._link is None else self._link.peers

    def actions(self) -> list[list[str]]:
        """This rank's actions in each schedule built so far, in the order it runs them
        (``"1RECV_F0"``: stage 1 receives micro-batch 0's activations); empty for
        torch's own single-stage schedules (``overlap=False``), which keep none."""
        out = []
        for schedule in self._built.values():
            order = getattr(schedule, "pipeline_order_with_comms", None) or {}
            rank = getattr(schedule, "rank", None)  # torch's single-stage ones have none
            out.append([str(action) for action in order.get(rank, [])] if rank is not None else [])
        return out

    def _call_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """A micro-batch's share of the batch-mean loss (module docstring)."""
        loss = self._loss_fn(outputs, targets)
        return loss if self._loss_scale is None else loss * self._loss_scale

    def step(
        self,
        inputs: torch.Tensor,
        targets: Any,
        loss_fn: LossFn,
        prepare: Callable[[], None] | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of every micro-batch of ``inputs``.

        ``prepare``, the caller's work for the step that nothing before this rank's
        first receive reads (zeroing the gradients, posting a receive of its own), runs
        once: in the overlapped GPipe and 1F1B right before the rank posts its receives,
        so on the first stage after its first forward has been sent, off the path every
        other stage waits on (``OverlappedSingle.step``); elsewhere before the step.

        Returns:
            on the rank of the last chunk: the batch's outputs (micro-batches merged);
            elsewhere None.
        """
        # The loss function is looked up at call time, so one schedule serves a run.
        self._loss_fn = loss_fn
        key = tuple(inputs.shape)
        schedule = self._built.get(key)
        if schedule is None:
            schedule = self._built[key] = self._build(key, self._call_loss)
        layout = self._layout
        mine = layout.my_chunks()
        args = (inputs,) if 0 in mine else ()
        if isinstance(schedule, OverlappedSingle):
            kwargs: dict[str, Any] = {"prepare": prepare}
        else:
            kwargs = {}
            if prepare is not None:
                prepare()
        if layout.chunks - 1 in mine:
            return schedule.step(*args, target=targets, **kwargs).detach()  # type: ignore[no-any-return]
        schedule.step(*args, **kwargs)
        return None


def _loss_scale(microbatches: int) -> float | None:
    """``1/m`` where the loss can carry it for the same bits (``m`` a power of two)."""
    return 1.0 / microbatches if microbatches & (microbatches - 1) == 0 else None


class LocalEngine:
    """A pipeline of one stage: the micro-batches' gradients accumulated in turn."""

    def __init__(self, chunk: nn.Module, microbatches: int) -> None:
        self._chunk = chunk
        self._microbatches = microbatches

    def step(
        self,
        inputs: torch.Tensor,
        targets: Any,
        loss_fn: LossFn,
        prepare: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """``prepare()`` (as in ``SyncEngine.step``), then every micro-batch's forward and
        backward; returns the outputs, merged."""
        if prepare is not None:
            prepare()
        outputs = []
        for x, y in zip(
            inputs.chunk(self._microbatches), targets.chunk(self._microbatches), strict=True
        ):
            out = self._chunk(x)
            torch.autograd.backward(loss_fn(out, y) / self._microbatches)
            outputs.append(out.detach())
        return torch.cat(outputs)
