"""How a server's methods run: what ``RpcServer.register`` records for each, and the
daemon threads that run the ``blocking`` ones."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clusterflow.errors import ClusterflowError
from clusterflow.rpc.message import Handler, Request, Response

log = logging.getLogger(__name__)

Check = Callable[[str, Any], None]
"""``check(name, piece)``: looks at one arrived frame of tensor ``name`` (a flat tensor
of its dtype) of a request sent in parts; raises to refuse the request."""


@dataclass(frozen=True, slots=True)
class Entry:
    handler: Handler
    blocking: bool
    framed: bool = False
    check: Check | None = None


def run_handler(name: str, entry: Entry, request: Request) -> Response | tuple[str, Exception]:
    """Runs ``entry``'s handler: its ``Response``, or the error code (``app`` for a
    ``ClusterflowError``, logged briefly; ``internal`` for anything else, a bug, logged
    with its traceback) and the exception. The ZeroMQ loop and the side channel
    (``rpc/side.py``) answer alike through it."""
    try:
        result = entry.handler(request)
    except Exception as exc:
        if isinstance(exc, ClusterflowError):
            log.info("%s: %s failed: %s", name, request.method, exc)
            return "app", exc
        log.exception("%s: handler of %s raised", name, request.method)
        return "internal", exc
    return result if isinstance(result, Response) else Response(body=result)


class HandlerThreads:
    """Daemon threads that run blocking handlers, started as calls need them.

    Not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so one
    handler waiting on an event that never comes would hang the process forever.
    """

    def __init__(self, size: int, name: str) -> None:
        self._size = max(1, size)
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._cond = threading.Condition()
        self._threads = 0
        self._busy = 0
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> bool:
        """Queues ``fn(*args)``; False once ``close`` was called."""
        with self._cond:
            if self._closed:
                return False
            self._busy += 1
            if self._busy > self._threads and self._threads < self._size:
                self._threads += 1
                threading.Thread(
                    target=self._work, name=f"{self._name}-handler-{self._threads}", daemon=True
                ).start()
        self._jobs.put((fn, args))
        return True

    def grow(self, size: int) -> None:
        """Allows up to ``size`` threads (never fewer than now); starts any queued work needs."""
        with self._cond:
            self._size = max(self._size, size)
            while self._busy > self._threads < self._size and not self._closed:
                self._threads += 1
                threading.Thread(
                    target=self._work, name=f"{self._name}-handler-{self._threads}", daemon=True
                ).start()

    def close(self) -> None:
        """Lets idle threads end; running handlers are abandoned, queued ones dropped."""
        with self._cond:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._jobs.put(None)

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no handler runs; True if none does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                if not self._closed:
                    fn(*args)
            except Exception:
                log.exception("%s: blocking handler thread failed", self._name)
            finally:
                del job, fn, args
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
