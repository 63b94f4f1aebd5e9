"""The dispatcher: an RPC service that lends splits of registered datasets to workers.

It is hosted wherever a cluster has a long-lived process: by the cluster manager for
clusters launched with ``clusterflow start``, by the chief's ``Server`` in manual mode.
It never reads records (workers read their splits themselves), so one dispatcher keeps
up with many workers: a call costs a dictionary update under a lock, and handlers run
inline on the RPC loop thread.

Methods (all take and give msgpack bodies):

* ``data.register``: ``{spec, locations}`` -> ``{name, num_splits, epoch}``
* ``data.lease``: ``{name, worker, host, incarnation, acks?, count?}`` ->
  ``{status: lease|wait|end, lease, leases?, retry_s, last?}``; ``acks`` are acked first (the
  simple mode's acks ride on the next ask); ``wait`` only comes at the end of the data.
  With ``count`` (1 to ``MAX_LEASES_PER_CALL``), up to that many splits are lent, each
  under its own lease, all listed in ``leases`` (``lease`` is the first): one round
  trip for a worker that reads several splits ahead; ``last`` (true) says nothing is
  left to lend after them, so a worker that stops then need not ask again
* ``data.ack``: ``{name, leases, worker?}`` -> ``{acked, duplicates}``
* ``data.release``: ``{name?, worker, leases?}`` -> ``{released}``
* ``data.status``: ``{name}`` -> counts per epoch and worker
* ``data.state_dict`` / ``data.load_state_dict``: the cursor, for checkpoints
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from clusterflow._checks import seconds
from clusterflow.data.api import (
    DatasetConflictError,
    DatasetSpec,
    UnknownDatasetError,
)
from clusterflow.data.leases import Grant, GrantStatus, LeaseBook
from clusterflow.data.messages import (
    ACK,
    LEASE,
    LOAD_STATE_DICT,
    REGISTER,
    RELEASE,
    SERVICE,
    STATE_DICT,
    STATUS,
    AckRequest,
    LeaseReply,
    LeaseRequest,
    RegisterRequest,
    ReleaseRequest,
    StatusRequest,
)
from clusterflow.errors import ConfigError
from clusterflow.rpc import Request, body_map
from clusterflow.rpc.fencing import FenceBook

log = logging.getLogger(__name__)


class Registrar(Protocol):
    """Anything that serves RPC methods: an ``RpcServer`` or a ``Server``."""

    def register(
        self, method: str, handler: Callable[[Request], Any], *, blocking: bool = False
    ) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatcherConfig:
    """How long leases live and how workers are paced while they wait."""

    lease_timeout_s: float = 300.0
    """A worker silent this long loses its leases. Long enough for a slow step and a
    checkpoint pause; the manager's ``release_worker`` covers deaths much sooner."""
    retry_s: float = 0.005
    """How soon a worker told to wait (the end of the data) asks again, at first."""

    def __post_init__(self) -> None:
        seconds("lease_timeout_s", self.lease_timeout_s)
        seconds("retry_s", self.retry_s)


class DispatcherService:
    """Lends the splits of registered datasets as leases; see the module docstring.

    Thread-safe: RPC handlers and the manager's ``release_worker`` may run at once.

    Args:
        config: lease deadline and retry pacing.
        clock: seconds, monotonic; injected so tests can move time by hand.
    """

    def __init__(
        self,
        config: DispatcherConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or DispatcherConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._books: dict[str, LeaseBook] = {}
        self._issued: dict[str, int] = {}
        """Per dataset, the first lease id no book of it has issued yet, kept across
        restores: lease ids are never issued twice in this dispatcher's life."""
        self.fences = FenceBook()
        """rpc/fencing.py: the manager raises a task's bar when it relaunches the task."""

    def register_on(self, server: Registrar) -> DispatcherService:
        """Serves ``data.*`` on ``server`` (an ``RpcServer`` or a ``Server``)."""
        handlers: dict[str, Callable[[Request], Any]] = {
            REGISTER: self._on_register,
            LEASE: self._on_lease,
            ACK: self._on_ack,
            RELEASE: self._on_release,
            STATUS: self._on_status,
            STATE_DICT: self._on_state_dict,
            LOAD_STATE_DICT: self._on_load_state_dict,
        }
        for method, handler in handlers.items():
            server.register(method, self.fences.guard(handler))
        self.fences.register_on(server, SERVICE)
        return self

    # In-process API (the manager, the chief, tests) -------------------------------------

    def register(
        self, spec: DatasetSpec, locations: list[list[Any]] | None = None
    ) -> dict[str, Any]:
        """Defines ``spec.name``, or joins it if an equal spec was registered before.

        Raises:
            DatasetConflictError: the name is taken by a different definition.
        """
        with self._lock:
            book = self._books.get(spec.name)
            if book is None:
                book = LeaseBook(spec, lease_timeout_s=self.config.lease_timeout_s)
                book.issue_ids_from(self._issued.get(spec.name, 1))
                self._books[spec.name] = book
                log.info(
                    "dataset %r registered: %d records from %s in %d splits, seed %d, epochs %s",
                    spec.name,
                    spec.num_records,
                    spec.source,
                    spec.num_splits,
                    spec.seed,
                    spec.epochs,
                )
            elif book.spec != spec:
                raise DatasetConflictError(
                    f"dataset {spec.name!r} is already registered with another definition "
                    f"({'; '.join(book.spec.differences(spec))}); "
                    "every worker must register the same source, split size, seed and epochs"
                )
            if locations:
                book.set_locations(locations)
            return {"name": spec.name, "num_splits": spec.num_splits, "epoch": book.epoch}

    def lease(
        self,
        name: str,
        worker: str,
        host: str | None = None,
        incarnation: str | None = None,
        *,
        count: int = 1,
        acks: list[int] | None = None,
    ) -> Grant:
        """The next split for ``worker`` (up to ``count`` of them), or word to wait or stop.

        ``acks`` are acked first, under the same lock (the simple mode's acks ride on
        the next ask). If one cannot be acked, nothing is lent.

        Raises:
            UnknownDatasetError: nobody registered ``name``.
            UnknownLeaseError: an ack names a lease that cannot be acked.
        """
        with self._lock:
            book = self._book(name)
            now = self._clock()
            if acks:
                book.ack(acks, now, worker)
            return book.grant(worker, host, now, incarnation, count)

    def ack(self, name: str, lease_ids: list[int], worker: str | None = None) -> dict[str, int]:
        """Marks leases applied.

        Raises:
            UnknownDatasetError: nobody registered ``name``.
            UnknownLeaseError: an id was never issued or was lent again; names each one.
        """
        with self._lock:
            result = self._book(name).ack(lease_ids, self._clock(), worker)
        return {"acked": result.acked, "duplicates": result.duplicates}

    def release_worker(self, worker: str, name: str | None = None) -> int:
        """Puts the unacked leases of ``worker`` back in the queue at once.

        The manager calls this when it learns a task died (``worker`` is the task's
        name as ``CLUSTERFLOW_TASK`` gave it to the job, e.g. ``"worker:1"``); a client
        calls it on ``close()``. Returns how many leases went back.
        """
        with self._lock:
            books = [self._book(name)] if name is not None else list(self._books.values())
            return sum(book.release_worker(worker) for book in books)

    def release_leases(self, name: str, worker: str, lease_ids: list[int]) -> int:
        """Puts back the given leases of ``worker``: one client closing early."""
        with self._lock:
            return self._book(name).release_leases(worker, lease_ids)

    def status(self, name: str) -> dict[str, Any]:
        with self._lock:
            book = self._book(name)
            book.expire(self._clock())
            return book.status()

    def state_dict(self) -> dict[str, Any]:
        """Every dataset's cursor, by name: what a checkpoint stores."""
        with self._lock:
            return {"datasets": {name: b.state_dict() for name, b in self._books.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores cursors saved by ``state_dict``; datasets not named are kept.

        Call before workers start leasing: leases lent before the restore are dropped
        (acks of them are refused), and each restored epoch hands out exactly the splits
        the cursor had not acked.

        Raises:
            ConfigError: the state is malformed.
        """
        datasets = state.get("datasets") if isinstance(state, Mapping) else None
        if not isinstance(datasets, Mapping):
            raise ConfigError("not a data dispatcher state: no 'datasets' mapping")
        restored = {
            name: LeaseBook.from_state(cursor, lease_timeout_s=self.config.lease_timeout_s)
            for name, cursor in datasets.items()
        }
        with self._lock:
            for name, (book, requeued) in restored.items():
                old = self._books.get(name)
                if old is not None:
                    self._retire(name, old)
                book.issue_ids_from(self._issued.get(name, 1))
                if old is not None and old.outstanding():
                    log.warning(
                        "dataset %r: restoring a cursor drops %d outstanding leases",
                        name,
                        len(old.outstanding()),
                    )
                self._books[name] = book
                log.info(
                    "dataset %r restored at epoch %d (%d outstanding splits back in the queue)",
                    name,
                    book.epoch,
                    requeued,
                )

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Forgets every dataset, then restores ``state`` if given: a whole-cluster restart.

        The restarted workers register their datasets again (an equal definition joins
        the restored cursor); leases of the old incarnation are gone with their books.
        """
        with self._lock:
            for name, book in self._books.items():
                self._retire(name, book)
            self._books.clear()
        if state is not None:
            self.load_state_dict(state)

    def _retire(self, name: str, book: LeaseBook) -> None:
        """Remembers the ids ``book`` issued before it is replaced (the lock is held)."""
        self._issued[name] = max(self._issued.get(name, 1), book.next_lease_id)

    # RPC handlers -----------------------------------------------------------------------

    def _book(self, name: str | None) -> LeaseBook:
        book = self._books.get(name) if isinstance(name, str) else None
        if book is None:
            known = ", ".join(sorted(self._books)) or "none"
            raise UnknownDatasetError(f"no dataset {name!r} registered here (registered: {known})")
        return book

    def _on_register(self, request: Request) -> dict[str, Any]:
        register = RegisterRequest.from_wire(request.body)
        return self.register(register.spec, register.locations)

    def _on_lease(self, request: Request) -> dict[str, Any]:
        ask = LeaseRequest.from_wire(request.body)
        grant = self.lease(
            ask.name,
            ask.worker,
            ask.host,
            ask.incarnation,
            count=1 if ask.count is None else ask.count,
            acks=list(ask.acks) or None,
        )
        retry = self.config.retry_s if grant.status == GrantStatus.WAIT else 0.0
        return LeaseReply(grant.status.value, tuple(grant.leases), retry, grant.last).to_wire()

    def _on_ack(self, request: Request) -> dict[str, int]:
        ack = AckRequest.from_wire(request.body)
        return self.ack(ack.name, list(ack.leases), ack.worker)

    def _on_release(self, request: Request) -> dict[str, int]:
        release = ReleaseRequest.from_wire(request.body)
        if release.leases is not None:
            assert release.name is not None  # the request type requires it
            released = self.release_leases(release.name, release.worker, list(release.leases))
        else:
            released = self.release_worker(release.worker, release.name)
        return {"released": released}

    def _on_status(self, request: Request) -> dict[str, Any]:
        return self.status(StatusRequest.from_wire(request.body).name)

    def _on_state_dict(self, request: Request) -> dict[str, Any]:
        return self.state_dict()

    def _on_load_state_dict(self, request: Request) -> None:
        self.load_state_dict(body_map(f"{LOAD_STATE_DICT} body", request.body))
