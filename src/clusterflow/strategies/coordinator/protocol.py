"""The ``worker.*`` wire contract between the chief's coordinator and its workers.

One definition for both ends: the chief (``dispatch``) builds requests and reads
replies with these types, the worker (``worker``) reads requests and builds replies
with them. The pickled bytes inside (function, arguments, inputs, results) are opaque
here; ``pickling`` and ``worker`` make and read them.

A call is named by the chief (``call``), so a poll after a lost reply finds it again;
a new worker process does not know the name and answers ``unknown``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from clusterflow.ps.api import Shard, VariableSpec
from clusterflow.rpc.errors import MalformedBody
from clusterflow.rpc.message import body_map
from clusterflow.strategies.api import StrategyError

__all__ = [
    "METHOD_INFO",
    "METHOD_RESULT",
    "METHOD_RUN",
    "METHOD_STOP",
    "CallReply",
    "CallState",
    "ErrorReport",
    "MalformedMessage",
    "ResultRequest",
    "RunRequest",
    "StrategySettings",
    "WorkerInfo",
    "digest_of",
]

METHOD_RUN = "worker.run"
"""Starts a call (sending the function too when this worker lacks it); waits a little."""
METHOD_RESULT = "worker.result"
"""Waits a little for a started call; the chief polls it while the call runs."""
METHOD_INFO = "worker.info"
"""Whether this task serves the coordinator, and which incarnation of it answers."""
METHOD_STOP = "worker.stop"
"""The coordinator closed: ``serve_worker`` returns and the task can exit 0."""


class MalformedMessage(StrategyError, MalformedBody):
    """A ``worker.*`` request or reply does not have the contract's fields and types
    (the rpc layer's ``MalformedBody``, of the strategies' kind)."""


def digest_of(payload: bytes) -> str:
    """The content hash a function is cached under on every worker."""
    return hashlib.sha256(payload).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategySettings:
    """What a worker needs to rebuild the chief's strategy: options and placement, no sockets.

    It travels inside the pickled functions, as the argument of every variable reference.
    """

    options: tuple[tuple[str, Any], ...]
    """Keyword arguments of ``ParameterServerStrategy`` (mode, wire dtypes, deadline, ...)."""
    variables: tuple[tuple[VariableSpec, tuple[Shard, ...]], ...]
    """Every variable of the chief's strategy and its shards, in creation order."""


def _map(what: str, body: Any) -> Mapping[str, Any]:
    return body_map(what, body, error=MalformedMessage)


def _get(what: str, body: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if not isinstance(value, kind):
        raise MalformedMessage(f"{what}: {key!r} has the wrong type: {value!r:.80}")
    return value


# Requests ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRequest:
    """``worker.run``: start one call of a function, then wait up to ``wait`` seconds."""

    call: str
    """The chief's name for this attempt; a resend under the same name is the same call."""
    fn: str
    """The function's digest (``digest_of`` its pickled bytes)."""
    args: bytes
    """The pickled ``(args, kwargs)``, with placeholders for the inputs."""
    inputs: list[bytes]
    """The pickled value of each input ``RemoteValue``, in placeholder order."""
    wait: float
    """How long the reply may wait for the call to finish."""
    payload: bytes | None = None
    """The pickled function, sent only to a worker not known to hold it."""

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "call": self.call,
            "fn": self.fn,
            "args": self.args,
            "inputs": self.inputs,
            "wait": self.wait,
        }
        if self.payload is not None:
            body["payload"] = self.payload
        return body

    @classmethod
    def from_wire(cls, body: Any) -> RunRequest:
        what = METHOD_RUN
        b = _map(f"{what} request", body)
        inputs = b.get("inputs") or []
        payload = b.get("payload")
        if not isinstance(inputs, list) or not all(isinstance(x, bytes) for x in inputs):
            raise MalformedMessage(f"{what} needs pickled args and inputs as bytes")
        if payload is not None and not isinstance(payload, bytes):
            raise MalformedMessage(f"{what} needs the pickled function as bytes")
        return cls(
            call=_get(f"{what} request", b, "call", str),
            fn=_get(f"{what} request", b, "fn", str),
            args=_get(f"{what} request", b, "args", bytes),
            inputs=inputs,
            wait=float(b.get("wait", 1.0)),
            payload=payload,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultRequest:
    """``worker.result``: wait up to ``wait`` seconds more for a started call."""

    call: str
    wait: float

    def to_wire(self) -> dict[str, Any]:
        return {"call": self.call, "wait": self.wait}

    @classmethod
    def from_wire(cls, body: Any) -> ResultRequest:
        b = _map(f"{METHOD_RESULT} request", body)
        call = _get(f"{METHOD_RESULT} request", b, "call", str)
        return cls(call=call, wait=float(b.get("wait", 1.0)))


# Replies ----------------------------------------------------------------------------


class CallState(StrEnum):
    RUNNING = "running"
    """Not finished within the wait: poll again."""
    DONE = "done"
    """Returned; ``value`` holds the pickled result."""
    FAILED = "failed"
    """Raised; ``error`` says what."""
    NEED_FUNCTION = "need_function"
    """The worker lacks the function (a new process, or evicted): send it again."""
    UNKNOWN = "unknown"
    """No such call here: it died with an earlier process at this address."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReport:
    """What a function raised, as the chief re-raises it."""

    type: str
    """The exception's qualified name (``ValueError``, ``mypkg.errors.Bad``)."""
    message: str
    traceback: str
    """As the worker formatted it."""
    exception: bytes | None = None
    """The exception itself, pickled, when it pickles."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "message": self.message,
            "traceback": self.traceback,
            "exception": self.exception,
        }

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ErrorReport:
        pickled = body.get("exception")
        return cls(
            type=str(body.get("type", "Exception")),
            message=str(body.get("message", "")),
            traceback=str(body.get("traceback", "")),
            exception=pickled if isinstance(pickled, bytes) else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CallReply:
    """The answer to ``worker.run`` and ``worker.result``."""

    state: CallState
    value: bytes | None = None
    """With ``DONE``: the pickled result."""
    error: ErrorReport | None = None
    """With ``FAILED``: what the function raised."""

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"state": self.state.value}
        if self.value is not None:
            body["value"] = self.value
        if self.error is not None:
            body["error"] = self.error.to_wire()
        return body

    @classmethod
    def from_wire(cls, body: Any) -> CallReply:
        """The reply, checked: a finished call carries its value or its error.

        Raises:
            MalformedMessage: an unknown state, or a finished call without its result.
        """
        what = "worker call reply"
        b = _map(what, body)
        try:
            state = CallState(str(b.get("state")))
        except ValueError:
            raise MalformedMessage(f"{what}: unknown state {b.get('state')!r:.40}") from None
        if state is CallState.DONE:
            return cls(state=state, value=_get(what, b, "value", bytes))
        if state is CallState.FAILED:
            return cls(state=state, error=ErrorReport.from_wire(_get(what, b, "error", dict)))
        return cls(state=state)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo:
    """The answer to ``worker.info``."""

    incarnation: str
    """A new value means a new process at the same address: it holds no function."""
    task: str
    pid: int
    executed: int
    """Calls started by this process."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "task": self.task,
            "pid": self.pid,
            "executed": self.executed,
        }

    @classmethod
    def from_wire(cls, body: Any) -> WorkerInfo:
        b = _map(f"{METHOD_INFO} reply", body)
        return cls(
            incarnation=str(b.get("incarnation")),
            task=str(b.get("task", "")),
            pid=int(b.get("pid", 0)),
            executed=int(b.get("executed", 0)),
        )
