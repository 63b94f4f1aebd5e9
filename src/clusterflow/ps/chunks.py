"""A large variable stepped chunk by chunk, straight from the frames its gradient came in.

A gradient over ``codec.WHOLE_BYTES`` travels in frames of ``codec.FRAME_BYTES``. A
torch optimizer wants one gradient tensor per parameter, so the ps used to join the
frames into one buffer first: a full copy of the push, in series with the rest (3.5 ms
of a 64 MiB push's ~43 ms round trip here, ``benchmarks._ps_phases``). Instead the ps
builds its optimizer over *chunks* of each large variable: flat views of
``FRAME_BYTES`` each, laid where a float32 gradient's frames fall. The gradient of a
chunk is then a view of the received frame (a bfloat16 frame covers two chunks; its
cast is one per frame), and the step reads each frame where ZeroMQ put it. Chunked, the
step is faster as well: a chunk's variable, slots and gradient stay in cache through
the update (3.7 against 5.0 ms for SGD over 64 MiB on this machine).

It is exact: every optimizer the ps runs is element-wise (``optimizer.SUPPORTED``), so
an element's update reads that element alone, whichever chunk holds it; chunked and
whole steps agree bit for bit (``tests/unit/test_ps_stream.py``). Checkpoints keep the
whole-variable layout (``join_slots``, ``split_slots``), so a ps restores from one
written with or without chunks.

A chunk is a view: when a reply in flight makes the store move a variable to a copy
(``ps/loans.py``), ``repoint`` moves its chunks with it, the same tensor objects, so the
optimizer keeps its params and state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from clusterflow.rpc.codec import FRAME_BYTES, WHOLE_BYTES, Framed

Grad = torch.Tensor | Framed
"""A gradient as it reaches the store: whole, or the frames it came in."""


def bounds(var: torch.Tensor) -> list[tuple[int, int]]:
    """The chunks of ``var``, as ``[start, stop)`` element ranges of its flat view.

    A variable that travels in one frame (up to ``WHOLE_BYTES``) is one chunk: cutting
    it would only add per-parameter work to the optimizer's step.
    """
    numel = var.numel()
    if numel * var.element_size() <= WHOLE_BYTES:
        return [(0, numel)]
    step = FRAME_BYTES // var.element_size()
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def params(var: torch.Tensor) -> list[torch.Tensor]:
    """The optimizer's parameters for ``var``: itself, or one flat view per chunk."""
    spans = bounds(var)
    if len(spans) == 1:
        return [var]
    flat = var.view(-1)
    return [flat[a:b] for a, b in spans]


def repoint(var: torch.Tensor, chunks: Sequence[torch.Tensor]) -> None:
    """Points ``chunks`` (``params(var)``, made before ``var`` moved) at ``var``'s memory."""
    if len(chunks) == 1 and chunks[0] is var:
        return
    storage, base = var.untyped_storage(), var.storage_offset()
    with torch.no_grad():
        for (a, b), chunk in zip(bounds(var), chunks, strict=True):
            chunk.set_(storage, base + a, (b - a,), (1,))


def cast(grad: Grad, dtype: torch.dtype) -> Grad:
    """``grad`` in ``dtype`` (a bfloat16 push onto float32 variables): frame by frame."""
    if grad.dtype == dtype:
        return grad
    if isinstance(grad, Framed):
        return Framed(grad.shape, dtype, [piece.to(dtype) for piece in grad.pieces])
    return grad.to(dtype)


def split(grad: Grad, var: torch.Tensor) -> list[torch.Tensor]:
    """``grad`` cut as ``params(var)`` is: views of its frames (or of it, when whole).

    A chunk whose elements straddle two frames (a sender that cut at other sizes than
    ``FRAME_BYTES``) is joined from its parts, a copy of that chunk alone.
    """
    spans = bounds(var)
    if len(spans) == 1:
        whole = grad.join() if isinstance(grad, Framed) else grad
        return [whole.reshape(var.shape)]
    if not isinstance(grad, Framed):
        flat = grad.reshape(-1)
        return [flat[a:b] for a, b in spans]
    out: list[torch.Tensor] = []
    pieces, starts = grad.pieces, grad.starts
    k = 0  # the piece holding the chunk's first element
    for a, b in spans:
        while starts[k] + pieces[k].numel() <= a:
            k += 1
        if b <= starts[k] + pieces[k].numel():
            out.append(pieces[k][a - starts[k] : b - starts[k]])
            continue
        parts, at, j = [], a, k
        while at < b:
            end = min(b, starts[j] + pieces[j].numel())
            parts.append(pieces[j][at - starts[j] : end - starts[j]])
            at, j = end, j + 1
        out.append(torch.cat(parts))
    return out


def all_finite(grad: Grad, check: Any) -> bool:
    """``check`` (a finite test of one tensor) over every frame of ``grad``."""
    if isinstance(grad, Framed):
        return all(check(piece) for piece in grad.pieces)
    return bool(check(grad))


def join_slots(var: torch.Tensor, slots: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One variable's optimizer state, its chunks' joined into the whole-variable layout
    (a copy: the checkpoint's own).

    A per-element slot (momentum, Adam's moments) is the chunks' slots end to end, in
    ``var``'s shape; a 0-d tensor (Adam's ``step``) and a scalar are the same in every
    chunk (they step together), so the first chunk's stands for all.
    """
    if len(slots) == 1:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in slots[0].items()}
    out: dict[str, Any] = {}
    for key, first in slots[0].items():
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            out[key] = torch.cat([s[key].reshape(-1) for s in slots]).view(var.shape)
        else:
            out[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return out


def split_slots(var: torch.Tensor, slots: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``join_slots`` undone: each chunk's state, per-element slots as views of a copy,
    0-d tensors copied per chunk (each chunk's ``step`` advances on its own)."""
    spans = bounds(var)
    if len(spans) == 1:
        return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in slots.items()}]
    out: list[dict[str, Any]] = [{} for _ in spans]
    for key, value in slots.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            flat = value.clone().reshape(-1)
            for chunk, (a, b) in zip(out, spans, strict=True):
                chunk[key] = flat[a:b]
        else:
            for chunk in out:
                chunk[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out
