"""The lease ledger of one dataset: a pure state machine, with time passed in.

Every split of an epoch is, at any moment, exactly one of *pending* (in the queue),
*outstanding* (lent under one lease to one worker) or *acked* (its update is applied).
Leases move splits between those states:

* ``grant``: pending -> outstanding (whichever worker asks gets the next split);
* ``ack``: outstanding -> acked, once; an acked split never goes back;
* ``release_worker`` / the deadline: outstanding -> pending, at the head of the queue.

An epoch is complete when all of its splits are acked. The next epoch opens as soon as
the live ones have nothing pending, so a worker never waits at an epoch's end for the
last splits of others: it waits only at the very end of the data. Waiting anywhere else
would deadlock synchronous training, where the waiting worker is needed in the very
all-reduce that the others must finish before they can ack. In practice an epoch
completes within a few splits of the next one opening, so two or three are live.

No I/O and no clock here: the dispatcher passes ``now``, so tests drive time by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from clusterflow._checks import seconds
from clusterflow.data.api import DatasetSpec, Lease, UnknownLeaseError
from clusterflow.data.splits import PendingQueue, epoch_order, hosts_from_runs, split_range
from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

STATE_VERSION = 1


class GrantStatus(StrEnum):
    LEASE = "lease"
    """A split was lent."""
    WAIT = "wait"
    """The end of the data: nothing pending, but outstanding splits may come back (their
    worker may die): ask again shortly."""
    END = "end"
    """Every epoch is complete."""


@dataclass(frozen=True, slots=True)
class Grant:
    status: GrantStatus
    lease: Lease | None = None
    """The first split lent (None unless ``status`` is ``lease``)."""
    more: tuple[Lease, ...] = ()
    """Further splits lent by the same call (``grant(count=...)``), in queue order."""
    last: bool = False
    """Nothing is left to lend after this grant: no split pending and no epoch left to
    open. A worker that stops once nothing is left to lend (the simple mode) stops after
    these splits without asking again: that ask could only be told to wait or stop."""

    @property
    def leases(self) -> list[Lease]:
        """Every split this grant lends: each its own lease, acked on its own."""
        return [] if self.lease is None else [self.lease, *self.more]


@dataclass(slots=True)
class _Outstanding:
    epoch: int
    split: int
    worker: str


@dataclass(slots=True)
class _Epoch:
    epoch: int
    queue: PendingQueue
    acked: set[int] = field(default_factory=set)
    acked_leases: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class AckResult:
    acked: int
    """Leases acked by this call."""
    duplicates: int
    """Leases that were already acked (acks are idempotent)."""


class LeaseBook:
    """Pending, outstanding and acked splits of one dataset, across epochs.

    Args:
        spec: the dataset's definition.
        lease_timeout_s: a worker silent for this long loses its outstanding leases.
            Every call a worker makes (asking for a split, acking) counts as a sign of
            life, so the deadline only bites a worker that stopped consuming.
    """

    def __init__(self, spec: DatasetSpec, *, lease_timeout_s: float) -> None:
        seconds("lease_timeout_s", lease_timeout_s)
        self.spec = spec
        self.lease_timeout_s = lease_timeout_s
        self._hosts: dict[int, str] = {}
        self._live: dict[int, _Epoch] = {}
        self._next_epoch = 0
        self._next_lease_id = 1
        self._outstanding: dict[int, _Outstanding] = {}
        self._by_worker: dict[str, set[int]] = {}
        self._last_seen: dict[str, float] = {}
        self._incarnations: dict[str, str] = {}
        self._returned: dict[int, _Outstanding] = {}
        """Leases taken back (worker died or went silent), for a clear late-ack reply."""
        self.granted_per_worker: dict[str, dict[int, int]] = {}
        """Leases granted per worker per epoch: what balance is judged by."""
        self.locality = {"located": 0, "local": 0}
        """Leases of splits with a known host, and those lent to a worker on that host."""

    # Queries --------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The oldest epoch not yet complete (or the number of epochs, when all are)."""
        return min(self._live) if self._live else self._next_epoch

    @property
    def finished(self) -> bool:
        return not self._live and self._exhausted()

    def outstanding(self) -> dict[int, Lease]:
        """Lent, not acked: lease id -> lease."""
        return {lid: self._lease(lid, o) for lid, o in self._outstanding.items()}

    def status(self) -> dict[str, Any]:
        """Counts for monitoring and tests (a msgpack-able value)."""
        return {
            "epoch": self.epoch,
            "finished": self.finished,
            "live": {
                str(e.epoch): {"pending": len(e.queue), "acked": len(e.acked)}
                for e in self._live.values()
            },
            "outstanding": len(self._outstanding),
            "workers": {w: len(ids) for w, ids in self._by_worker.items()},
            "granted": {
                w: {str(e): n for e, n in per.items()} for w, per in self.granted_per_worker.items()
            },
            "locality": dict(self.locality),
        }

    # Transitions ----------------------------------------------------------------------

    def set_locations(self, runs: Iterable[Iterable[object]]) -> None:
        """Adopts split locations (``location_runs`` form), if none were given yet."""
        if self._hosts:
            return
        hosts = hosts_from_runs(runs, self.spec.num_splits)
        if not hosts:
            return
        self._hosts.update(hosts)
        for ep in self._live.values():
            pending = ep.queue.pending()
            ep.queue = PendingQueue(pending, self._hosts)

    def grant(
        self,
        worker: str,
        host: str | None,
        now: float,
        incarnation: str | None = None,
        count: int = 1,
    ) -> Grant:
        """Lends the next split to ``worker`` (one on ``host`` first), if any is pending;
        up to ``count`` splits, each under a lease of its own, if that many are and the
        worker's fair share allows (``fair_count``).

        ``incarnation`` tells a restarted worker from its dead predecessor of the same
        name: the first call of a new incarnation hands the old one's leases back, which
        would otherwise be kept alive by the newcomer's calls and never expire.
        """
        if incarnation is not None:
            known = self._incarnations.get(worker)
            if known is not None and known != incarnation and self._by_worker.get(worker):
                log.info("dataset %r: %s restarted", self.spec.name, worker)
                self.release_worker(worker)
            self._incarnations[worker] = incarnation
        self._touch(worker, now)
        self.expire(now)
        count = self.fair_count(worker, count)
        lent: list[Lease] = []
        while len(lent) < count:
            # ``_live`` holds epochs in ascending order: opened in order, restored sorted
            for ep in self._live.values():
                split = ep.queue.pop(host)
                if split is not None:
                    self._count_locality(split, host)
                    lent.append(self._lend(ep.epoch, split, worker))
                    break
            else:
                if self._exhausted():
                    break
                self._open_next()
        if lent:
            last = self._exhausted() and not any(ep.queue for ep in self._live.values())
            return Grant(GrantStatus.LEASE, lent[0], tuple(lent[1:]), last)
        if self._live:
            return Grant(GrantStatus.WAIT)
        return Grant(GrantStatus.END)

    def fair_count(self, worker: str, count: int) -> int:
        """How many of ``count`` splits one grant may lend ``worker``: at least one, and
        beyond it no more than brings the worker's leases to its share of the splits
        left (pending, outstanding and of epochs not yet opened) among the workers heard
        from. Splits leased ahead are held away from the others: without this cap, the
        first workers to ask take the last splits of the data while later ones idle (7
        workers asking 4 ahead of 35 splits left one with none).
        """
        if count <= 1 or self.spec.epochs is None:  # endless data has no last splits
            return count
        left = sum(len(ep.queue) for ep in self._live.values()) + len(self._outstanding)
        left += (self.spec.epochs - self._next_epoch) * self.spec.num_splits
        share = -(-left // max(1, len(self._last_seen)))
        held = len(self._by_worker.get(worker, ()))
        return max(1, min(count, share - held))

    def ack(self, lease_ids: Iterable[int], now: float, worker: str | None = None) -> AckResult:
        """Marks leases done: their updates have been applied.

        Acking the same lease twice is harmless (a retried push). Leases that cannot be
        acked are reported after the others are applied.

        Raises:
            UnknownLeaseError: some ids were never issued, or were taken back and their
                split lent again; the message names each one.
        """
        if worker is not None:
            self._touch(worker, now)
        acked = duplicates = 0
        problems: list[str] = []
        for raw in lease_ids:
            lease_id = int(raw)
            found = self._outstanding.pop(lease_id, None)
            if found is not None:
                owner = self._by_worker.get(found.worker)
                if owner is not None:
                    owner.discard(lease_id)
                self._settle(found, lease_id)
                acked += 1
                continue
            if any(lease_id in ep.acked_leases for ep in self._live.values()):
                duplicates += 1
                continue
            returned = self._returned.get(lease_id)
            if returned is not None:
                if self._accept_late(returned, lease_id):
                    acked += 1
                else:
                    problems.append(
                        f"lease {lease_id} (epoch {returned.epoch}, split {returned.split}) was "
                        f"taken back from {returned.worker} and its split lent again"
                    )
                continue
            if 0 < lease_id < self._next_lease_id:
                problems.append(
                    f"lease {lease_id} is no longer active (its epoch is complete, or a "
                    "restart from a checkpoint took it back)"
                )
            else:
                problems.append(f"lease {lease_id} was never issued")
        if problems:
            done = f"; the other {acked} were acked" if acked else ""
            raise UnknownLeaseError(
                f"dataset {self.spec.name!r}: cannot ack {'; '.join(problems)}{done}"
            )
        return AckResult(acked, duplicates)

    def release_worker(self, worker: str) -> int:
        """Puts every outstanding lease of ``worker`` back in the queue; returns how many."""
        ids = self._by_worker.pop(worker, set())
        self._last_seen.pop(worker, None)
        for lease_id in sorted(ids, reverse=True):
            self._requeue(lease_id)
        if ids:
            log.info(
                "dataset %r: %d leases of %s went back to the queue",
                self.spec.name,
                len(ids),
                worker,
            )
        return len(ids)

    def release_leases(self, worker: str, lease_ids: Iterable[int]) -> int:
        """Puts back the given leases of ``worker`` (one client closing, not its process).

        Ids that are not outstanding under ``worker`` (acked meanwhile, e.g. by a
        parameter server) are skipped. Returns how many went back.
        """
        owned = self._by_worker.get(worker, set())
        returned = 0
        for lease_id in sorted({int(x) for x in lease_ids} & owned, reverse=True):
            owned.discard(lease_id)
            self._requeue(lease_id)
            returned += 1
        return returned

    def expire(self, now: float) -> int:
        """Takes back the leases of workers silent for longer than the lease timeout."""
        # Oldest first (``_touch`` moves a worker to the end), so the scan stops at the
        # first worker heard from in time: a grant costs O(1), not O(workers); measured,
        # the full scan was 1.3 ms of every lease with 1,000 workers (docs/scaling.md).
        silent: list[str] = []
        idle: list[str] = []
        for w, seen in self._last_seen.items():
            if now - seen <= self.lease_timeout_s:
                break
            (silent if self._by_worker.get(w) else idle).append(w)
        for w in idle:  # nothing to take back; its next call enters it again
            del self._last_seen[w]
        returned = 0
        for worker in silent:
            log.warning(
                "dataset %r: %s silent for over %gs; taking back its leases",
                self.spec.name,
                worker,
                self.lease_timeout_s,
            )
            returned += self.release_worker(worker)
        return returned

    # Cursor ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor: which splits of the live epochs are acked.

        Outstanding splits are listed but count as not done: restoring puts them back
        in the queue, so a restored cursor hands out exactly the records not yet acked.
        """
        return {
            "version": STATE_VERSION,
            "spec": self.spec.to_wire(),
            "seed": self.spec.seed,
            "epoch": self.epoch,
            "next_epoch": self._next_epoch,
            "next_lease_id": self._next_lease_id,
            "epochs": [
                {
                    "epoch": ep.epoch,
                    "acked": sorted(ep.acked),
                    "outstanding": sorted(
                        o.split for o in self._outstanding.values() if o.epoch == ep.epoch
                    ),
                }
                for ep in sorted(self._live.values(), key=lambda e: e.epoch)
            ],
        }

    @classmethod
    def from_state(
        cls, state: Mapping[str, Any], *, lease_timeout_s: float
    ) -> tuple[LeaseBook, int]:
        """A ledger resumed from ``state_dict()``; also returns how many outstanding
        leases of the saved cursor went back to the queue.

        Raises:
            ConfigError: the state is malformed or of another version.
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"not a data cursor of version {STATE_VERSION}: "
                f"{state.get('version') if isinstance(state, Mapping) else state!r}"
            )
        spec = DatasetSpec.from_wire(state["spec"])
        book = cls(spec, lease_timeout_s=lease_timeout_s)
        book._next_epoch = int(state["next_epoch"])
        book._next_lease_id = int(state["next_lease_id"])
        requeued = 0
        for saved in sorted(state["epochs"], key=lambda saved: int(saved["epoch"])):
            epoch = int(saved["epoch"])
            acked = {int(s) for s in saved["acked"]}
            bad = [s for s in acked if not 0 <= s < spec.num_splits]
            if bad:
                raise ConfigError(f"data cursor of {spec.name!r} names unknown splits {bad[:5]}")
            order = [s for s in epoch_order(spec.seed, epoch, spec.num_splits) if s not in acked]
            book._live[epoch] = _Epoch(epoch, PendingQueue(order, book._hosts), acked)
            requeued += len(saved.get("outstanding", ()))
        return book, requeued

    # Internals ------------------------------------------------------------------------

    def _exhausted(self) -> bool:
        return self.spec.epochs is not None and self._next_epoch >= self.spec.epochs

    def _open_next(self) -> None:
        epoch = self._next_epoch
        self._next_epoch += 1
        order = epoch_order(self.spec.seed, epoch, self.spec.num_splits)
        self._live[epoch] = _Epoch(epoch, PendingQueue(order, self._hosts))
        log.debug("dataset %r: epoch %d opened", self.spec.name, epoch)

    @property
    def next_lease_id(self) -> int:
        """The id the next lease gets: every id below it was issued by this book or by
        the ones it was restored over (``issue_ids_from``)."""
        return self._next_lease_id

    def issue_ids_from(self, first: int) -> None:
        """Issues no lease id below ``first``: a book restored from a cursor would
        otherwise issue again the ids the run lent after that cursor was saved, and an
        ack of an old lease, still on its way from a killed worker, would settle a new
        lease of a split nobody trained (``DispatcherService.reset``)."""
        self._next_lease_id = max(self._next_lease_id, first)

    def _lend(self, epoch: int, split: int, worker: str) -> Lease:
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        self._outstanding[lease_id] = _Outstanding(epoch, split, worker)
        self._by_worker.setdefault(worker, set()).add(lease_id)
        per = self.granted_per_worker.setdefault(worker, {})
        per[epoch] = per.get(epoch, 0) + 1
        return self._lease(lease_id, self._outstanding[lease_id])

    def _lease(self, lease_id: int, o: _Outstanding) -> Lease:
        start, stop = split_range(o.split, self.spec.num_records, self.spec.split_size)
        return Lease(lease_id, o.epoch, start, stop)

    def _settle(self, found: _Outstanding, lease_id: int) -> None:
        ep = self._live[found.epoch]
        ep.acked.add(found.split)
        ep.acked_leases.add(lease_id)
        if len(ep.acked) == self.spec.num_splits:
            del self._live[found.epoch]
            self._returned = {k: v for k, v in self._returned.items() if v.epoch != found.epoch}
            # Grant counts of one completed epoch are kept for status; older ones go.
            for per in self.granted_per_worker.values():
                for old in [e for e in per if e < found.epoch]:
                    del per[old]
            log.info("dataset %r: epoch %d complete", self.spec.name, found.epoch)

    def _accept_late(self, returned: _Outstanding, lease_id: int) -> bool:
        """A lease taken back whose worker acks it after all: fine while its split waits."""
        ep = self._live.get(returned.epoch)
        if ep is None or returned.split not in ep.queue:
            return False
        ep.queue.remove(returned.split)
        del self._returned[lease_id]
        self._settle(returned, lease_id)
        return True

    def _requeue(self, lease_id: int) -> None:
        # Pushed to the head in reverse id order, so the oldest lease is retried first.
        found = self._outstanding.pop(lease_id)
        self._returned[lease_id] = found
        ep = self._live.get(found.epoch)
        if ep is not None:
            ep.queue.push_front(found.split)

    def _count_locality(self, split: int, host: str | None) -> None:
        where = self._hosts.get(split)
        if where is not None:
            self.locality["located"] += 1
            self.locality["local"] += where == host

    def _touch(self, worker: str, now: float) -> None:
        """Records a call; keeps ``_last_seen`` in call order (``now`` never goes back)."""
        self._last_seen.pop(worker, None)
        self._last_seen[worker] = now
