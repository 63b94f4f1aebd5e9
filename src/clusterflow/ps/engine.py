"""The versioned apply engine: the rules by which a ps applies pushes, written once.

A ps task holds two kinds of state, dense variables (``store.py``) and embedding-table
rows (``tables.py``). What a gradient *is* differs between them (a tensor per variable,
or ids and rows per table), and so do the checks, the averaging and the optimizer step.
The rules that decide *whether and when* a push is applied do not, and this class holds
them for both, so the two cannot drift apart (they had: a scaled stale push was counted
for variables only):

* **version**: every applied step advances it by one; pulls wait for a version.
* **exactly-once**: a push names the ``(dataset, epoch, split)`` keys it completes; a
  key is applied at most once (``AppliedKeys``), in the checkpointed state too. An async
  push naming an applied key is refused; a sync one joins its step as an empty part, so
  no step waits for it.
* **staleness** (async): ``max_staleness`` and ``stale_policy`` drop or scale a push.
* **the sync barrier**: a step is the average of the first N committers at the ps's
  version (``_quorum``); late pushes are dropped, a replica that left stops counting.
* **membership** (elastic clusters, ``membership.py``): once told who the replicas are
  (``set_members``), a step waits for exactly the members of its version that did not
  leave; a push from a replica that is no member of its step is refused, not counted,
  so a newcomer counts from the step after the one it was added in, and the step being
  collected never changes its mind about who it waits for except to stop waiting for
  one that left.
  Dense variables commit on ps 0 only, which then fans the step out to every shard
  (``apply_sync``); a table step takes every replica, so each row push commits on its
  own shard.
* **quiescing** for a checkpoint cut: pushes wait while held; ``quiesce`` waits for the
  fan-outs in flight.

The store gives the engine one function, ``apply(parts, lr_scale)``: one optimizer step
over the average of ``parts``' gradients. Every method whose docstring says "the lock is
held" runs under ``cond``, which the store holds around its own reads and writes too.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from clusterflow.ps.api import PSConfig, PSError, VersionTimeout
from clusterflow.ps.applied import AppliedKeys, Key

G = TypeVar("G")
"""One variable's or table's gradient, as the store that owns the engine holds it."""


@dataclass(slots=True)
class Part(Generic[G]):
    """One replica's share of a step: its gradients, the split keys it completes, and
    its optimizer hyper-parameters (an lr schedule's current values)."""

    grads: dict[str, G]
    keys: list[Key]
    hyper: Any


@dataclass(slots=True)
class PushResult:
    applied: bool
    version: int
    reason: str = ""
    staleness: int = 0
    commit: dict[str, Any] | None = None
    """sync: the step this push completed ({"version", "workers"}); ps 0 fans it out."""
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    duplicates: list[Key] = field(default_factory=list)
    """Keys of the push applied before: its gradients are not applied (async: the push
    is refused; sync: it joins the step as an empty part, so no step waits for it)."""


@dataclass(slots=True)
class Admission:
    """What ``admit`` decided about a push before anything of it is applied."""

    keys: list[Key]
    """The push's keys, parsed; empty for a sync push that holds a duplicate."""
    duplicates: list[Key]
    refused: PushResult | None = None
    """An async push naming an applied key: the reply, and nothing is applied."""


class ApplyEngine(Generic[G]):
    """Version, exactly-once, staleness and the sync barrier; see the module docstring."""

    def __init__(self, name: str, apply: Callable[[list[Part[G]], float], None]) -> None:
        self.name = name
        """How errors name the state this engine applies to (``ps:0``, ``ps:0 tables``)."""
        self.cond = threading.Condition()
        self.version = 0
        self.applied = AppliedKeys()
        self.stats: Counter[str] = Counter()
        self._apply = apply
        self._pending: dict[int, dict[str, Part[G]]] = {}
        self._commits: dict[int, list[str]] = {}
        self._departed: set[str] = set()
        self._members: list[tuple[int, frozenset[str]]] = []
        """The replicas a sync step takes, from each step on, oldest first; empty: never
        told (a cluster of a fixed size), so a step takes ``config.num_replicas``."""
        self._held = False
        self._busy = 0

    # Reads ------------------------------------------------------------------------

    def wait_version(self, min_version: int, deadline: float, timeout: float) -> None:
        """Blocks until ``version >= min_version`` (the lock is held).

        Raises:
            VersionTimeout: not by ``deadline`` (a ``time.monotonic`` instant).
        """
        while self.version < min_version:
            if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                raise VersionTimeout(
                    f"{self.name} is at version {self.version}; version {min_version} "
                    f"did not come within {timeout:g}s"
                )

    # Pushes -----------------------------------------------------------------------

    def admit(
        self, config: PSConfig, worker: str, keys: Iterable[Any], deadline: float, timeout: float
    ) -> Admission:
        """Waits out a quiesce, then decides the push's keys (the lock is held).

        Raises:
            PSError: the ps stayed quiesced past ``deadline``.
        """
        while self._held:
            if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                raise PSError(f"{self.name} stayed quiesced for {timeout:g}s")
        self._departed.discard(worker)  # a respawned replica takes part again
        keyed = [(str(d), int(e), int(s)) for d, e, s in keys]
        duplicates = self.applied.applied(keyed)
        if not duplicates:
            return Admission(keyed, [])
        self.stats["duplicate_keys"] += 1
        if config.mode == "async":
            refused = PushResult(False, self.version, "duplicate", duplicates=duplicates)
            return Admission([], duplicates, refused)
        return Admission([], duplicates)

    def apply_async(self, config: PSConfig, version: int, part: Part[G]) -> PushResult:
        """Applies one async push pulled at ``version``, unless too stale to (the lock is held)."""
        staleness = max(0, self.version - version)
        if config.too_stale(staleness):
            if config.stale_policy == "drop":
                self.stats["dropped_stale"] += 1
                return PushResult(False, self.version, "stale", staleness)
            self.stats["scaled_stale"] += 1
        self._apply([part], config.async_lr_scale(staleness))
        self.applied.add(part.keys)
        self._advance()
        return PushResult(True, self.version, "", staleness)

    def buffer_sync(
        self, config: PSConfig, worker: str, version: int, part: Part[G], commit: bool
    ) -> PushResult:
        """Buffers a sync push for step ``version``; a commit may complete the step
        (the lock is held).

        Raises:
            PSError: a push for a step this ps has not reached.
        """
        if version < self.version:
            self.stats["dropped_late"] += 1
            return PushResult(False, self.version, "late", self.version - version)
        if version > self.version:
            raise PSError(f"push for version {version}, but {self.name} is at {self.version}")
        members = self.members_at(version)
        if commit and members is not None and worker not in members:
            # Only a commit is judged: a shard that buffers a part (not ps 0) applies the
            # set ps 0 names, so it must never refuse a part ps 0 may count.
            self.stats["dropped_not_member"] += 1
            return PushResult(False, self.version, "not_member")
        self._pending.setdefault(version, {})[worker] = part
        if not commit:
            return PushResult(True, self.version, "buffered")
        commits = self._commits.setdefault(version, [])
        if worker not in commits:
            commits.append(worker)
        quorum = self._quorum(config, version)
        if len(commits) < quorum:
            return PushResult(True, self.version, "committed")
        chosen = commits[:quorum]
        self._apply_sync_locked(version, chosen)
        return PushResult(
            True, self.version, "applied", commit={"version": version, "workers": chosen}
        )

    def _quorum(self, config: PSConfig, version: int) -> int:
        """Pushes sync step ``version`` takes: N, or fewer once replicas left for good.

        N is ``config.num_replicas`` (less the backup workers), or, once ``set_members``
        named the replicas, the members of this step. A replica that committed to this
        step and then left still counts for it: the replicas still present push to this
        step too, and had the step been taken without them their pushes would be
        dropped as late, and their data lost.
        """
        committed = self._commits.get(version, [])
        members = self.members_at(version)
        if members is None:
            left_after_committing = sum(1 for worker in committed if worker in self._departed)
            present = config.num_replicas - len(self._departed) + left_after_committing
            return max(1, min(config.replicas_per_step, present))
        present = sum(1 for w in members if w not in self._departed or w in committed)
        return max(1, min(len(members) - config.backup_workers, present))

    @property
    def resizable(self) -> bool:
        """Whether the manager told this ps who the replicas are: the cluster resizes."""
        return bool(self._members)

    def members_at(self, version: int) -> frozenset[str] | None:
        """The replicas sync step ``version`` takes; None: never told (the lock is held)."""
        found = None
        for start, names in self._members:
            if start > version:
                break
            found = names
        return found

    def set_members(
        self, workers: Iterable[str], version: int | None, previous: Iterable[str] = ()
    ) -> int:
        """From step ``version`` on (None: the next), a sync step takes ``workers``;
        returns the step they take effect at.

        Never the step being collected: its commits were counted against the replicas
        it began with, and a replica added now has pulled no values of it, so a step
        the change reached late takes effect at the next one (``version + 1`` at the
        least). That is how a newcomer joins at the next step: its push to this one is
        refused (``not_member``, its keys go back), and the next waits for it. Leaving
        is ``leave``'s, which acts at once.

        ``previous``: the replicas before the change. A store never told a membership
        counted its steps by number; it takes them as the step being collected's, so
        the first change refuses a newcomer's early push as every later one does.
        """
        names = frozenset(workers)
        with self.cond:
            if not self._members and previous:
                self._members = [(self.version, frozenset(previous))]
            start = self.version + 1 if version is None else max(version, self.version + 1)
            current = self.members_at(self.version)
            if current is not None:
                # A name the membership adds is a new replica (a task of a name that
                # left may come back): it is waited for from ``start`` on, until it
                # leaves. (Before the first membership, a name that left stays gone.)
                self._departed -= names - current
            kept = [(s, n) for s, n in self._members if s < start]
            # what no step will read again: all but the newest entry at or below now
            while len(kept) > 1 and kept[1][0] <= self.version:
                kept.pop(0)
            self._members = [*kept, (start, names)]
            self.stats["membership_changes"] += 1
            self.cond.notify_all()
            return start

    def leave(self, config: PSConfig | None, worker: str) -> dict[str, Any] | None:
        """A replica will push no more (its data ran out): steps stop waiting for it.

        Sync training ends unevenly: without this, the last replicas would wait forever
        for a step that needs replicas which already finished. Returns the step this
        completed, if the lower quorum completed one (ps 0 then fans it out).
        """
        with self.cond:
            self._departed.add(worker)
            if config is None or config.mode != "sync":
                return None
            commits = self._commits.get(self.version, [])
            quorum = self._quorum(config, self.version)
            if not commits or len(commits) < quorum:
                return None
            version = self.version
            chosen = commits[:quorum]
            self._apply_sync_locked(version, chosen)
            return {"version": version, "workers": chosen}

    def apply_sync(self, version: int, workers: list[str]) -> int:
        """Applies step ``version`` as the average of ``workers``' buffered gradients.

        Called on every shard but ps 0 when ps 0 decided the step.

        Raises:
            PSError: a chosen worker's gradients never reached this shard.
        """
        with self.cond:
            if version < self.version:
                return self.version  # already applied (a retried fan-out)
            if version > self.version:
                raise PSError(f"apply of version {version}, but {self.name} is at {self.version}")
            pending = self._pending.get(version, {})
            missing = [w for w in workers if w not in pending]
            if missing:
                raise PSError(f"{self.name} has no gradients of {missing} for version {version}")
            self._apply_sync_locked(version, workers)
            return self.version

    def _apply_sync_locked(self, version: int, workers: list[str]) -> None:
        pending = self._pending.pop(version, {})
        # Every part was admitted at this version, after the steps before it: a part
        # naming a key applied before joined empty then (``admit``), on every shard.
        parts = [pending[w] for w in workers]
        self._apply(parts, 1.0)
        for p in parts:
            self.applied.add(p.keys)
        dropped = len(pending) - len(parts)
        if dropped > 0:
            self.stats["dropped_late"] += dropped
        for old in [v for v in self._pending if v <= version]:
            self.stats["dropped_late"] += len(self._pending.pop(old))
        self._commits.pop(version, None)
        self._advance()

    def _advance(self) -> None:
        self.version += 1
        self.stats["applied"] += 1
        self.cond.notify_all()

    # Checkpoint hooks -------------------------------------------------------------

    def quiesce(self, timeout: float = 60.0) -> int:
        """Holds new pushes and waits for in-flight fan-outs; returns the version held at."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self._held = True
            while self._busy:
                if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise PSError(f"{self.name}: pushes still in flight after {timeout:g}s")
            return self.version

    def resume(self) -> None:
        with self.cond:
            self._held = False
            self.cond.notify_all()

    def begin_fanout(self) -> None:
        """Marks a sync step's fan-out to other shards as in flight (quiesce waits for it)."""
        with self.cond:
            self._busy += 1

    def end_fanout(self) -> None:
        with self.cond:
            self._busy -= 1
            self.cond.notify_all()

    def restore(self, version: int, applied: AppliedKeys) -> None:
        """Takes a checkpoint's version and applied keys; buffered steps are dropped
        (the lock is held)."""
        self.version = version
        self.applied = applied
        self._pending.clear()
        self._commits.clear()
        self.cond.notify_all()


class Applied:
    """What a store that applies through an ``ApplyEngine`` shows of it (both stores
    are one): the version, the applied split keys and the counters."""

    _engine: ApplyEngine[Any]

    @property
    def version(self) -> int:
        """Steps applied (the dense variables and the tables count their own)."""
        return self._engine.version

    @property
    def applied(self) -> AppliedKeys:
        """Split keys whose update was applied: each is applied at most once."""
        return self._engine.applied

    @property
    def stats(self) -> Counter[str]:
        return self._engine.stats
