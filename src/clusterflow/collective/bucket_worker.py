"""One thread per model that runs each gradient bucket's collectives in DDP's order.

An all-reduce built of several collectives (a reduce inside a host, an all-reduce across
hosts, a broadcast back: ``collective/hierarchy.py``) cannot be issued from completion
callbacks: collectives on a group must be issued in one order by all its members, and
callbacks run in whatever order the previous phase happened to finish on each replica.
DDP hands buckets to its comm hook in the same order on every replica, so one thread
that takes them first in, first out and runs each bucket's phases to the end issues
them in one order everywhere. The backward pass goes on while the thread works, as with
DDP's own asynchronous all-reduce.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

__all__ = ["BucketWorker"]


class BucketWorker:
    """Sums each submitted bucket with ``reduce`` on its own thread, then averages it.

    Args:
        reduce: sums a 1-D tensor in place over the replicas (blocking).
        replicas: the divisor that turns the sum into the mean.
        name: the thread's name.

    After a failure every later bucket fails with the same error at once, in order: the
    groups are broken, and DDP raises the first error to the step that waits for it.
    """

    def __init__(self, reduce: Callable[[torch.Tensor], object], replicas: int, name: str):
        self.reduce = reduce
        self.replicas = replicas
        self.buckets = 0
        """Buckets reduced so far."""
        self._work: queue.SimpleQueue[
            tuple[torch.Tensor, torch.futures.Future[torch.Tensor]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Queues ``tensor``; the future gives it back as the mean over the replicas."""
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._work.put((tensor, done))
        return done

    def close(self) -> None:
        """Stops the thread once the buckets queued before have been reduced."""
        self._work.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        failed: BaseException | None = None
        while (item := self._work.get()) is not None:
            tensor, done = item
            if failed is not None:
                done.set_exception(failed)  # type: ignore[arg-type]  # torch types it as T
                continue
            try:
                self.reduce(tensor)
                tensor.div_(self.replicas)
            except Exception as exc:
                failed = exc
                done.set_exception(exc)  # type: ignore[arg-type]
            else:
                self.buckets += 1
                done.set_result(tensor)
