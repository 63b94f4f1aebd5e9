"""Cutting read splits into batches, on the training loop's thread.

The reading thread hands over whole splits (read, shuffled, in writable memory); the
``Batcher`` cuts them into batches of ``batch_size`` records, carrying a remainder into
the next split of the same epoch, and collates each batch when it is asked for. Doing
this on the training loop's thread rather than the reading thread is deliberate: under
CPython's GIL, per-batch Python work in a second thread does not run in parallel, it only
adds a thread switch per batch; what does overlap (reading and decoding, which release
the GIL) stays in the background.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clusterflow.data.api import CollateError, Columns, Lease, SplitKey
from clusterflow.data.collate import Collate, find_bad_record, torch_batches, torch_collate


@dataclass(slots=True)
class ReadSplit:
    """A lease's records as read (and shuffled) by the reading thread."""

    lease: Lease
    columns: Columns
    order: np.ndarray | None
    """Record ``i`` of ``columns`` is record ``lease.start + order[i]`` of the source."""
    pos: int = 0
    """Records already cut into batches."""
    key: SplitKey | None = None
    """The split's stable key (``None`` where the reader did not say which split)."""
    views: list[Any] | None = None
    """The collated full batches from record ``views_from`` on, made at once where the
    collate function allows (``torch_batches``); None until the first is cut."""
    views_from: int = 0
    views_size: int = 0
    size: int = field(init=False)
    """Records in the split (``len(lease)``, kept: it is read for every batch)."""
    ids: tuple[int, ...] = field(init=False)
    """``(lease.lease_id,)``: the ``leases`` of a batch cut from this split alone."""

    def __post_init__(self) -> None:
        self.size = len(self.lease)
        self.ids = (self.lease.lease_id,)

    @property
    def remaining(self) -> int:
        return self.size - self.pos


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch for the training step, with the leases it came from.

    ``completes`` are the leases whose last records are in this batch: ack them once
    the update computed from this batch (and the batches before it) is applied.
    """

    data: Any
    """The collated batch: column name -> tensor by default."""
    leases: tuple[int, ...]
    """Every lease with records in this batch (what a parameter-server push carries)."""
    completes: tuple[int, ...]
    """Leases finished by this batch: ackable after its update."""
    epoch: int
    size: int
    """Records in the batch."""
    index: int
    """Position in this client's stream of batches, from 0."""
    keys: tuple[SplitKey, ...] = ()
    """The stable keys of the splits in ``completes`` (same order): what a training
    step passes on (``strategy.run(..., completes=batch.keys)``) so that each split's
    update is applied at most once, however often the split is lent."""

    def __len__(self) -> int:
        return self.size


@dataclass(slots=True)
class _Piece:
    split: ReadSplit
    lo: int
    hi: int


@dataclass(slots=True)
class Batcher:
    """Cuts splits into batches and collates them; see the module docstring."""

    batch_size: int
    collate: Collate
    dataset: str
    """Named in collation errors."""
    next_index: int = 0
    _carry: list[_Piece] = field(default_factory=list)
    _carry_size: int = 0

    @property
    def holding(self) -> bool:
        """Whether records are held back waiting for more to fill a batch."""
        return bool(self._carry)

    def cut(self, split: ReadSplit) -> Batch | None:
        """The next full batch from ``split`` (and records carried before it), or None
        when the split is used up with a partial batch carried over."""
        size = self.batch_size
        if self._carry_size >= size:  # the batch size shrank (set_batch_size) meanwhile
            return self.flush()
        lo = split.pos
        hi = lo + size
        if hi <= split.size and not self._carry:  # the common case, kept lean
            split.pos = hi
            views = split.views
            if views is not None and size == split.views_size:  # made at once
                i, off = divmod(lo - split.views_from, size)
                if not off and i < len(views):
                    return self._of_split(views[i], split, lo, hi)
            return self._single(split, lo, hi)
        while split.remaining:
            take = min(size - self._carry_size, split.remaining)
            self._carry.append(_Piece(split, split.pos, split.pos + take))
            self._carry_size += take
            split.pos += take
            if self._carry_size == size:
                return self.flush()
        return None

    @property
    def held(self) -> int:
        """Records held back waiting for more to fill a batch."""
        return self._carry_size

    def starts_new_epoch(self, split: ReadSplit) -> bool:
        """Whether ``split`` belongs to another epoch than the records held back."""
        return bool(self._carry) and self._carry[0].split.lease.epoch != split.lease.epoch

    def flush(self) -> Batch | None:
        """The records held back as a (smaller) batch, if any."""
        if not self._carry:
            return None
        pieces, size = self._carry, self._carry_size
        self._carry, self._carry_size = [], 0
        if len(pieces) == 1:
            p = pieces[0]
            return self._single(p.split, p.lo, p.hi)
        columns = {
            name: _concat([p.split.columns[name][p.lo : p.hi] for p in pieces])
            for name in pieces[0].split.columns
        }
        data = self._collate(columns, pieces)
        leases = tuple(dict.fromkeys(p.split.lease.lease_id for p in pieces))
        done = [p.split for p in pieces if p.hi == len(p.split.lease)]
        completes = tuple(s.lease.lease_id for s in done)
        keys = tuple(s.key for s in done if s.key is not None)
        return self._batch(data, leases, completes, pieces[0].split.lease.epoch, size, keys)

    def _single(self, split: ReadSplit, lo: int, hi: int) -> Batch:
        data = self._view(split, lo, hi - lo)
        if data is None:
            columns = {name: values[lo:hi] for name, values in split.columns.items()}
            data = self._collate(columns, None, split, lo, hi)
        return self._of_split(data, split, lo, hi)

    def _of_split(self, data: Any, split: ReadSplit, lo: int, hi: int) -> Batch:
        """The batch of records ``[lo, hi)`` of ``split`` alone: it completes the split's
        lease where it ends the split."""
        index = self.next_index
        self.next_index = index + 1
        epoch = split.lease.epoch
        if hi != split.size:
            return Batch(data, split.ids, (), epoch, hi - lo, index)
        keys = (split.key,) if split.key is not None else ()
        return Batch(data, split.ids, split.ids, epoch, hi - lo, index, keys)

    def _view(self, split: ReadSplit, lo: int, size: int) -> Any:
        """Records ``[lo, lo + size)`` of ``split`` collated, from the split's batches
        made at once (``torch_batches``; the default collate only), or None."""
        if self.collate is not torch_collate or size != self.batch_size:
            return None  # a smaller last batch is collated alone
        views = split.views
        if views is None or size != split.views_size or (lo - split.views_from) % size:
            # The first batch of the split, or the batch size changed: make them all.
            views = split.views = torch_batches(split.columns, lo, size)
            split.views_from, split.views_size = lo, size
        i = (lo - split.views_from) // size
        return views[i] if i < len(views) else None

    def _batch(
        self,
        data: Any,
        leases: tuple[int, ...],
        completes: tuple[int, ...],
        epoch: int,
        size: int,
        keys: tuple[SplitKey, ...] = (),
    ) -> Batch:
        batch = Batch(data, leases, completes, epoch, size, self.next_index, keys)
        self.next_index += 1
        return batch

    def _collate(
        self,
        columns: Columns,
        pieces: list[_Piece] | None,
        split: ReadSplit | None = None,
        lo: int = 0,
        hi: int = 0,
    ) -> Any:
        try:
            return self.collate(columns)
        except Exception as exc:
            if pieces is None:
                assert split is not None
                pieces = [_Piece(split, lo, hi)]
            raise self._collate_error(pieces, columns, exc) from exc

    def _collate_error(
        self, pieces: list[_Piece], columns: Columns, exc: Exception
    ) -> CollateError:
        found = find_bad_record(self.collate, columns)
        if found is None:
            splits = ", ".join(_describe(p.split.lease) for p in pieces)
            return CollateError(
                f"dataset {self.dataset!r}: batch from {splits} failed to collate: "
                f"{type(exc).__name__}: {exc}"
            )
        pos, reason = found
        for p in pieces:
            if pos < p.hi - p.lo:
                offset = p.lo + pos
                order = p.split.order
                record = p.split.lease.start + (int(order[offset]) if order is not None else offset)
                return CollateError(
                    f"dataset {self.dataset!r}: record {record} of "
                    f"{_describe(p.split.lease)} failed to collate: {reason}"
                )
            pos -= p.hi - p.lo
        raise AssertionError("unreachable: the bad record lies in one of the pieces")


def _describe(lease: Lease) -> str:
    return f"split [{lease.start}, {lease.stop}) of epoch {lease.epoch} (lease {lease.lease_id})"


def _concat(parts: list[Any]) -> Any:
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    out = np.empty(sum(len(p) for p in parts), dtype=object)
    out[:] = [v for p in parts for v in p]
    return out
