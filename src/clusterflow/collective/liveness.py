"""Heartbeats through the rendezvous store, so a failed collective can name the lost peer.

gloo reports a dead peer as ``Connection reset by peer [127.0.0.1]:4295`` and a hung one
as ``Timed out waiting 8000ms for recv``: neither says which rank, let alone which task.
Each replica therefore bumps a counter in the store every ``interval_s`` from a daemon
thread, and watches its peers' counters; when a collective fails, the peers whose
counter stopped moving are the ones lost. The thread runs beside the training loop, not
inside a collective, so a peer blocked in a healthy collective still beats, while a
killed or stopped (SIGSTOP) one does not.

The counters live in torch's TCPStore, which every replica already reaches; a store that
stops answering means its host is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["CounterStore", "Diagnosis", "Liveness"]

_log = logging.getLogger(__name__)


class CounterStore(Protocol):
    """The part of ``torch.distributed.Store`` the heartbeats use."""

    def add(self, key: str, value: int, /) -> int: ...


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Which peers a failed collective lost."""

    lost: tuple[int, ...]
    """Ranks whose heartbeat stopped, stalest first."""
    silent_s: tuple[float, ...]
    """For each lost rank, seconds since its counter last moved."""
    store_error: str | None = None
    """Why the store stopped answering, if it did (its host is gone)."""


class Liveness:
    """Beats for this rank and watches the others; call :meth:`start`, then :meth:`diagnose`.

    Args:
        store: a store client used only by this object's thread, under a key prefix of its
            own (the caller passes a clone of the rendezvous store's connection).
        rank: this replica's rank.
        world_size: every replica, this one included.
        interval_s: seconds between beats; each beat costs ``world_size`` small store calls.
        stale_s: a peer whose counter has not moved for this long is lost. Four beats, so
            a peer briefly starved of CPU on a busy host is not declared dead.
    """

    def __init__(
        self,
        store: CounterStore,
        rank: int,
        world_size: int,
        *,
        interval_s: float = 0.5,
        stale_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._rank = rank
        self._peers = tuple(r for r in range(world_size) if r != rank)
        self._interval_s = interval_s
        self._stale_s = stale_s
        self._clock = clock
        now = clock()
        self._counts: dict[int, int] = dict.fromkeys(self._peers, -1)
        self._moved_at: dict[int, float] = dict.fromkeys(self._peers, now)
        self._store_error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peers(self) -> Sequence[int]:
        return self._peers

    def start(self) -> None:
        """Starts the daemon thread; it beats once before returning, so peers see us."""
        self.beat()
        self._thread = threading.Thread(
            target=self._loop, name=f"clusterflow-liveness-{self._rank}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread (at most one interval later); idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self._interval_s * 4)
        self._thread = None

    def beat(self) -> None:
        """One heartbeat: bump our counter, read the peers'. Called by the thread."""
        try:
            self._store.add(self._key(self._rank), 1)
            counts = {peer: self._store.add(self._key(peer), 0) for peer in self._peers}
        except Exception as exc:  # any store failure: connection reset, timeout, closed
            with self._lock:
                if self._store_error is None:
                    _log.debug("liveness store failed: %s", exc)
                    self._store_error = str(exc).splitlines()[0] if str(exc) else repr(exc)
            return
        now = self._clock()
        with self._lock:
            for peer, count in counts.items():
                if count != self._counts[peer]:
                    self._counts[peer] = count
                    self._moved_at[peer] = now

    def diagnose(self, wait_s: float) -> Diagnosis:
        """The peers lost so far, waiting up to ``wait_s`` for a just-killed one to go stale.

        A peer killed a moment ago (gloo notices a closed socket at once) beat less than
        ``stale_s`` ago, so this waits until some peer is stale, the store fails, or
        ``wait_s`` passes; a peer that hung long enough for a collective to time out is
        already stale and is returned at once.
        """
        deadline = self._clock() + max(0.0, wait_s)
        while True:
            diagnosis = self._snapshot()
            if diagnosis.lost or diagnosis.store_error or self._clock() >= deadline:
                return diagnosis
            time.sleep(min(self._interval_s / 2, max(0.0, deadline - self._clock())))

    def _snapshot(self) -> Diagnosis:
        now = self._clock()
        with self._lock:
            silent = {peer: now - self._moved_at[peer] for peer in self._peers}
            error = self._store_error
        lost = sorted((p for p, s in silent.items() if s > self._stale_s), key=lambda p: -silent[p])
        return Diagnosis(tuple(lost), tuple(silent[p] for p in lost), error)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.beat()

    @staticmethod
    def _key(rank: int) -> str:
        return f"beat/{rank}"
