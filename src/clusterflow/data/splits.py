"""Pure split logic: cutting an epoch into splits, ordering them, queueing them by host.

Splits are fixed record ranges ``[i * split_size, min((i + 1) * split_size, n))``; an
epoch only changes their *order*. Keeping the ranges fixed lets a split's location (the
host storing its records) be computed once, and lets a cursor name a split by its index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

import numpy as np


def split_range(index: int, num_records: int, split_size: int) -> tuple[int, int]:
    """The record range ``[start, stop)`` of split ``index``."""
    start = index * split_size
    return start, min(start + split_size, num_records)


def epoch_order(seed: int, epoch: int, num_splits: int) -> list[int]:
    """The order in which an epoch hands out its splits.

    A NumPy generator seeded from ``(seed, epoch)``: a different order each epoch, the
    same orders in every run with the same seed, on every machine (PCG64 is portable).
    """
    rng = np.random.default_rng([seed, epoch])
    order: list[int] = rng.permutation(num_splits).tolist()
    return order


def split_seed(seed: int, epoch: int, split: int) -> np.random.Generator:
    """The generator for shuffling records inside one split: reproducible per split."""
    return np.random.default_rng([seed, epoch, split, 1])


def shuffle_buffer_order(n: int, buffer: int, rng: np.random.Generator) -> np.ndarray:
    """The record order a shuffle buffer of ``buffer`` records gives over ``n`` records.

    The classic streaming buffer (as ``tf.data.Dataset.shuffle``): fill the buffer, then
    emit a random slot and refill it with the next record. A buffer at least as large
    as the split is a full permutation, done at once.
    """
    if buffer <= 1:
        return np.arange(n)
    if buffer >= n:
        return rng.permutation(n)
    picks = rng.integers(0, buffer, size=n)
    slots = list(range(buffer))
    out = np.empty(n, dtype=np.int64)
    following = buffer
    for i in range(n):
        slot = int(picks[i]) if following < n else int(rng.integers(0, len(slots)))
        out[i] = slots[slot]
        if following < n:
            slots[slot] = following
            following += 1
        else:
            slots[slot] = slots[-1]
            slots.pop()
    return out


def location_runs(hosts: Iterable[str | None]) -> list[list[int | str]]:
    """Compresses per-split hosts into ``[first_split, stop_split, host]`` runs."""
    runs: list[list[int | str]] = []
    for split, host in enumerate(hosts):
        if host is None:
            continue
        if runs and runs[-1][2] == host and runs[-1][1] == split:
            runs[-1][1] = split + 1
        else:
            runs.append([split, split + 1, host])
    return runs


def hosts_from_runs(runs: Iterable[Iterable[object]], num_splits: int) -> dict[int, str]:
    """The host of each located split, from ``location_runs``' form (others have none)."""
    hosts: dict[int, str] = {}
    for run in runs:
        first, stop, host = run
        if not isinstance(first, int) or not isinstance(stop, int) or not isinstance(host, str):
            continue
        for split in range(max(0, first), min(stop, num_splits)):
            hosts[split] = host
    return hosts


class PendingQueue:
    """The splits of one epoch not yet lent, in order, with a per-host view.

    ``pop(host)`` gives the first pending split stored on ``host`` if there is one,
    else the first pending split of all: local reads first, and a worker is never
    starved while anything is pending. Entries are removed lazily (a split taken
    through one view stays in the other until reached), so every operation is O(1)
    amortised.
    """

    def __init__(self, order: Iterable[int], hosts: Mapping[int, str]) -> None:
        self._order: deque[int] = deque(order)
        self._pending: set[int] = set(self._order)
        self._hosts = hosts
        self._by_host: dict[str, deque[int]] = {}
        for split in self._order:
            host = hosts.get(split)
            if host is not None:
                self._by_host.setdefault(host, deque()).append(split)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, split: int) -> bool:
        return split in self._pending

    def pop(self, host: str | None) -> int | None:
        """The next split for a worker on ``host``, or None when nothing is pending."""
        if host is not None:
            local = self._by_host.get(host)
            while local:
                split = local.popleft()
                if split in self._pending:
                    self._pending.discard(split)
                    return split
        while self._order:
            split = self._order.popleft()
            if split in self._pending:
                self._pending.discard(split)
                return split
        return None

    def push_front(self, split: int) -> None:
        """Puts a split back at the head: a returned lease is retried first."""
        if split in self._pending:
            return
        self._pending.add(split)
        self._order.appendleft(split)
        host = self._hosts.get(split)
        if host is not None:
            self._by_host.setdefault(host, deque()).appendleft(split)

    def remove(self, split: int) -> None:
        self._pending.discard(split)

    def pending(self) -> list[int]:
        """The pending splits in hand-out order (for status and tests)."""
        return [s for s in dict.fromkeys(self._order) if s in self._pending]
