"""Replies that send a ps's live variables, and the copy a writer makes while they do.

A push that wants the values back (the async step's one round trip) or a pull used to
reply with a snapshot of the variables: ZeroMQ sends a reply's tensors from their
memory after the handler returned, so the next push applying in place would tear it.
The snapshot was a full copy per reply (a third of a 64 MiB push's time on the ps).

Now a reply lends the variables themselves: the store records a ``Loan`` for every
variable in it, and ``Response.on_sent`` hands the loan ZeroMQ's tracker of the
reply's frames. A writer first asks ``LoanBook.make_writable``: when every loan of
that variable is back (the bytes left), it writes in place; otherwise it moves the
variable to a copy (``Tensor.set_``: the same tensor object, so the optimizer's
params and state stay attached) and the reply keeps reading the old memory, which
nobody writes any more. The copy is paid only when a write meets a reply still in
flight; a loan that is never sent (a failed reply) only costs that one copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from clusterflow.rpc.pool import RECEIVE_POOL


def pooled_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in a recycled buffer: fresh pages cost more than the copy (rpc/pool.py)."""
    if tensor.numel() * tensor.element_size() < (1 << 20):
        return tensor.clone()
    out = RECEIVE_POOL.take(tensor.numel() * tensor.element_size())
    copy = out.view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy


class Loan:
    """One reply's claim on the variables it sends: out until ZeroMQ released them."""

    __slots__ = ("_tracker",)

    def __init__(self) -> None:
        self._tracker: Any = None

    def sent(self, tracker: Any) -> None:
        """``Response.on_sent``: ``tracker.done`` says when the bytes have left."""
        self._tracker = tracker

    @property
    def returned(self) -> bool:
        tracker = self._tracker
        return tracker is not None and bool(tracker.done)


class LoanBook:
    """The loans out on each variable of one store; the store's lock guards it."""

    def __init__(self) -> None:
        self._out: dict[str, list[Loan]] = {}

    def lend(self, names: Iterable[str], loan: Loan) -> None:
        for name in names:
            loans = [held for held in self._out.get(name, ()) if not held.returned]
            loans.append(loan)
            self._out[name] = loans

    def make_writable(self, name: str, var: torch.Tensor) -> bool:
        """Makes ``var`` safe to write in place; True when that took a copy.

        No reply in flight reads its memory afterwards: either every loan was back, or
        ``var`` now lives in a copy and the replies keep the old memory to themselves.
        """
        loans = self._out.pop(name, None)
        if not loans or all(loan.returned for loan in loans):
            return False
        fresh = pooled_copy(var)
        with torch.no_grad():
            var.set_(fresh.untyped_storage(), fresh.storage_offset(), fresh.shape, fresh.stride())
        return True

    def out(self, name: str) -> bool:
        """Whether a reply may still be reading ``name``'s memory (tests, stats)."""
        return any(not loan.returned for loan in self._out.get(name, ()))
