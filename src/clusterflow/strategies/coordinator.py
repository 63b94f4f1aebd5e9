"""``ClusterCoordinator``: the chief schedules functions on the workers (TensorFlow 2's form).

Every task runs the same script. Worker tasks serve; the chief builds the strategy and
the model, and schedules steps::

    resolver = TFConfigClusterResolver()
    if resolver.task_type == "worker":
        serve_worker()                      # blocks until the coordinator closes
        sys.exit(0)
    strategy = ParameterServerStrategy(resolver)
    with strategy.scope():
        model = Net()                       # variables go to the ps tasks
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()                    # gradients pushed to the ps, applied there
        optimizer.zero_grad()
        return loss.item()

    with ClusterCoordinator(strategy) as coordinator:
        losses = [coordinator.schedule(step, args=batch) for batch in batches]
        coordinator.join()
        print([loss.fetch() for loss in losses])
        coordinator.pull_variables()        # the chief's model now holds the trained values

``schedule`` returns a ``RemoteValue`` at once. A function whose arguments hold
``RemoteValue`` s waits until every one of them is ready (a dependency counter per
function: TensorFlow's executor's dataflow rule) and then gets their values in their
place. Ready functions wait in per-worker queues; one thread per worker sends them,
and an idle worker takes work from the longest queue of another.

A worker that fails (no answer within ``worker_timeout_s``, or gone) is probed until it
answers again; the function it was running goes back to the queues and runs on
another worker: at-least-once, as in TensorFlow, so a function may run twice when its
worker dies. An error raised by the function itself is not retried; it surfaces in
``RemoteValue.fetch()`` and in ``join()``.

The function and its arguments are pickled with cloudpickle and travel only over the
cluster's authenticated RPC channel. A function is pickled once, at its first
``schedule``, and sent once per worker; later calls send its content hash and the
arguments. The strategy's variables inside it travel as references, bound on the
worker to its own strategy (see ``worker_service``).
"""

from __future__ import annotations

import atexit
import io
import itertools
import logging
import pickle
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
import torch

from clusterflow.cluster import ClusterSpec
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.rpc import Credentials, RemoteError, RpcClient, RpcError
from clusterflow.server.manager_link import ManagerLink
from clusterflow.strategies.parameter_server import CentralStorageStrategy, ParameterServerStrategy
from clusterflow.strategies.worker_service import (
    METHOD_INFO,
    METHOD_RESULT,
    METHOD_RUN,
    METHOD_STOP,
    StrategySettings,
    bound_strategy,
    bound_variable,
    digest_of,
    serve_worker,
)

log = logging.getLogger(__name__)

__all__ = [
    "ClusterCoordinator",
    "CoordinatorClosed",
    "CoordinatorError",
    "CoordinatorStats",
    "CoordinatorTimeout",
    "DependencyError",
    "FunctionError",
    "RemoteValue",
    "SerializationError",
    "WorkerFailure",
    "serve_worker",
]

POLL_S = 1.0
"""How long one call to a worker waits for the function to finish before the chief polls."""
PROBE_MIN_S, PROBE_MAX_S = 0.2, 5.0
"""Back-off between probes of a worker that does not answer."""
STOP_DEADLINE_S = 2.0
"""How long ``close`` waits for a worker to acknowledge the stop."""
FUNCTION_CACHE = 128
"""Pickled functions kept on the chief (keyed by the function object)."""


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


# RemoteValue ----------------------------------------------------------------------


class RemoteValue:
    """The future result of a scheduled function (TensorFlow's ``RemoteValue``).

    Pass it to ``schedule`` as an argument (anywhere inside tuples, lists and dicts) to
    make another function wait for it; call ``fetch()`` for the value itself.
    """

    def __init__(self, coordinator: ClusterCoordinator, index: int, name: str) -> None:
        self._coordinator = coordinator
        self._index = index
        self._name = name
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._blob: bytes | None = None
        self._value: Any = None
        self._loaded = False
        self._error: CoordinatorError | None = None
        self._dependents: list[_Closure] = []

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
                assert self._blob is not None
                try:
                    self._value = pickle.loads(self._blob)
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


# Internals ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Function:
    digest: str
    payload: bytes


@dataclass(slots=True, eq=False)
class _Closure:
    index: int
    name: str
    function: _Function
    args: bytes
    inputs: list[RemoteValue]
    result: RemoteValue
    waiting: int = 0
    attempts: int = 0
    finished: bool = False


@dataclass(frozen=True, slots=True)
class _VariableRef:
    name: str
    is_parameter: bool
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class _Binding:
    """How the chief's strategy and its variables pickle: as references for the workers."""

    strategy: ParameterServerStrategy
    settings: StrategySettings
    tensors: dict[int, _VariableRef]
    count: int


class _WorkerLost(Exception):
    """The worker did not answer, or answered as a new process: re-run the function elsewhere."""


class _Abandoned(Exception):
    """The coordinator closed while the function ran."""


@dataclass(slots=True, eq=False)
class _Worker:
    index: int
    name: str
    address: str
    client: RpcClient
    timeout_s: float
    up: bool = False
    incarnation: str | None = None
    sent: set[str] = field(default_factory=set)
    """Digests of the functions this incarnation of the worker holds."""
    busy: bool = False

    def call(self, method: str, body: Any, wait: float = 0.0) -> dict[str, Any]:
        """One call; every way it can fail means the worker is lost for now."""
        try:
            reply = self.client.call(method, body, deadline=wait + self.timeout_s)
        except RemoteError as exc:
            raise _WorkerLost(f"{self.name} refused {method}: {exc}") from exc
        except RpcError as exc:
            raise _WorkerLost(f"{self.name} did not answer {method}: {exc}") from exc
        if not isinstance(reply.body, dict):
            raise _WorkerLost(f"{self.name} answered {method} with {reply.body!r}")
        return reply.body

    def probe(self) -> bool:
        """Whether the worker serves the coordinator now; notes a restarted worker."""
        try:
            info = self.call(METHOD_INFO, None)
        except _WorkerLost as exc:
            log.debug("%s not serving yet: %s", self.name, exc)
            return False
        incarnation = str(info.get("incarnation"))
        if incarnation != self.incarnation:
            if self.incarnation is not None:
                log.info("%s is a new process (pid %s)", self.name, info.get("pid"))
            self.incarnation = incarnation
            self.sent.clear()
        self.up = True
        return True


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


# The coordinator ------------------------------------------------------------------


class ClusterCoordinator:
    """Schedules functions on the worker tasks of a ``ParameterServerStrategy``'s cluster.

    Build it on the chief after creating the model and the optimizer in
    ``strategy.scope()``; the worker tasks must be running ``serve_worker()``.

    Args:
        strategy: an asynchronous ``ParameterServerStrategy`` (as TensorFlow's
            coordinator, which is asynchronous only: a sync step would wait for
            replicas that the scheduler may never run at the same time).
        worker_timeout_s: a worker that does not answer a call within this many
            seconds (beyond the call's own wait) is treated as failed and its function
            re-run elsewhere. Long enough for a worker that is busy importing or
            unpickling a large function; short enough to notice a dead one.
        max_attempts: workers a function may be sent to before it fails with
            ``WorkerFailure``: a function that kills its worker must not kill them all.

    Raises:
        ConfigError: not an async ``ParameterServerStrategy``, a warm-up (which waits
            for the chief's own steps), no worker job, or no cluster credentials.
    """

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        *,
        worker_timeout_s: float = 15.0,
        max_attempts: int = 5,
    ) -> None:
        if not isinstance(strategy, ParameterServerStrategy) or isinstance(
            strategy, CentralStorageStrategy
        ):
            raise ConfigError(
                f"ClusterCoordinator needs a ParameterServerStrategy, got {type(strategy).__name__}"
            )
        if strategy.config.mode != "async":
            raise ConfigError("ClusterCoordinator needs mode='async' (as TensorFlow's coordinator)")
        if strategy.config.warmup_steps:
            raise ConfigError("ClusterCoordinator cannot warm up: the chief takes no steps itself")
        if not worker_timeout_s > 0 or max_attempts < 1:
            raise ConfigError(
                f"worker_timeout_s must be > 0 and max_attempts >= 1, got "
                f"{worker_timeout_s!r} and {max_attempts!r}"
            )
        resolver = strategy.cluster_resolver
        spec = resolver.cluster_spec()
        if "worker" not in spec.jobs:
            raise ConfigError(f"the cluster has no worker job to schedule on: {spec.as_dict()}")
        credentials: Credentials = resolver.require_credentials()
        self._strategy = strategy
        self._credentials = credentials
        self._max_attempts = max_attempts
        self._id = uuid.uuid4().hex[:8]
        self._cond = threading.Condition()
        self._workers = [
            _Worker(
                index=i,
                name=f"worker:{i}",
                address=spec.task_address("worker", i),
                client=RpcClient(spec.task_address("worker", i), credentials),
                timeout_s=worker_timeout_s,
            )
            for i in spec.task_indices("worker")
        ]
        self._manager = ManagerLink.from_env()
        self._queues: dict[int, deque[_Closure]] = {w.index: deque() for w in self._workers}
        self._closures = itertools.count()
        self._unfinished: set[_Closure] = set()
        self._errors: list[CoordinatorError] = []
        self._pickling = threading.Lock()
        self._functions: OrderedDict[Any, _Function] = OrderedDict()
        self._binding: _Binding | None = None
        self._scheduled = self._completed = self._failed = self._retried = 0
        self._closed = False
        self._closing = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._dispatch, args=(w,), name=f"coordinator-{w.name}", daemon=True
            )
            for w in self._workers
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    # Public API --------------------------------------------------------------------

    def schedule(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        ``RemoteValue`` s anywhere in ``args`` and ``kwargs`` (inside tuples, lists and
        dicts) make ``fn`` wait for them; it then gets their values in their place. The
        arguments are pickled now, so later changes to them are not seen; ``fn`` is
        pickled at its first ``schedule`` only, so later changes to what it closes over
        are not seen either (pass what changes as arguments).

        Raises:
            SerializationError: ``fn`` or the arguments cannot be pickled, or ``fn``
                closes over a ``RemoteValue`` (pass it as an argument instead).
            CoordinatorClosed: ``close()`` was called.
            ConfigError: ``fn`` is not callable, or a ``RemoteValue`` of another
                coordinator is among the arguments.
        """
        if not callable(fn):
            raise ConfigError(f"schedule needs a function, got {type(fn).__name__}")
        if self._closed:
            raise CoordinatorClosed("the coordinator is closed")
        name = getattr(fn, "__qualname__", None) or repr(fn)
        with self._pickling:
            function = self._function(fn, name)
            blob, inputs = self._dumps(
                (tuple(args or ()), dict(kwargs or {})), what=f"arguments of {name}"
            )
        with self._cond:
            if self._closed:
                raise CoordinatorClosed("the coordinator is closed")
            index = next(self._closures)
            closure = _Closure(index, name, function, blob, inputs, RemoteValue(self, index, name))
            self._scheduled += 1
            self._unfinished.add(closure)
            failed = next((rv for rv in inputs if rv._error is not None), None)
            if failed is not None:
                self._fail(closure, self._dependency_error(closure, failed))
                return closure.result
            for rv in inputs:
                if not rv._finished.is_set():
                    rv._dependents.append(closure)
                    closure.waiting += 1
            if closure.waiting == 0:
                self._enqueue(closure)
        return closure.result

    def join(self, timeout: float | None = None) -> None:
        """Waits for every function scheduled so far (TensorFlow's ``join``).

        Blocks until none is waiting, queued or running, or ``timeout`` seconds pass.
        A function whose workers are all down waits for one to come back (as in
        TensorFlow), so give a ``timeout`` where that must not hang.

        Raises:
            FunctionError: a function raised since the last ``join`` or ``done`` raised
                (the first such error; the rest are dropped, as in TensorFlow).
            WorkerFailure: a function ran out of workers (``max_attempts``).
            CoordinatorTimeout: ``timeout`` passed first.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: not self._unfinished or self._closed, timeout):
                raise CoordinatorTimeout(
                    f"{len(self._unfinished)} scheduled function(s) unfinished after {timeout:g}s"
                )
            self._raise_first_error()

    def done(self) -> bool:
        """Whether every function scheduled so far finished; never blocks.

        Raises:
            FunctionError, WorkerFailure: as ``join``.
        """
        with self._cond:
            self._raise_first_error()
            return not self._unfinished

    def fetch(self, values: Any) -> Any:
        """``values`` with every ``RemoteValue`` inside (tuples, lists, dicts) fetched.

        Blocks until each is ready; raises what ``RemoteValue.fetch`` raises.
        """
        return _map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, values)

    def pull_variables(self) -> None:
        """Copies the variables' current values from the ps tasks into the chief's tensors.

        The chief's model (created in ``strategy.scope()``) is otherwise left at its
        initial values, since training happens on the workers; call this after
        ``join()`` to evaluate or save the trained model. Blocks until every ps task
        answered.

        Raises:
            RpcError: a ps task did not answer within the strategy's deadline.
        """
        self._strategy.pull_values()

    def stats(self) -> CoordinatorStats:
        """Counts so far (retries show worker failures that cost a re-run); never blocks."""
        with self._cond:
            return CoordinatorStats(
                scheduled=self._scheduled,
                completed=self._completed,
                failed=self._failed,
                retried=self._retried,
                pending=len(self._unfinished),
                workers_up=sum(w.up for w in self._workers),
            )

    def close(self, *, stop_workers: bool = True) -> None:
        """Stops scheduling; unfinished functions fail with ``CoordinatorClosed``.

        With ``stop_workers`` each worker's ``serve_worker()`` returns, so worker tasks
        exit 0 and a ``clusterflow start`` run that tracks them can end. Waits a few
        seconds at most: for the dispatch threads to leave their current poll, and for
        the workers to acknowledge the stop (a dead one is not waited for longer).
        Called at interpreter exit if not called before.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for closure in list(self._unfinished):
                self._fail(closure, CoordinatorClosed(f"{closure.name}: coordinator closed"))
            self._queues = {index: deque() for index in self._queues}
            self._closing.set()
            self._cond.notify_all()
        atexit.unregister(self.close)
        if stop_workers:
            # Fresh clients: a dispatch thread may still hold its worker's client in a
            # call to a dead worker, for up to worker_timeout_s.
            stoppers = [
                threading.Thread(target=self._stop_worker, args=(w,), daemon=True)
                for w in self._workers
            ]
            for thread in stoppers:
                thread.start()
            for thread in stoppers:
                thread.join(STOP_DEADLINE_S + 1.0)
        for worker, thread in zip(self._workers, self._threads, strict=True):
            thread.join(POLL_S + 1.0)
            if not thread.is_alive():
                worker.client.close()  # else it closes with the process
        if self._manager is not None:
            self._manager.close()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Pickling ----------------------------------------------------------------------

    def _function(self, fn: Callable[..., Any], name: str) -> _Function:
        """The pickled function, pickled at its first schedule only."""
        try:
            cached = self._functions.get(fn)
        except TypeError:  # an unhashable bound method's object: pickle every time
            cached, fn_key = None, None
        else:
            fn_key = fn
        if cached is not None:
            self._functions.move_to_end(fn_key)
            return cached
        payload, _ = self._dumps(fn, what=name, inputs_allowed=False)
        function = _Function(digest_of(payload), payload)
        if fn_key is not None:
            self._functions[fn_key] = function
            while len(self._functions) > FUNCTION_CACHE:
                self._functions.popitem(last=False)
        return function

    def _dumps(
        self, obj: Any, *, what: str, inputs_allowed: bool = True
    ) -> tuple[bytes, list[RemoteValue]]:
        buffer = io.BytesIO()
        pickler = _ChiefPickler(buffer, self, self._current_binding(), inputs_allowed)
        try:
            pickler.dump(obj)
        except CoordinatorError:
            raise
        except Exception as exc:
            raise SerializationError(f"cannot send {what} to the workers: {exc}") from exc
        return buffer.getvalue(), pickler.inputs

    def _current_binding(self) -> _Binding:
        """The strategy's variables as the workers bind them; rebuilt when more are created."""
        variables = self._strategy.variables()
        if self._binding is None or self._binding.count != len(variables):
            settings = StrategySettings(
                options=tuple(self._strategy.replica_options().items()),
                variables=tuple((spec, shards) for _, spec, shards in variables),
            )
            tensors = {
                id(tensor): _VariableRef(
                    spec.name, isinstance(tensor, torch.nn.Parameter), tensor.requires_grad
                )
                for tensor, spec, _ in variables
            }
            self._binding = _Binding(self._strategy, settings, tensors, len(variables))
        return self._binding

    # Scheduling (the lock is held) -------------------------------------------------

    def _enqueue(self, closure: _Closure, *, front: bool = False, avoid: int | None = None) -> None:
        """Onto the shortest queue of a worker that is up (any worker while none is)."""
        candidates = [w for w in self._workers if w.up and w.index != avoid] or [
            w for w in self._workers if w.index != avoid
        ]
        target = min(candidates or self._workers, key=lambda w: len(self._queues[w.index]) + w.busy)
        queue = self._queues[target.index]
        if front:
            queue.appendleft(closure)
        else:
            queue.append(closure)
        self._cond.notify_all()

    def _take(self, worker: _Worker) -> _Closure | None:
        """The next closure for ``worker``: its own queue first, else the longest other one."""
        with self._cond:
            while not self._closing.is_set():
                own = self._queues[worker.index]
                if own:
                    return own.popleft()
                longest = max(self._queues.values(), key=len)
                if longest:
                    return longest.popleft()
                self._cond.wait(POLL_S)
        return None

    def _succeed(self, closure: _Closure, blob: bytes) -> None:
        if closure.finished:
            return
        closure.finished = True
        rv = closure.result
        rv._blob = blob
        self._completed += 1
        self._settle(closure)
        ready = []
        for dependent in rv._dependents:
            dependent.waiting -= 1
            if dependent.waiting == 0 and not dependent.finished:
                ready.append(dependent)
        rv._dependents.clear()
        for dependent in ready:
            self._enqueue(dependent)

    def _fail(self, closure: _Closure, error: CoordinatorError) -> None:
        """Fails ``closure`` and, transitively, every function waiting for it."""
        pending = [(closure, error)]
        while pending:
            current, exc = pending.pop()
            if current.finished:
                continue
            current.finished = True
            rv = current.result
            rv._error = exc
            self._failed += 1
            if isinstance(exc, FunctionError | WorkerFailure):
                self._errors.append(exc)
            self._settle(current)
            for dependent in rv._dependents:
                pending.append((dependent, self._dependency_error(dependent, rv)))
            rv._dependents.clear()

    def _settle(self, closure: _Closure) -> None:
        self._unfinished.discard(closure)
        closure.result._finished.set()
        self._cond.notify_all()

    @staticmethod
    def _dependency_error(closure: _Closure, failed: RemoteValue) -> DependencyError:
        error = DependencyError(
            f"{closure.name} did not run: its input {failed!r} failed: {failed._error}"
        )
        error.__cause__ = failed._error
        return error

    def _raise_first_error(self) -> None:
        if self._errors:
            first = self._errors[0]
            self._errors.clear()
            raise first

    # Dispatching (one thread per worker) -------------------------------------------

    def _dispatch(self, worker: _Worker) -> None:
        delay = PROBE_MIN_S
        while not self._closing.is_set():
            if not worker.up:
                if worker.probe():
                    log.info("%s serves the coordinator", worker.name)
                    delay = PROBE_MIN_S
                    with self._cond:
                        self._cond.notify_all()
                else:
                    self._follow_address(worker)
                    self._closing.wait(delay)
                    delay = min(delay * 2, PROBE_MAX_S)
                continue
            closure = self._take(worker)
            if closure is None:
                continue
            worker.busy = True
            try:
                blob, error = self._run(worker, closure)
            except _WorkerLost as lost:
                worker.up = False
                self._requeue(worker, closure, str(lost))
                continue
            except _Abandoned:
                continue
            finally:
                worker.busy = False
            with self._cond:
                if error is not None:
                    self._fail(closure, error)
                else:
                    assert blob is not None
                    self._succeed(closure, blob)

    def _follow_address(self, worker: _Worker) -> None:
        """Re-points ``worker``'s client if the manager's newest spec moved the task.

        A worker the manager respawned comes back on a new port: the spec version it
        made names the new address (``manager.spec``). Outside ``clusterflow start``
        there is no manager to ask, and addresses stay as ``TF_CONFIG`` gave them.
        """
        if self._manager is None:
            return
        reply = self._manager.spec()
        if not reply or not reply.get("spec"):
            return
        try:
            address = ClusterSpec(reply["spec"]).task_address("worker", worker.index)
        except ClusterflowError:
            return
        if address != worker.address:
            log.info(
                "%s moved to %s (spec version %s)", worker.name, address, reply.get("spec_version")
            )
            worker.client.close()
            worker.address = address
            worker.client = RpcClient(address, self._credentials)

    def _requeue(self, worker: _Worker, closure: _Closure, reason: str) -> None:
        log.warning("%s failed while running %s: %s", worker.name, closure.name, reason)
        with self._cond:
            if closure.finished:
                return
            if closure.attempts >= self._max_attempts:
                self._fail(
                    closure,
                    WorkerFailure(
                        f"{closure.name} was sent to {closure.attempts} worker(s) that failed "
                        f"while running it; last: {reason}"
                    ),
                )
                return
            self._retried += 1
            self._enqueue(closure, front=True, avoid=worker.index)

    def _run(self, worker: _Worker, closure: _Closure) -> tuple[bytes | None, FunctionError | None]:
        """Runs one closure on ``worker``: (value blob, None) or (None, the function's error).

        Raises:
            _WorkerLost: the worker did not answer, or lost the call.
            _Abandoned: the coordinator closed meanwhile.
        """
        closure.attempts += 1
        function = closure.function
        inputs = [rv._blob for rv in closure.inputs]
        for resend in range(2):
            call = f"{self._id}.{closure.index}.{closure.attempts}.{resend}"
            body: dict[str, Any] = {
                "call": call,
                "fn": function.digest,
                "args": closure.args,
                "inputs": inputs,
                "wait": POLL_S,
            }
            if function.digest not in worker.sent:
                body["payload"] = function.payload
            reply = worker.call(METHOD_RUN, body, POLL_S)
            if reply.get("state") != "need_function":
                worker.sent.add(function.digest)
            while reply.get("state") == "running":
                if self._closing.is_set():
                    raise _Abandoned
                reply = worker.call(METHOD_RESULT, {"call": call, "wait": POLL_S}, POLL_S)
            state = reply.get("state")
            if state == "need_function":  # evicted from the worker's cache: send it again
                worker.sent.discard(function.digest)
                continue
            if state == "done" and isinstance(reply.get("value"), bytes):
                return reply["value"], None
            if state == "failed" and isinstance(reply.get("error"), dict):
                return None, _function_error(closure, worker, reply["error"])
            raise _WorkerLost(f"{worker.name} lost call {call} (it answered {state!r})")
        raise _WorkerLost(f"{worker.name} keeps asking for {closure.name}")

    def _stop_worker(self, worker: _Worker) -> None:
        try:
            with RpcClient(worker.address, self._credentials, deadline=STOP_DEADLINE_S) as client:
                client.call(METHOD_STOP)
        except RpcError as exc:
            log.debug("%s did not take the stop: %s", worker.name, exc)


class _ChiefPickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, with the strategy's variables as references and inputs as placeholders."""

    def __init__(
        self,
        file: io.BytesIO,
        coordinator: ClusterCoordinator,
        binding: _Binding,
        inputs_allowed: bool,
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._coordinator = coordinator
        self._bound = binding
        self._inputs_allowed = inputs_allowed
        self._input_index: dict[int, int] = {}
        self.inputs: list[RemoteValue] = []

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, RemoteValue):
            return None
        if not self._inputs_allowed:
            raise SerializationError(
                f"the function closes over {obj!r}; pass it as an argument to schedule() so "
                "the function waits for it"
            )
        if obj._coordinator is not self._coordinator:
            raise ConfigError(f"{obj!r} belongs to another ClusterCoordinator")
        if id(obj) not in self._input_index:
            self._input_index[id(obj)] = len(self.inputs)
            self.inputs.append(obj)
        return ("input", self._input_index[id(obj)])

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            ref = self._bound.tensors.get(id(obj))
            if ref is not None:
                args = (self._bound.settings, ref.name, ref.is_parameter, ref.requires_grad)
                return bound_variable, args
        elif obj is self._bound.strategy:
            return bound_strategy, (self._bound.settings,)
        return super().reducer_override(obj)


def _function_error(closure: _Closure, worker: _Worker, info: dict[str, Any]) -> FunctionError:
    error_type = str(info.get("type", "Exception"))
    error = FunctionError(
        f"{closure.name} raised {error_type} on {worker.name}: {info.get('message', '')}",
        error_type=error_type,
        remote_traceback=str(info.get("traceback", "")),
        worker=worker.name,
    )
    pickled = info.get("exception")
    if isinstance(pickled, bytes):
        try:
            original = pickle.loads(pickled)
        except Exception:
            original = None
        if isinstance(original, BaseException):
            error.__cause__ = original
    return error


def _map_structure(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, list):
        return [_map_structure(fn, v) for v in value]
    if isinstance(value, tuple):
        items = [_map_structure(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return type(value)((k, _map_structure(fn, v)) for k, v in value.items())
    return fn(value)
