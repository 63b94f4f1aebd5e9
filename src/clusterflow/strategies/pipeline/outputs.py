"""The last stage's outputs on every stage of a pipeline, without a barrier at the step's end.

``fit`` reads a step's loss and outputs on every task (its metrics, the chief's log), and
only the last stage computes the outputs. They used to travel by a blocking broadcast
after the last stage's whole step (its last backward and its update): a collective that
every stage entered at its step's end and left only when the last stage got there. For
the synchronous schedules that costs little (the first stage's last backward waits for
the last stage's anyway), but for PipeDream it was a barrier at every step's end:
stage 0, whose step ends after its backward of the next-to-last micro-batch, waited for
the last stage's forward *and* backward of the last one, the very flush PipeDream has
none of (with 2 micro-batches on 2 stages a third of the step; see docs/pipeline.md).

So the last stage sends the outputs (``isend``) to each other stage of its pipeline as
soon as the batch's last forward has run, and the others post their receive at the
step's start (a gloo send to a peer whose receive is not posted waits for it) and wait
for it at the step's end. PipeDream's last stage sends before its last backward, the
synchronous schedules after their step.

The messages use their own tag (``TAG``), so they never match a receive of the
schedules' activations or gradients, which travel between the same pairs of ranks
with tag 0; between two ranks each tag's messages match in the order they were posted,
so step ``k``'s receive gets step ``k``'s outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from clusterflow.strategies.pipeline.layout import Layout

__all__ = ["TAG", "OutputShare"]

TAG = 1
"""The outputs' tag: the schedules' own point-to-point messages use 0."""


class OutputShare:
    """One pipeline's outputs, from its last stage to its other stages, once per step.

    Order of calls, every step, on every rank of the pipeline: :meth:`expect` at the
    step's start (posts the receive; a no-op on the last stage), :meth:`send` on the last
    stage once the batch's outputs exist, :meth:`result` at the step's end. :meth:`drain`
    before the process group goes away (waits for the sends).
    """

    def __init__(
        self, layout: Layout, group: dist.ProcessGroup | None, device: torch.device
    ) -> None:
        self._device = device
        self._last = layout.last
        self._group = group
        self._is_last = layout.rank == layout.last
        self._peers = [r for r in layout.pipeline_ranks(layout.pipeline) if r != layout.last]
        self._posted: tuple[Any, torch.Tensor] | None = None
        self._sent: list[tuple[Any, torch.Tensor]] = []
        self._outputs: torch.Tensor | None = None

    def expect(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Posts this step's receive of the outputs (``shape``, ``dtype``); on the last
        stage, forgets the last step's outputs."""
        self._outputs = None
        if self._is_last:
            return
        buffer = torch.empty(shape, dtype=dtype, device=self._device)
        self._posted = (dist.irecv(buffer, src=self._last, group=self._group, tag=TAG), buffer)

    def send(self, outputs: torch.Tensor) -> None:
        """The last stage: starts this step's outputs towards every other stage (returns
        at once; the sends complete while the stage goes on computing)."""
        sent = outputs.detach().contiguous()
        self._outputs = sent
        self._sent = [(w, t) for w, t in self._sent if not w.is_completed()]
        for peer in self._peers:
            self._sent.append((dist.isend(sent, dst=peer, group=self._group, tag=TAG), sent))

    def result(self) -> torch.Tensor:
        """This step's outputs: the last stage's own, or, elsewhere, the received ones
        (waits for them).

        Raises:
            RuntimeError: from torch's receive, when the last stage died or hung.
        """
        if self._is_last:
            if self._outputs is None:
                raise RuntimeError("the last stage finished a step without its outputs")
            return self._outputs
        if self._posted is None:
            raise RuntimeError("the outputs' receive was not posted at the step's start")
        work, buffer = self._posted
        self._posted = None
        work.wait()
        return buffer

    def drain(self) -> None:
        """Waits for every send still in flight."""
        for work, _ in self._sent:
            work.wait()
        self._sent.clear()
