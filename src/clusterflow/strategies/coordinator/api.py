"""What a ``ClusterCoordinator``'s user holds: its errors, its counts and ``RemoteValue``."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clusterflow.errors import ClusterflowError

__all__ = [
    "CoordinatorClosed",
    "CoordinatorError",
    "CoordinatorStats",
    "CoordinatorTimeout",
    "DependencyError",
    "FunctionError",
    "RemoteValue",
    "SerializationError",
    "WorkerFailure",
]


# Errors ---------------------------------------------------------------------------


class CoordinatorError(ClusterflowError):
    """Base of the errors a ``ClusterCoordinator`` raises."""


class FunctionError(CoordinatorError):
    """A scheduled function raised on its worker; it is not retried.

    The original exception is chained as ``__cause__`` when it could be unpickled.

    Attributes:
        error_type: the qualified name of the exception the function raised.
        remote_traceback: the traceback as the worker formatted it.
        worker: the task the function ran on (``worker:1``).
    """

    def __init__(
        self, message: str, *, error_type: str = "", remote_traceback: str = "", worker: str = ""
    ) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.remote_traceback = remote_traceback
        self.worker = worker


class DependencyError(CoordinatorError):
    """The function never ran: a ``RemoteValue`` among its arguments failed (``__cause__``)."""


class WorkerFailure(CoordinatorError):
    """Every worker the function was sent to failed while running it (``max_attempts``)."""


class SerializationError(CoordinatorError):
    """A function, its arguments or its result cannot be pickled or unpickled."""


class CoordinatorClosed(CoordinatorError):
    """The coordinator was closed before the function finished, or before ``schedule``."""


class CoordinatorTimeout(CoordinatorError, TimeoutError):
    """``join`` or ``fetch`` waited longer than its ``timeout``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorStats:
    """Counts since the coordinator was built."""

    scheduled: int
    """Functions given to ``schedule``."""
    completed: int
    """Functions that returned a value."""
    failed: int
    """Functions that finished with an error (their own, an input's, or lost workers)."""
    retried: int
    """Times a function went back to the queues because its worker failed."""
    pending: int
    """Functions not finished yet (waiting for inputs, queued or running)."""
    workers_up: int
    """Workers serving right now."""


# RemoteValue ----------------------------------------------------------------------


class RemoteValue:
    """The future result of a scheduled function (TensorFlow's ``RemoteValue``).

    Pass it to ``schedule`` as an argument (anywhere inside tuples, lists and dicts) to
    make another function wait for it; call ``fetch()`` for the value itself.

    Its result is set once, by the coordinator that made it (``set_result`` or
    ``set_error``, as ``concurrent.futures.Future``'s executor sets a future's).
    """

    def __init__(self, owner: object, index: int, name: str) -> None:
        self._owner = owner
        self._index = index
        self._name = name
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._blob: bytes | None = None
        self._value: Any = None
        self._loaded = False
        self._error: CoordinatorError | None = None

    def fetch(self, timeout: float | None = None) -> Any:
        """The function's return value, unpickled on first use.

        Blocks until the function finished on some worker (or ``timeout`` seconds).

        Raises:
            FunctionError: the function raised (its error chained as ``__cause__``).
            DependencyError: an input failed, so the function never ran.
            WorkerFailure: every worker it was sent to failed.
            CoordinatorClosed: the coordinator closed before the function finished.
            SerializationError: the result cannot be unpickled on the chief.
            CoordinatorTimeout: ``timeout`` passed first.
        """
        if not self._finished.wait(timeout):
            raise CoordinatorTimeout(f"{self!r} not ready within {timeout:g}s")
        if self._error is not None:
            raise self._error
        with self._lock:
            if not self._loaded:
                try:
                    self._value = pickle.loads(self.pickled())
                except Exception as exc:
                    raise SerializationError(
                        f"the result of {self._name} cannot be unpickled on the chief: {exc}"
                    ) from exc
                self._loaded = True
            return self._value

    get = fetch
    """An alias of ``fetch``, as TensorFlow's ``RemoteValue.get``."""

    def done(self) -> bool:
        """Whether the function finished (successfully or not); never blocks."""
        return self._finished.is_set()

    def __repr__(self) -> str:
        if not self._finished.is_set():
            state = "pending"
        else:
            state = "failed" if self._error is not None else "done"
        return f"<RemoteValue #{self._index} of {self._name}: {state}>"

    # For the coordinator that made it ----------------------------------------------

    @property
    def owner(self) -> object:
        """The coordinator that made it: only its functions may take it as an argument."""
        return self._owner

    @property
    def index(self) -> int:
        """The function's number in its coordinator, in the order of ``schedule``."""
        return self._index

    def error(self) -> CoordinatorError | None:
        """Why the function failed; None while it is pending or when it succeeded."""
        return self._error if self._finished.is_set() else None

    def pickled(self) -> bytes:
        """The result as the worker pickled it, to hand to the functions that take it.

        Raises:
            CoordinatorError: the function has not succeeded (a caller's mistake).
        """
        if self._blob is None:
            raise CoordinatorError(f"{self!r} holds no result")
        return self._blob

    def set_result(self, blob: bytes) -> None:
        """Settles it with the result the worker pickled; wakes ``fetch``."""
        self._blob = blob
        self._finished.set()

    def set_error(self, error: CoordinatorError) -> None:
        """Settles it with the error ``fetch`` raises."""
        self._error = error
        self._finished.set()


def map_structure(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to each leaf inside lists, tuples and dicts.

    Named tuples and dict subclasses keep their type: what a function returns comes
    back to the chief as it was built.
    """
    if isinstance(value, list):
        return [map_structure(fn, v) for v in value]
    if isinstance(value, tuple):
        items = [map_structure(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return type(value)((k, map_structure(fn, v)) for k, v in value.items())
    return fn(value)
