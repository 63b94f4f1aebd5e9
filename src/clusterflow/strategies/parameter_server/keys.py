"""Which data splits a parameter-server replica's pushes applied, and which they dropped.

A step names the splits it completes (``run(..., completes=batch.keys)``); the ps
answers each push with whether it applied it and which of its keys it had applied
before. From those answers ``KeyLedger`` decides, per key, *applied* (ack it) or
*dropped* (give it back to the data service), and hands the decisions to
``ParameterServerStrategy.settled()``. Pure: no I/O, tested with hand-made replies.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from clusterflow.data.api import SplitKey
from clusterflow.ps.protocol import PushReply
from clusterflow.strategies.api import Settled


class KeyLedger:
    """Decided split keys of one replica, written by the push thread and the loop's.

    Async: a key is applied once every shard applied it, now or before (a duplicate);
    otherwise it is dropped (stale), and the shards that applied it will refuse it when
    it comes again. Sync: ps 0 decides; a counted push's keys are applied once ps 0
    moved past the step (the step committed), a late push's keys are dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._applied: list[SplitKey] = []
        self._dropped: list[SplitKey] = []
        self._in_step: list[tuple[int, tuple[SplitKey, ...]]] = []

    @property
    def waiting_for_steps(self) -> bool:
        """sync: counted keys wait for their step to commit."""
        return bool(self._in_step)

    def decide(self, applied: Sequence[SplitKey], dropped: Sequence[SplitKey]) -> None:
        with self._lock:
            self._applied.extend(applied)
            self._dropped.extend(dropped)

    def async_replies(self, keys: Sequence[SplitKey], replies: Sequence[PushReply]) -> bool:
        """Decides ``keys`` from every shard's reply; whether every shard applied the push."""
        applied_all = all(r.applied for r in replies)
        if keys:
            done = [
                set(keys) if r.applied else {SplitKey(*d) for d in r.duplicates} for r in replies
            ]
            applied = [k for k in keys if all(k in d for d in done)]
            self.decide(applied, [k for k in keys if k not in applied])
        return applied_all

    def sync_reply(self, keys: Sequence[SplitKey], decision: PushReply, step: int) -> bool:
        """Decides ``keys`` from ps 0's reply to a commit for ``step``; whether it counted."""
        duplicates = {SplitKey(*d) for d in decision.duplicates}
        counted = decision.applied and not duplicates
        if not keys:
            return counted
        if counted:
            with self._lock:
                self._in_step.append((step, tuple(keys)))
            return True
        # Duplicates were applied in an earlier step; with them the push added nothing,
        # so the rest of its keys go back, as a late push's keys do.
        self.decide([k for k in keys if k in duplicates], [k for k in keys if k not in duplicates])
        return False

    def reached(self, version: int) -> None:
        """sync: ps 0 is at ``version``: every step below it committed."""
        with self._lock:
            done = [k for step, keys in self._in_step if step < version for k in keys]
            self._in_step = [(s, k) for s, k in self._in_step if s >= version]
            self._applied.extend(done)

    def take(self) -> Settled:
        """The decisions since the last call; each key comes back once."""
        with self._lock:
            settled = Settled(applied=tuple(self._applied), dropped=tuple(self._dropped))
            self._applied, self._dropped = [], []
        return settled
