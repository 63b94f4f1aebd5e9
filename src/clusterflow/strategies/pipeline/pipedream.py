"""PipeDream: asynchronous 1F1B without a flush, with weight stashing (torch has none).

Each micro-batch is an update of its own (PipeDream's "minibatch"). Stage ``s`` of
``p`` runs ``p - s - 1`` forwards ahead (the warm-up), then one forward and one backward
in turn, forever: micro-batches of the next step enter while the last ones are still
in flight, so there is no flush bubble between steps. The price is staleness: by the
time a micro-batch's gradient comes back, the stage has applied the updates of the
micro-batches ahead of it. **Weight stashing** keeps that gradient consistent: the
forward of micro-batch ``i`` runs on a snapshot of the stage's weights (version ``v``),
kept until its backward, which differentiates the very function its forward computed;
the gradient is then applied to the newest weights. A stage keeps at most ``p - s``
snapshots (the last stage none: its backward follows its forward at once).

Order of calls: :meth:`step` on every rank of a pipeline with the same batch (each
rank forwards the micro-batches it has inputs for and backwards those whose gradients
came back); :meth:`drain` on every rank together (before a checkpoint, an evaluation or
the end), which finishes every micro-batch in flight.

Messages: activations go from stage ``s`` to ``s + 1``, gradients back, over the
pipeline group's point-to-point sends (each direction of a pair carries one kind, in
order). Sends are asynchronous and kept until done, so a stage never waits on a
neighbour that is busy with an earlier micro-batch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from clusterflow.strategies.pipeline.layout import Layout

__all__ = ["PipeDreamEngine", "StashRecord"]

_log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StashRecord:
    """What one micro-batch's passes used on one stage (for tests and diagnostics)."""

    microbatch: int
    """The micro-batch's number since the start of the run."""
    forward_version: int
    """The stage's weight version (updates applied) when its forward ran."""
    backward_version: int
    """The version of the weights its backward differentiated (the stash's)."""
    live_version: int
    """The stage's newest version when its backward ran (its gradient is applied to it)."""
    stash_checksum: float
    """Sum of the weights the backward differentiated; equals the forward's snapshot."""
    forward_checksum: float
    """Sum of the weights the forward ran on."""
    live_checksum: float
    """Sum of the stage's newest weights when the backward ran (differs once updates
    came between the micro-batch's forward and its backward)."""


@dataclass(slots=True)
class _InFlight:
    index: int
    version: int
    inputs: torch.Tensor
    outputs: torch.Tensor
    weights: tuple[torch.Tensor, ...]
    checksum: float


class PipeDreamEngine:
    """One stage of an asynchronous, weight-stashing 1F1B pipeline.

    Args:
        layout: this rank's place (its stage and pipeline).
        chunk: this stage's module.
        apply: applies the gradients now in the chunk's ``.grad`` (averages them across
            pipelines and steps the optimizer); called once per micro-batch.
        shapes: every stage's output shape and dtype for a micro-batch's input shape
            (a receiving stage sizes its buffer by its sender's).
        accumulate: micro-batches per update: 1 is PipeDream (an update per
            micro-batch); a batch's count is PipeDream-2BW (their mean gradient is one
            update, so at most two weight versions are alive: the newest, and the one
            the micro-batches still in flight ran on).
        group: the pipeline's process group (its own channels, apart from the world's);
            peers are named by global rank.
        record: keep a :class:`StashRecord` per micro-batch (``records``).
    """

    def __init__(
        self,
        layout: Layout,
        chunk: nn.Module,
        apply: Callable[[], None],
        shapes: Callable[[tuple[int, ...]], list[tuple[torch.Size, torch.dtype]]],
        *,
        group: dist.ProcessGroup | None = None,
        accumulate: int = 1,
        record: bool = False,
    ) -> None:
        self._layout = layout
        self._chunk = chunk
        self._apply = apply
        self._shapes = shapes
        self._names = [n for n, p in chunk.named_parameters() if p.requires_grad]
        self._params = [p for p in chunk.parameters() if p.requires_grad]
        self._buffers = dict(chunk.named_buffers())
        stage, stages = layout.stage, layout.stages
        self._first, self._last = stage == 0, stage == stages - 1
        self._prev = layout.owner(stage - 1) if not self._first else None
        self._next = layout.owner(stage + 1) if not self._last else None
        self.warmup = stages - stage - 1
        """Forwards this stage runs ahead of its backwards."""
        self.version = 0
        """Updates this stage applied."""
        self._forwarded = 0
        self._inflight: deque[_InFlight] = deque()
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self.records: list[StashRecord] | None = [] if record else None
        self.peak_stashes = 0
        self._accumulate = accumulate
        self._group = group
        self._sums: list[torch.Tensor | None] = [None] * len(self._params)
        self._summed = 0
        self._stash: tuple[torch.Tensor, ...] | None = None
        self._stash_version = -1
        self.versions_made = 0
        """Weight snapshots taken (one per version a forward ran on, at most)."""
        # Receives posted ahead, within one step, so that a neighbour's send finds its
        # receive waiting instead of holding the sender (gloo sends to a peer that has
        # not posted its receive cost milliseconds).
        self._next_input: tuple[Any, torch.Tensor] | None = None
        self._next_grad: tuple[Any, torch.Tensor] | None = None

    def step(
        self,
        inputs: torch.Tensor,
        targets: Any,
        loss_fn: LossFn,
        microbatches: int,
        outputs_ready: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Feeds the batch's micro-batches in; runs forwards and the backwards due.

        ``outputs_ready``: on the last stage, called with the batch's outputs (merged)
        as soon as its last forward has run, before that micro-batch's backward, so
        the other stages can have them without waiting for that backward and its
        update (outputs.py).

        Returns:
            on the last stage, the outputs of this batch's micro-batches (merged);
            elsewhere None.
        """
        xs = inputs.chunk(microbatches) if self._first else [None] * microbatches
        ys = _split_targets(targets, microbatches) if self._last else [None] * microbatches
        rows = inputs.shape[0] // microbatches
        shapes = self._shapes((rows, *inputs.shape[1:]))
        outputs: list[torch.Tensor] = []
        merged: torch.Tensor | None = None
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if not self._last and len(self._inflight) + 1 > self.warmup:
                # A backward follows this forward: its gradient may arrive meanwhile.
                grad = torch.empty_like(self._inflight[0].outputs)
                self._next_grad = (dist.irecv(grad, src=self._next, group=self._group), grad)
            out = self._forward(x, shapes, more=i + 1 < microbatches)
            if self._last:
                outputs.append(out.detach())
                if i + 1 == microbatches:
                    merged = torch.cat(outputs)
                    if outputs_ready is not None:
                        outputs_ready(merged)
                self._backward(loss_fn, y)
            elif len(self._inflight) > self.warmup:
                self._backward(loss_fn, None)
            self._reap()
        return merged

    def drain(self) -> None:
        """Runs the backward of every micro-batch in flight and waits for every send.

        Every stage of the pipeline must call it together.
        """
        while self._inflight:
            self._backward(lambda o, t: o, None)
        for work, _ in self._sends:
            if work is not None:
                work.wait()
        self._sends.clear()

    # One forward, one backward -------------------------------------------------------

    def _forward(
        self,
        x: torch.Tensor | None,
        shapes: list[tuple[torch.Size, torch.dtype]],
        *,
        more: bool = False,
    ) -> torch.Tensor:
        index = self._forwarded
        self._forwarded += 1
        stage = self._layout.stage
        if x is None:
            shape, dtype = shapes[stage - 1]
            if self._next_input is not None:
                work, x = self._next_input
                self._next_input = None
                work.wait()
            else:
                x = torch.empty(shape, dtype=dtype)
                dist.recv(x, src=self._prev, group=self._group)
            if more:  # the step's next micro-batch, of the same shape
                following = torch.empty(shape, dtype=dtype)
                work = dist.irecv(following, src=self._prev, group=self._group)
                self._next_input = (work, following)
            x.requires_grad_(x.is_floating_point())
        # The stash: the weights this micro-batch's backward must differentiate. A
        # stage whose backward comes before its next update uses the live weights.
        # Every forward on one version shares one snapshot; the last stage, whose
        # backward follows its forward before any update, runs on the live weights.
        if self._stash is None or self._stash_version != self.version:
            self._stash = tuple(
                p.detach().clone() if self.warmup else p.detach() for p in self._params
            )
            for tensor in self._stash:
                tensor.requires_grad_(True)
            self._stash_version = self.version
            self.versions_made += 1
        stash = self._stash
        weights = {**dict(zip(self._names, stash, strict=True)), **self._buffers}
        out = functional_call(self._chunk, weights, (x,))
        checksum = _checksum(stash) if self.records is not None else 0.0
        self._inflight.append(_InFlight(index, self.version, x, out, stash, checksum))
        self.peak_stashes = max(self.peak_stashes, len(self._inflight))
        if self._next is not None:
            sent = out.detach().contiguous()
            self._sends.append((dist.isend(sent, dst=self._next, group=self._group), sent))
        return out  # type: ignore[no-any-return]

    def _backward(self, loss_fn: LossFn, target: Any) -> None:
        item = self._inflight.popleft()
        if self._last:
            root = loss_fn(item.outputs, target)
            grad_out = None
        else:
            root = item.outputs
            if self._next_grad is not None:
                work, grad_out = self._next_grad
                self._next_grad = None
                work.wait()
            else:
                grad_out = torch.empty_like(item.outputs)
                dist.recv(grad_out, src=self._next, group=self._group)
        wants_input = item.inputs.requires_grad and self._prev is not None
        inputs = [*item.weights, item.inputs] if wants_input else list(item.weights)
        grads = torch.autograd.grad(root, inputs, grad_outputs=grad_out, allow_unused=True)
        if wants_input:
            grad_in = grads[-1]
            sent = (torch.zeros_like(item.inputs) if grad_in is None else grad_in).contiguous()
            self._sends.append((dist.isend(sent, dst=self._prev, group=self._group), sent))
        if self.records is not None:
            self.records.append(
                StashRecord(
                    microbatch=item.index,
                    forward_version=item.version,
                    backward_version=item.version,
                    live_version=self.version,
                    stash_checksum=_checksum(item.weights),
                    forward_checksum=item.checksum,
                    live_checksum=_checksum(self._params),
                )
            )
        for i, grad in enumerate(grads[: len(self._params)]):
            if grad is not None:
                total = self._sums[i]
                self._sums[i] = grad.detach() if total is None else total.add_(grad)
        self._summed += 1
        if self._summed == self._accumulate:
            for param, total in zip(self._params, self._sums, strict=True):
                if total is not None and self._accumulate > 1:
                    total.div_(self._accumulate)
                param.grad = total
            self._sums = [None] * len(self._params)
            self._summed = 0
            self._apply()
            self.version += 1

    def _reap(self) -> None:
        self._sends = [(w, t) for w, t in self._sends if w is not None and not w.is_completed()]


def _split_targets(targets: Any, microbatches: int) -> Sequence[Any]:
    if isinstance(targets, torch.Tensor):
        return targets.chunk(microbatches)
    raise TypeError(f"pipeline targets must be a tensor, got {type(targets).__name__}")


def _checksum(tensors: Sequence[torch.Tensor]) -> float:
    return float(sum(float(t.detach().double().sum()) for t in tensors))
