"""The worker side: lease splits, read them ahead, and yield batches to the training loop.

Two background threads keep data ready: one keeps several splits leased ahead of need,
asking for them several per call (so the dispatcher's round trip is off the critical
path, and paid once per several splits), the other reads each leased split from the
source (I/O and decoding, which release the GIL) and shuffles it, the next one while the
training loop cuts the current one. The training
loop's ``next()`` cuts the read splits into batches and collates them (``batching.py``
says why there). Every ``Batch`` says which leases it holds records of and which leases
it *completes*: once the update computed from a batch is applied, its completed leases
may be acked (by the parameter server carrying them, by ``ack_through``, or, in the
simple mode, automatically when the next batch is asked for).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from clusterflow.data.api import (
    DataError,
    DatasetSpec,
    Lease,
    LocatedSource,
    Source,
    SourceError,
    SplitKey,
    describe_source,
)
from clusterflow.data.batching import Batch, Batcher, ReadSplit
from clusterflow.data.collate import Collate, take, torch_collate, writable
from clusterflow.data.config import DataConfig
from clusterflow.data.dispatcher_client import DispatcherClient
from clusterflow.data.env import default_worker_name
from clusterflow.data.splits import location_runs, shuffle_buffer_order, split_range, split_seed
from clusterflow.errors import ConfigError
from clusterflow.rpc import Credentials, RpcClient, RpcServer

log = logging.getLogger(__name__)

MAX_WAIT_S = 0.02
"""Longest pause between asks while the last splits are out with other workers: the
latency of the end-of-data barrier, against one cheap dispatcher call per pause."""

ACK_DUE_S = 5.0
"""Longest an ack of the simple mode waits for a lease call to ride on before it goes
alone. With splits leased ahead, lease calls come once per several splits; the acks are
also what tells the dispatcher this worker is alive (its lease deadline), so a slow
training loop must not hold them for as long as it takes to use up several splits."""


@dataclass(slots=True)
class _Failure:
    error: BaseException


_END = object()
_WAIT = object()


class DataClient:
    """Iterates over this worker's share of a dataset, epoch after epoch.

    Build it in every worker with the same source and ``DataConfig``; iterate once.
    Registration happens here (so a conflicting definition fails at once); leasing
    starts on ``start()`` or the first ``next()``. Close it (or use ``with``) so that
    leases it holds unacked go back to the queue at once.

    Args:
        source: where records are read (every worker opens its own).
        config: the dataset definition and how this worker consumes it.
        dispatcher: a ``DispatcherClient`` or ``RpcClient`` to the dispatcher, or its
            ``host:port`` (``distributed_dataset`` finds it from the environment).
        credentials: the cluster's secret when ``dispatcher`` is an address.
        collate_fn: columns of a batch -> what the step gets; default ``torch_collate``.
        worker: this worker's name: the dispatcher's unit of failure. Default: the task
            (``CLUSTERFLOW_TASK`` or ``TF_CONFIG``), else ``host:pid``.
        host: this worker's host, matched against sources' location hints.

    Raises:
        RemoteError: another worker registered the name with a different definition
            (``error_type`` ``DatasetConflictError``, the message names each field).
    """

    def __init__(
        self,
        source: Source,
        config: DataConfig,
        *,
        dispatcher: DispatcherClient | RpcClient | str,
        credentials: Credentials | None = None,
        collate_fn: Collate | None = None,
        worker: str | None = None,
        host: str | None = None,
        _owned: RpcServer | None = None,
    ) -> None:
        self.source = source
        self.config = config
        self.worker = worker or default_worker_name()
        self.host = host if host is not None else socket.gethostname()
        self._owned_server = _owned
        self._owns_rpc = isinstance(dispatcher, str)
        if isinstance(dispatcher, str):
            if credentials is None:
                raise ConfigError(f"credentials are required to reach the dispatcher {dispatcher}")
            dispatcher = RpcClient(dispatcher, credentials)
        self.dispatcher = (
            dispatcher if isinstance(dispatcher, DispatcherClient) else DispatcherClient(dispatcher)
        )
        try:
            self.spec = DatasetSpec(
                name=config.name,
                source=describe_source(source),
                num_records=source.num_records(),
                split_size=config.split_size,
                seed=config.seed,
                epochs=config.epochs,
            )
            self.dispatcher.register(self.spec, _locations(source, self.spec))
        except BaseException:
            if self._owns_rpc:
                self.dispatcher.rpc.close()
            raise
        self._batcher = Batcher(config.batch_size, collate_fn or torch_collate, config.name)
        splits_ahead = -(-config.prefetch * config.batch_size // config.split_size)
        self._splits: queue.Queue[Any] = queue.Queue(maxsize=splits_ahead)  # read splits
        self._leases: queue.Queue[Any] = queue.Queue()  # leases from the fetcher
        self._stop = threading.Event()
        self._wake = threading.Event()  # an ack of ours may end the fetcher's wait
        self._fetcher: threading.Thread | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # the reader took a lease
        self._ahead = 0  # leases fetched that the reader has not taken yet
        self._held: set[int] = set()
        self._lease_of: dict[SplitKey, int] = {}  # held leases by their split's key
        self._auto = config.auto_ack
        self._on_wait: Callable[[], None] | None = None
        self._wait_every_s: float | None = None
        self._waited = False  # the reader said _WAIT and nothing came since
        self._delivered: deque[tuple[int, tuple[int, ...]]] = deque()
        self._auto_acks: list[int] = []  # the simple mode's, sent with the next lease call
        self._acks_since = 0.0  # when the oldest of them was taken (time.monotonic)
        self._split: ReadSplit | None = None  # being cut into batches
        self._pushback: Any = None  # an end or failure, once the held-back batch is out
        self._done = False
        self._closed = False

    # The training loop's side --------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        """The next batch; in ``auto_ack`` mode, first acks the batches handed out before.

        Blocks until a batch is ready or the data ends.

        Raises:
            StopIteration: every epoch is complete (or, without ``wait_for_all_acks``,
                nothing is left to lend).
            CollateError: a record could not be collated (names split and record).
            SourceError: a split could not be read.
            RpcError: the dispatcher could not be reached.
        """
        if self._closed:
            raise DataError(f"data client of {self.spec.name!r} is closed")
        if self._auto and self._delivered:
            self._mark_delivered_done()
        if self._done:
            raise StopIteration
        if self._reader is None:
            self._start()
        try:
            batch = self._next_batch()
        except BaseException:
            self._done = True
            raise
        if batch is None:
            self._done = True
            self._flush_auto_acks()
            raise StopIteration
        if batch.completes:
            self._delivered.append((batch.index, batch.completes))
        return batch

    def start(self) -> DataClient:
        """Starts reading ahead now (e.g. while the model is built); ``next()`` does too.

        Leases taken from here on count as this worker's; ``close()`` hands back those
        not acked.
        """
        if self._closed:
            raise DataError(f"data client of {self.spec.name!r} is closed")
        self._start()
        return self

    def ack(self, lease_ids: Iterable[int]) -> dict[str, int]:
        """Acks leases now: call once the update computed from their records is applied.

        Raises:
            RemoteError: a lease is unknown to the dispatcher; the message names it.
        """
        ids = [int(x) for x in lease_ids]
        if not ids:
            return {"acked": 0, "duplicates": 0}
        reply = self.dispatcher.ack(self.spec.name, ids, self.worker)
        self._acked(ids)
        self._wake.set()
        return reply

    def set_batch_size(self, batch_size: int) -> None:
        """Cuts the batches from here on with ``batch_size`` records (a resized
        all-reduce group keeps its global batch: each replica's share changes). Records
        already held back for the next batch stay in it.

        Raises:
            ConfigError: ``batch_size`` is below 1.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self._batcher.batch_size = batch_size

    def held_records(self) -> int:
        """Records read but not yet cut into a batch: the rest of the split being cut
        and those held back for the next batch. A batch of this size completes every
        split begun, without starting another (a replica that leaves a resizing group
        finishes its splits so: given back half trained, they would be trained twice)."""
        split = self._split
        return self._batcher.held + (split.remaining if split is not None else 0)

    def manual_acks(
        self, on_wait: Callable[[], None] | None = None, *, every_s: float | None = None
    ) -> None:
        """From now on ``next()`` acks nothing: the training loop acks each split once
        its update is applied (``ack_keys``), or gives it back (``release_keys``).

        ``fit`` and ``TrainingSession`` call it when they take a step's keys, whatever
        ``auto_ack`` says: acking on ``next()`` would ack a split whose update a parameter
        server may still drop or lose.

        Args:
            on_wait: called on the training loop's thread when ``next()`` is about to
                wait at the end of the data for splits still out: the loop settles its
                own last steps there (their acks may be what the wait is for).
            every_s: call ``on_wait`` again every ``every_s`` while the wait lasts
                (None: once). A resizing all-reduce replica takes part in its peers'
                steps from there: they may be training the very splits it waits for.
        """
        self._auto = False
        if on_wait is not None:
            self._on_wait = on_wait
            self._wait_every_s = every_s

    def ack_keys(self, keys: Iterable[SplitKey]) -> dict[str, int]:
        """Acks the splits named by ``keys`` (``Batch.keys``): their update is applied.

        Keys of splits this client no longer holds (acked already) are skipped.

        Raises:
            RemoteError: the dispatcher does not know a lease (it took it back).
        """
        with self._lock:
            ids = [self._lease_of[k] for k in keys if k in self._lease_of]
        reply = self.ack(ids)
        with self._lock:  # batches whose every lease is settled need no ack_through
            while self._delivered and not self._held.intersection(self._delivered[0][1]):
                self._delivered.popleft()
        return reply

    def release_keys(self, keys: Iterable[SplitKey]) -> int:
        """Gives the splits named by ``keys`` back to the dispatcher, for any worker.

        Call when their update was dropped (a late or backup replica's push in a sync
        step, or one over ``max_staleness``): acking would lose their records.
        Returns how many went back.
        """
        with self._lock:
            ids = [self._lease_of[k] for k in keys if k in self._lease_of]
        if not ids:
            return 0
        released = self.dispatcher.release(self.spec.name, self.worker, ids)
        self._acked(ids)  # no longer held: the dispatcher lends them again
        self._wake.set()
        return released

    def ack_through(self, batch: Batch) -> dict[str, int]:
        """Acks every lease completed by ``batch`` or by a batch handed out before it.

        Call after the update computed from ``batch`` is applied (after ``step()``).
        """
        ids: list[int] = []
        while self._delivered and self._delivered[0][0] <= batch.index:
            ids.extend(self._delivered.popleft()[1])
        with self._lock:  # not those acked or given back by key meanwhile
            ids = [i for i in ids if i in self._held]
        return self.ack(ids)

    def status(self) -> dict[str, Any]:
        """The dispatcher's view of this dataset (epoch, pending, outstanding, per worker)."""
        return self.dispatcher.status(self.spec.name)

    def state_dict(self) -> dict[str, Any]:
        """The dispatcher's cursor of every dataset (for the chief's checkpoint)."""
        return self.dispatcher.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a cursor on the dispatcher; call before any worker starts iterating."""
        self.dispatcher.load_state_dict(state)

    def close(self) -> None:
        """Stops reading ahead and hands back the leases this client holds unacked.

        Leases of batches that were handed out but not acked go back too: their records
        will be delivered again (to any worker), since their update may not be applied.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        with self._room:
            self._room.notify_all()
        if self._reader is not None:
            while self._reader.is_alive():
                self._drain()
                self._reader.join(0.05)
            self._drain()
            self._splits.put_nowait(_END)  # a next() blocked on another thread returns
        if self._fetcher is not None:
            # At most one dispatcher call is in flight; its deadline bounds this wait.
            self._fetcher.join(self.dispatcher.rpc.deadline + 1.0)
        held: list[int] = []
        try:
            self._flush_auto_acks()
            with self._lock:
                held = sorted(self._held)
            if held:
                released = self.dispatcher.release(self.spec.name, self.worker, held)
                log.info("%s: handed back %d of %d held leases", self.worker, released, len(held))
        except Exception as exc:  # the dispatcher's deadline brings them back anyway
            log.warning("%s: could not hand back leases %s: %s", self.worker, held, exc)
        finally:
            if self._owns_rpc:
                self.dispatcher.rpc.close()
            if self._owned_server is not None:
                self._owned_server.stop()

    def __enter__(self) -> DataClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Cutting batches (the training loop's thread) -------------------------------------

    def _next_batch(self) -> Batch | None:
        """The next batch, or None at the end of the data."""
        batcher = self._batcher
        while True:
            split = self._split
            if split is not None and split.pos < split.size:
                batch = batcher.cut(split)
                if batch is not None:
                    return batch
                continue
            item = self._pushback if self._pushback is not None else self._take_split()
            self._pushback = None
            self._waited = item is _WAIT
            if isinstance(item, ReadSplit):
                self._split = item
                if batcher.starts_new_epoch(item):
                    return batcher.flush()  # batches never mix epochs
                continue
            # Nothing more to cut for now: hand out the records held back, or the leases
            # they belong to could never be acked (and the epoch never complete).
            held_back = batcher.flush()
            if item is _WAIT:
                if held_back is not None:
                    self._pushback = _WAIT  # settle after the held-back batch, not before
                    return held_back
                if self._on_wait is not None:
                    self._on_wait()
                continue
            if held_back is not None:
                self._pushback = item
                return held_back
            if isinstance(item, _Failure):
                raise item.error
            return None

    def _take_split(self) -> Any:
        """The reader's next item; while waiting after a ``_WAIT``, calls ``on_wait``
        every ``every_s`` (``manual_acks``)."""
        every, on_wait = self._wait_every_s, self._on_wait
        if every is None or on_wait is None or not self._waited:
            return self._splits.get()
        while True:
            try:
                return self._splits.get(timeout=every)
            except queue.Empty:
                on_wait()

    # Acks -----------------------------------------------------------------------------

    def _mark_delivered_done(self) -> None:
        """The simple mode: the batches handed out so far are applied; their completed
        leases ride to the dispatcher with the fetcher's next call, so the training loop
        never waits on the network."""
        if not self._delivered:
            return
        with self._lock:
            if not self._auto_acks:
                self._acks_since = time.monotonic()
            while self._delivered:
                self._auto_acks.extend(self._delivered.popleft()[1])
        self._wake.set()

    def _acks_due(self) -> bool:
        """Whether the simple mode's acks waited ``ACK_DUE_S`` for a lease call."""
        with self._lock:
            return bool(self._auto_acks) and time.monotonic() - self._acks_since >= ACK_DUE_S

    def _flush_auto_acks(self) -> None:
        acks = self._take_auto_acks()
        if acks:
            self.dispatcher.ack(self.spec.name, acks, self.worker)
            self._acked(acks)

    def _take_auto_acks(self) -> list[int]:
        with self._lock:
            ids, self._auto_acks = self._auto_acks, []
        return ids

    def _acked(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            self._held.difference_update(ids)
            gone = set(ids)
            for key in [k for k, lid in self._lease_of.items() if lid in gone]:
                del self._lease_of[key]

    # The background threads -----------------------------------------------------------

    def _start(self) -> None:
        if self._reader is None:
            self._fetcher = threading.Thread(
                target=self._fetch_loop, name=f"data-{self.spec.name}-lease", daemon=True
            )
            self._reader = threading.Thread(
                target=self._read_loop, name=f"data-{self.spec.name}-read", daemon=True
            )
            self._fetcher.start()
            self._reader.start()

    def _drain(self) -> None:
        try:
            while True:
                self._splits.get_nowait()
        except queue.Empty:
            pass

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._splits.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fetch_loop(self) -> None:
        """Keeps ``leases_ahead`` leases ahead of the reading thread, so a split is read
        while more are on their way: the dispatcher's round trip leaves the critical path.
        It asks once half of them are taken, for as many as are missing, in one call."""
        most = self.config.leases_ahead
        refill_at = most // 2  # ask when this many or fewer are left (1 ahead: at 0)
        wait_s = 0.0
        waiting = False
        try:
            while not self._stop.is_set():
                with self._room:
                    full = self._ahead > refill_at
                    if full:
                        self._room.wait(0.1)
                    count = most - self._ahead
                if full:
                    if self._acks_due():  # no lease call soon: they go alone
                        self._flush_auto_acks()
                    continue
                acks = self._take_auto_acks()
                reply = self.dispatcher.lease_many(
                    self.spec.name, self.worker, self.host, count, acks
                )
                self._acked(acks)
                status = reply.status
                if status == "lease":
                    with self._lock:
                        for lease in reply.leases:
                            self._held.add(lease.lease_id)
                            self._lease_of[self._key(lease)] = lease.lease_id
                        self._ahead += len(reply.leases)
                    for lease in reply.leases:
                        self._leases.put(lease)
                    if reply.last and not self.config.waits_for_all_acks:
                        # Nothing is left to lend: the next ask could only be told to
                        # stop (a call on the dispatcher and on this process per pass).
                        self._leases.put(_END)
                        return
                    wait_s, waiting = 0.0, False
                    continue
                if status == "end" or not self.config.waits_for_all_acks:
                    self._leases.put(_END)
                    return
                if not waiting:  # say it once: the reader hands out what it holds back
                    waiting = True
                    self._leases.put(_WAIT)
                wait_s = min(MAX_WAIT_S, max(reply.retry_s or 0.005, wait_s * 2))
                self._wake.wait(wait_s)
                self._wake.clear()
        except BaseException as exc:
            log.debug("%s: leasing %r stopped: %s", self.worker, self.spec.name, exc)
            self._leases.put(_Failure(exc))

    def _read_loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._leases.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(item, Lease):
                    with self._room:  # taken: the fetcher may ask for more
                        self._ahead -= 1
                        self._room.notify()
                    self._put(self._read(item))
                    continue
                if not self._put(item) or item is not _WAIT:
                    return
        except BaseException as exc:
            log.debug("%s: reading %r stopped: %s", self.worker, self.spec.name, exc)
            self._put(_Failure(exc))

    def _read(self, lease: Lease) -> ReadSplit:
        """A lease's records, shuffled if asked, in memory that tensors can share."""
        try:
            columns = self.source.read(lease.start, lease.stop)
        except DataError:
            raise
        except Exception as exc:
            raise SourceError(
                f"{self.spec.source}: cannot read records [{lease.start}, {lease.stop}) "
                f"of lease {lease.lease_id}: {type(exc).__name__}: {exc}"
            ) from exc
        lengths = {k: len(v) for k, v in columns.items()}
        if not columns or set(lengths.values()) != {len(lease)}:
            raise SourceError(
                f"{self.spec.source}: read of records [{lease.start}, {lease.stop}) gave "
                f"columns of lengths {lengths}, expected {len(lease)} each"
            )
        if self.config.shuffle_buffer > 1 and len(lease) > 1:
            split = lease.start // self.spec.split_size
            rng = split_seed(self.spec.seed, lease.epoch, split)
            order = shuffle_buffer_order(len(lease), self.config.shuffle_buffer, rng)
            return ReadSplit(lease, take(columns, order), order, key=self._key(lease))
        return ReadSplit(lease, writable(columns), None, key=self._key(lease))

    def _key(self, lease: Lease) -> SplitKey:
        return SplitKey(self.spec.name, lease.epoch, lease.start // self.spec.split_size)


def _locations(source: Source, spec: DatasetSpec) -> list[list[Any]]:
    """The source's location hints per split, as runs; empty when it gives none."""
    if not isinstance(source, LocatedSource) or not getattr(source, "has_locations", True):
        return []
    hosts = (
        source.location(*split_range(i, spec.num_records, spec.split_size))
        for i in range(spec.num_splits)
    )
    return [list(run) for run in location_runs(hosts)]
