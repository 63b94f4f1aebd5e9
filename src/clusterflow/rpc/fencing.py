"""Fencing: a task the manager replaced can no longer change anything.

A worker cut off by a partition looks dead to the manager, which relaunches it; when
the link heals, the old process (a *zombie*) is still alive and still pushing. Each
launch of a task therefore carries an *incarnation number*, the task's relaunch count
(``CLUSTERFLOW_INCARNATION``, set by the manager), and every request a task sends to a
ps or to the dispatcher carries ``fence: [task, incarnation]``. A service keeps, per
task, the highest incarnation it has heard of, and refuses a request of an older one
with ``TaskFenced``. It hears of a relaunch from the manager, before the replacement
starts: in process for the dispatcher (``FenceBook.raise_to``), through
``<service>.fence`` for each ps task (``announce``), which answers only once no request
of an older incarnation is still being served. The zombie's client turns the refusal
into a ``TaskFenced`` raised in its training loop: it stops itself, having applied
nothing after its replacement started (docs/failure-semantics.md, "Fencing").

A zombie cut off while a request of it was in flight may never get that request's
answer: ZeroMQ drops a connection that died during the cut, with what was written to
it, and dials a new one once the link is back. So a fenced task's clients also ask
``<service>.fence`` whenever their connection comes back while a call waits
(``watch``, ``RpcClient.probe_on_reconnect``): the refusal arrives one round trip after
the heal, not at the lost request's deadline.

Requests without a fence (manual mode, in-process services, older clients) are served
as before: fencing is for tasks a manager relaunches.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Protocol

from clusterflow.cluster.contract import ENV_INCARNATION, ENV_TASK
from clusterflow.rpc.auth import Credentials
from clusterflow.rpc.client import ReconnectProbe, RpcClient
from clusterflow.rpc.errors import CodedError, ProtocolError, RemoteError, RpcError
from clusterflow.rpc.message import Handler, Request

log = logging.getLogger(__name__)

FENCE_KEY: Final = "fence"
"""The body key of a fenced request: ``[task, incarnation]``."""
FENCE_METHOD: Final = "fence"
"""``<service>.fence``: declares an incarnation current (the manager, at a relaunch) or
asks whether it still is (a task whose connection came back); see ``FenceBook``."""
MAX_DRAIN_S: Final = 30.0
"""Longest a ``<service>.fence`` call may wait for an older incarnation's requests."""
ANNOUNCE_DEADLINE_S: Final = 5.0
"""How long the manager waits for each ps to take a relaunch's fence: long enough for a
push being applied to finish, short enough that an unreachable ps delays a respawn
only a little (it then learns from the replacement's first request)."""


class TaskFenced(CodedError):
    """This task was replaced by a newer incarnation: it must stop, and applies nothing.

    A service's refusal reaches the client as a ``RemoteError`` that is also a
    ``TaskFenced`` (its wire code, rpc/errors.py); ``raise_if_fenced`` turns that into
    a plain ``TaskFenced``.
    """

    wire_code = "fenced"


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

    The answer arrives typed (a ``RemoteError`` and a ``TaskFenced``); the one raised is
    no ``RpcError``, so a caller that retries failed calls (``except RpcError``) lets
    it through to the training loop, which stops.

    Raises:
        TaskFenced: ``exc`` is that answer.
    """
    if isinstance(exc, TaskFenced):
        log.error("this task was replaced and is fenced off; stopping: %s", exc)
        raise TaskFenced(str(exc)) from None


class Registrar(Protocol):
    """Anything that serves RPC methods: an ``RpcServer`` or a ``Server``."""

    def register(
        self, method: str, handler: Callable[[Request], Any], *, blocking: bool = False
    ) -> None: ...


class FenceBook:
    """The highest incarnation heard of per task; refuses older ones. Thread-safe.

    It also counts, per task and incarnation, the requests it let through and those
    being served right now: ``raise_to`` can then wait until an older incarnation has
    nothing left in flight, so nothing of it is applied once the call returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._highest: dict[str, int] = {}
        self._active: Counter[tuple[str, int]] = Counter()
        self._admitted: Counter[tuple[str, int]] = Counter()
        self._refused: Counter[tuple[str, int]] = Counter()
        self._listeners: list[Callable[[str, int], None]] = []

    def on_raise(self, listener: Callable[[str, int], None]) -> None:
        """Calls ``listener(task, incarnation)`` whenever a newer incarnation of a task
        is heard of, after the book refuses the older ones (e.g. the ps drops a hold the
        replaced task took)."""
        self._listeners.append(listener)

    def raise_to(self, task: str, incarnation: int, wait_s: float = 0.0) -> int:
        """A newer incarnation exists (the manager relaunched ``task``).

        Waits up to ``wait_s`` seconds for requests of older incarnations being served to
        finish; returns how many still are (0: nothing of them can apply any more).
        """
        with self._lock:
            if incarnation > self._highest.get(task, -1):
                self._highest[task] = incarnation
        for listener in self._listeners:
            listener(task, incarnation)
        with self._lock:
            self._lock.wait_for(lambda: not self._older_active(task, incarnation), wait_s)
            return self._older_active(task, incarnation)

    def admit(self, task: str, incarnation: int) -> None:
        """Lets a request of ``task``'s ``incarnation`` through, or refuses it.

        Raises:
            TaskFenced: a newer incarnation of the task was heard of.
        """
        with self._lock:
            self._check(task, incarnation)
            self._admitted[task, incarnation] += 1

    def highest(self, task: str) -> int | None:
        with self._lock:
            return self._highest.get(task)

    def counts(self, task: str) -> dict[str, dict[int, int]]:
        """Requests of ``task`` let through and refused, per incarnation (for tests,
        benchmarks and logs: what a zombie got done after its fence)."""
        with self._lock:
            return {
                "admitted": {i: n for (t, i), n in self._admitted.items() if t == task},
                "refused": {i: n for (t, i), n in self._refused.items() if t == task},
            }

    def guard(self, handler: Handler) -> Handler:
        """``handler``, behind this book: a fenced request's body loses its ``fence``
        key before the handler sees it; an older incarnation's request is refused."""

        def guarded(request: Request) -> Any:
            body = request.body
            if not (isinstance(body, Mapping) and FENCE_KEY in body):
                return handler(request)
            fence = _parse(body[FENCE_KEY])
            request.body = {k: v for k, v in body.items() if k != FENCE_KEY}
            with self._serving(fence):
                return handler(request)

        return guarded

    def register_on(self, server: Registrar, service: str) -> None:
        """Serves ``<service>.fence``: ``{"fence": [task, incarnation], "wait_s"?}``.

        An older incarnation than the highest known is refused (``TaskFenced``); a newer
        one becomes the highest, and the call waits, at most ``wait_s`` (capped at
        ``MAX_DRAIN_S``), until no request of an older one is being served. Answers
        ``{"highest": n, "active": requests of older incarnations still served}``.
        """

        def fence(request: Request) -> dict[str, int]:
            body = request.body
            if not isinstance(body, Mapping) or FENCE_KEY not in body:
                raise ProtocolError(f"{service}.{FENCE_METHOD}: expected {{'fence': [task, n]}}")
            task, incarnation = _parse(body[FENCE_KEY])
            wait = body.get("wait_s", 0.0)
            if isinstance(wait, bool) or not isinstance(wait, int | float) or math.isnan(wait):
                raise ProtocolError(f"{service}.{FENCE_METHOD}: wait_s {wait!r:.40} is no number")
            with self._lock:
                self._check(task, incarnation)
            active = self.raise_to(task, incarnation, min(max(0.0, wait), MAX_DRAIN_S))
            return {"highest": incarnation, "active": active}

        server.register(f"{service}.{FENCE_METHOD}", fence, blocking=True)

    # -------------------------------------------------------------------------------

    def _check(self, task: str, incarnation: int) -> bool:
        """Refuses an older incarnation, or records ``incarnation`` as the highest;
        whether it is newer than any heard of before. Holds ``_lock``."""
        highest = self._highest.get(task, -1)
        if incarnation < highest:
            self._refused[task, incarnation] += 1
            raise TaskFenced(
                f"{task} incarnation {incarnation} is fenced: incarnation {highest} replaced it"
            )
        self._highest[task] = incarnation
        return incarnation > highest >= 0

    def _older_active(self, task: str, incarnation: int) -> int:
        return sum(n for (t, i), n in self._active.items() if t == task and i < incarnation)

    @contextmanager
    def _serving(self, fence: tuple[str, int]) -> Iterator[None]:
        with self._lock:
            newer = self._check(*fence)
            self._admitted[fence] += 1
            self._active[fence] += 1
        if newer:  # the replacement came first: the manager's announcement was missed
            for listener in self._listeners:
                listener(*fence)
        try:
            yield
        finally:
            with self._lock:
                self._active[fence] -= 1
                if not self._active[fence]:
                    del self._active[fence]
                self._lock.notify_all()


def _parse(raw: Any) -> tuple[str, int]:
    if (
        not isinstance(raw, list | tuple)
        or len(raw) != 2
        or not isinstance(raw[0], str)
        or isinstance(raw[1], bool)
        or not isinstance(raw[1], int)
    ):
        raise ProtocolError(f"malformed fence {raw!r:.80}: expected [task, incarnation]")
    return raw[0], raw[1]


def watch(client: RpcClient, service: str, fence: Fence | None) -> None:
    """Has ``client`` ask ``<service>.fence`` whether ``fence`` still stands each time its
    connection comes back while a call waits; a refusal fails that call with
    ``TaskFenced``'s answer (``raise_if_fenced`` turns it into ``TaskFenced``)."""
    if fence is not None:
        client.probe_on_reconnect(
            ReconnectProbe(
                method=f"{service}.{FENCE_METHOD}",
                body={FENCE_KEY: fence.to_wire()},
                refusals=frozenset({TaskFenced.wire_code}),
            )
        )


def announce(
    addresses: Sequence[str],
    credentials: Credentials,
    fence: Fence,
    *,
    service: str = "ps",
    deadline_s: float = ANNOUNCE_DEADLINE_S,
) -> dict[str, str]:
    """Tells every server at ``addresses`` that ``fence`` is the task's newest incarnation.

    The manager calls it when it relaunches a task, before the replacement starts. Each
    server answers once no request of an older incarnation is being served (or after
    most of ``deadline_s``). Calls run in parallel, each within ``deadline_s``.

    Returns:
        The servers that did not confirm, with why (unreachable, older incarnations
        still in flight): those learn of the relaunch from the replacement's first
        request instead.
    """
    body = {FENCE_KEY: fence.to_wire(), "wait_s": deadline_s * 0.8}

    def tell(address: str) -> str | None:
        try:
            with RpcClient(address, credentials, deadline=deadline_s) as client:
                reply = client.call(f"{service}.{FENCE_METHOD}", body).body
        except RpcError as exc:
            return str(exc)
        active = reply.get("active", 0) if isinstance(reply, Mapping) else 0
        return f"{active} older requests still in flight" if active else None

    if not addresses:
        return {}
    with ThreadPoolExecutor(min(len(addresses), 16), thread_name_prefix="fence") as pool:
        answers = dict(zip(addresses, pool.map(tell, addresses), strict=True))
    missed = {a: why for a, why in answers.items() if why is not None}
    for address, why in missed.items():
        log.warning("%s: %s did not take the fence of %s: %s", service, address, fence, why)
    return missed
