"""Generations of an all-reduce group that resizes live (issue 32; docs/concepts.md,
"Elastic clusters").

A replica group of ``MultiWorkerMirroredStrategy`` trained through ``fit`` or a
``TrainingSession`` in an elastic cluster (``--workers MIN:MAX``) changes membership
only at a step boundary. Each membership is a *generation* ``n``: its process group
meets under the store prefix ``clusterflow/elastic/g<n>`` (:func:`generation_name`), so
no key that generation ``n`` wrote (its ranks' addresses, its heartbeats) is read by
generation ``n + 1``, which meets under another prefix of the same store. The store is
the manager's (``MASTER_PORT``, one per attempt), so it outlives every replica.

What the replicas and the newcomers exchange through the store, besides the groups:

- ``clusterflow/elastic/started``: set by rank 0 once the first group formed. A replica
  that finds it when it starts was added to a running cluster (``clusterflow scale``):
  it joins a later generation instead of the first.
- ``clusterflow/elastic/record/<n>``: generation ``n``'s :class:`Generation` (its tasks in
  rank order, who is new, the step it starts at, the batch policy's figures), written by
  rank 0 of generation ``n - 1`` after the replicas agreed on the change at a boundary.
- ``clusterflow/elastic/ready/<task>``: set by a newcomer once its process is up and
  waits to join. Rank 0 admits only such newcomers, so the survivors go on training
  while a newcomer's process starts (seconds: Python, torch), rather than waiting for
  it inside the new group's rendezvous.
- ``clusterflow/elastic/member/<task>``: the generation a newcomer joins; it waits for
  it, and deletes it (and its ``ready``) once read.

Pure logic and store calls, no collective: the strategy (``strategies/mirrored.py``) runs
the boundary's vote and the broadcast of the model and optimizer state.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, Protocol

from clusterflow.cluster import TaskId
from clusterflow.collective.api import MembershipError
from clusterflow.collective.membership import REPLICA_JOBS

__all__ = [
    "Generation",
    "SpecWatcher",
    "generation_name",
    "joining_generation",
    "next_tasks",
    "publish",
    "read_generation",
    "ready",
    "share_of",
]

_log = logging.getLogger(__name__)

ROOT: Final = "clusterflow/elastic"
STARTED_KEY: Final = f"{ROOT}/started"


class KeyStore(Protocol):
    """What of a torch ``Store`` this module uses (a ``TCPStore`` or ``PrefixStore``)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...

    def delete_key(self, key: str) -> bool: ...


def generation_name(number: int) -> str:
    """``Membership.generation`` of generation ``number``: its group meets under
    ``clusterflow/<name>`` (``CollectiveGroup.form``), a prefix of its own."""
    return f"elastic/g{number}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """One membership of a resizing group, as rank 0 published it."""

    number: int
    tasks: tuple[str, ...]
    """The replicas' tasks in rank order: the survivors in their old order, then the
    newcomers (chief first, then workers by index)."""
    newcomers: tuple[str, ...]
    """Tasks that receive the model and optimizer state by broadcast from rank 0."""
    spec_version: int
    """The manager's spec version whose newcomers this generation admitted."""
    step: int
    """The session step at which the generation starts (the boundary)."""
    global_batch: int
    """Rows per step over all replicas that the default batch policy keeps."""
    base_world: int
    """The world size the optimizer's learning rates were set for (the linear-scaling
    policy scales them by ``world / base_world``)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        raw = json.loads(text)
        return cls(
            number=int(raw["number"]),
            tasks=tuple(raw["tasks"]),
            newcomers=tuple(raw["newcomers"]),
            spec_version=int(raw["spec_version"]),
            step=int(raw["step"]),
            global_batch=int(raw["global_batch"]),
            base_world=int(raw["base_world"]),
        )

    def rank_of(self, task: str) -> int:
        try:
            return self.tasks.index(task)
        except ValueError:
            raise MembershipError(
                f"task {task} is not in generation {self.number} ({', '.join(self.tasks)})"
            ) from None


def _record_key(number: int) -> str:
    return f"{ROOT}/record/{number}"


def _member_key(task: str) -> str:
    return f"{ROOT}/member/{task}"


def _ready_key(task: str) -> str:
    return f"{ROOT}/ready/{task}"


def ready(store: KeyStore, tasks: Sequence[str]) -> tuple[str, ...]:
    """Those of ``tasks`` whose process is up and waits to join (one store call each)."""
    return tuple(t for t in tasks if store.check([_ready_key(t)]))


def publish(store: KeyStore, generation: Generation) -> None:
    """Rank 0: makes ``generation`` readable, then tells each newcomer to join it."""
    store.set(_record_key(generation.number), generation.to_json())
    for task in generation.newcomers:
        store.set(_member_key(task), str(generation.number))


def read_generation(store: KeyStore, number: int, timeout_s: float) -> Generation:
    """Waits (at most ``timeout_s``) for generation ``number``'s record and reads it."""
    key = _record_key(number)
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return Generation.from_json(store.get(key))


def joining_generation(store: KeyStore, task: str, timeout_s: float) -> Generation | None:
    """For a replica that starts: the generation it joins when it was added to a running
    group, or None when it is one of the first group's replicas (nothing started yet).

    The first group's replicas never see ``started``: rank 0 sets it only once all of
    them joined that group, after each one asked here.
    """
    if not store.check([STARTED_KEY]):
        return None
    key = _member_key(task)
    store.set(_ready_key(task), "1")
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    number = int(store.get(key))
    # Taken: a task of the same name added again later (after it left) waits for a
    # generation of its own, and says again that it is ready.
    store.delete_key(key)
    store.delete_key(_ready_key(task))
    return read_generation(store, number, timeout_s)


def mark_started(store: KeyStore) -> None:
    store.set(STARTED_KEY, "1")


def _order(task: str) -> tuple[int, int]:
    parsed = TaskId.parse(task)
    return (REPLICA_JOBS.index(parsed.job), parsed.index)


def next_tasks(
    current: Sequence[str], leaving: Sequence[str], spec_replicas: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The next generation's tasks in rank order, and its newcomers.

    Survivors keep their relative order (rank 0 stays rank 0: it never leaves, a shrink
    stops the highest-indexed workers); newcomers are the spec's replica tasks that are
    not in the group yet, appended chief first, then by index.
    """
    gone = set(leaving)
    survivors = tuple(t for t in current if t not in gone)
    present = set(current)
    newcomers = tuple(sorted((t for t in spec_replicas if t not in present), key=_order))
    return survivors + newcomers, newcomers


def share_of(global_batch: int, world: int, rank: int) -> int:
    """Rows of each global batch that ``rank`` takes when ``world`` replicas split it:
    as even as it goes, the first ``global_batch % world`` ranks one more."""
    base, extra = divmod(global_batch, world)
    return base + (1 if rank < extra else 0)


class SpecWatcher:
    """Rank 0's view of the manager's spec: who the replicas should be, and since which
    version. A daemon thread asks the manager every ``interval_s`` (``manager.spec``),
    so no step pays an RPC; the step boundary reads :meth:`latest` (a lock, no I/O).

    Args:
        fetch: returns the manager's ``{"spec", "spec_version"}`` reply, or None.
    """

    def __init__(self, fetch: Callable[[], dict[str, Any] | None], interval_s: float) -> None:
        self._fetch = fetch
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._latest: tuple[int, tuple[str, ...]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cf-spec-watch", daemon=True)

    def start(self) -> SpecWatcher:
        self._thread.start()
        return self

    def latest(self) -> tuple[int, tuple[str, ...]] | None:
        """The newest spec version seen and its replica tasks; None before any answer."""
        with self._lock:
            return self._latest

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                reply = self._fetch()
            except Exception as exc:  # a watcher never ends the training
                _log.debug("the manager's spec could not be read: %s", exc)
                reply = None
            if reply and isinstance(reply.get("spec"), dict):
                replicas = tuple(
                    f"{job}:{index}"
                    for job, tasks in reply["spec"].items()
                    if job in REPLICA_JOBS
                    for index in _indexes(tasks)
                )
                with self._lock:
                    self._latest = (int(reply.get("spec_version") or 0), replicas)
            self._stop.wait(self._interval_s)


def _indexes(tasks: Any) -> list[int]:
    """Task indexes of one job in a spec's dict form (a list, or index -> address)."""
    if isinstance(tasks, dict):
        return sorted(int(i) for i in tasks)
    return list(range(len(tasks)))
