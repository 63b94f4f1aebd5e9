"""Fencing: a task the manager replaced can no longer change anything.

A worker cut off by a partition looks dead to the manager, which relaunches it; when
the link heals, the old process (a *zombie*) is still alive and still pushing. Each
launch of a task therefore carries an *incarnation number*, the task's relaunch count
(``CLUSTERFLOW_INCARNATION``, set by the manager), and every request a task sends to a
ps or to the dispatcher carries ``fence: [task, incarnation]``. A service keeps, per
task, the highest incarnation it has heard of, from the task itself or, for the
dispatcher, from the manager at the moment it relaunches the task, and refuses a
request of an older one with ``TaskFenced``. The zombie's client turns that answer
into a ``TaskFenced`` raised in its training loop: it stops itself, having applied
nothing after its replacement started (docs/failure-semantics.md, "Fencing").

Requests without a fence (manual mode, in-process services, older clients) are served
as before: fencing is for tasks a manager relaunches.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from clusterflow.cluster.contract import ENV_INCARNATION, ENV_TASK
from clusterflow.errors import ClusterflowError
from clusterflow.rpc.errors import ProtocolError, RemoteError
from clusterflow.rpc.message import Handler, Request

log = logging.getLogger(__name__)

FENCE_KEY: Final = "fence"
"""The body key of a fenced request: ``[task, incarnation]``."""


class TaskFenced(ClusterflowError):
    """This task was replaced by a newer incarnation: it must stop, and applies nothing."""


@dataclass(frozen=True, slots=True)
class Fence:
    """Who sends a request: a task and its incarnation number."""

    task: str
    incarnation: int

    def to_wire(self) -> list[Any]:
        return [self.task, self.incarnation]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Fence | None:
        """This process's fence, when a manager launched it; None otherwise."""
        env = os.environ if environ is None else environ
        task, number = env.get(ENV_TASK), env.get(ENV_INCARNATION)
        if not task or number is None or not number.isdigit():
            return None
        return cls(task, int(number))


def stamp(body: Any, fence: Fence | None) -> Any:
    """``body`` with the fence added, when both are there and the body is a map."""
    if fence is None or not isinstance(body, dict):
        return body
    return {**body, FENCE_KEY: fence.to_wire()}


def raise_if_fenced(exc: RemoteError) -> None:
    """Turns a service's ``TaskFenced`` answer into ``TaskFenced`` here: the zombie stops.

    Raises:
        TaskFenced: ``exc`` is that answer.
    """
    if exc.error_type == TaskFenced.__name__:
        log.error("this task was replaced and is fenced off; stopping: %s", exc)
        raise TaskFenced(str(exc)) from None


class FenceBook:
    """The highest incarnation heard of per task; refuses older ones. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._highest: dict[str, int] = {}

    def raise_to(self, task: str, incarnation: int) -> None:
        """A newer incarnation exists (the manager relaunched ``task``)."""
        with self._lock:
            if incarnation > self._highest.get(task, -1):
                self._highest[task] = incarnation

    def admit(self, task: str, incarnation: int) -> None:
        """Lets a request of ``task``'s ``incarnation`` through, or refuses it.

        Raises:
            TaskFenced: a newer incarnation of the task was heard of.
        """
        with self._lock:
            highest = self._highest.get(task, -1)
            if incarnation < highest:
                raise TaskFenced(
                    f"{task} incarnation {incarnation} is fenced: incarnation {highest} replaced it"
                )
            self._highest[task] = incarnation

    def highest(self, task: str) -> int | None:
        with self._lock:
            return self._highest.get(task)

    def guard(self, handler: Handler) -> Handler:
        """``handler``, behind this book: a fenced request's body loses its ``fence``
        key before the handler sees it; an older incarnation's request is refused."""

        def guarded(request: Request) -> Any:
            body = request.body
            if isinstance(body, Mapping) and FENCE_KEY in body:
                raw = body[FENCE_KEY]
                if (
                    not isinstance(raw, list | tuple)
                    or len(raw) != 2
                    or not isinstance(raw[0], str)
                    or isinstance(raw[1], bool)
                    or not isinstance(raw[1], int)
                ):
                    raise ProtocolError(
                        f"malformed fence {raw!r:.80}: expected [task, incarnation]"
                    )
                self.admit(raw[0], raw[1])
                request.body = {k: v for k, v in body.items() if k != FENCE_KEY}
            return handler(request)

        return guarded
