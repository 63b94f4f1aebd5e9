"""``ClusterCoordinator``: the chief's scheduler (see the package's docstring for its use).

It keeps the functions in flight: the dependency graph says which are ready, ready
ones wait in one queue, in the order they became ready, and one dispatch thread per
worker takes the oldest as its worker frees up (TensorFlow's closure queue): functions
start in the order they were scheduled whichever worker comes up first or runs
faster. A function whose worker is lost goes back to the front of the queue, for
another worker where one is up; its own error, a lost input's or ``max_attempts`` lost
workers finish it.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from clusterflow._checks import seconds, whole
from clusterflow.cluster import ClusterSpec
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.rpc import Credentials
from clusterflow.server.manager_link import ManagerLink
from clusterflow.strategies.central_storage import CentralStorageStrategy
from clusterflow.strategies.coordinator.api import (
    CoordinatorClosed,
    CoordinatorError,
    CoordinatorStats,
    CoordinatorTimeout,
    DependencyError,
    FunctionError,
    RemoteValue,
    WorkerFailure,
    map_structure,
)
from clusterflow.strategies.coordinator.dispatch import (
    POLL_S,
    STOP_DEADLINE_S,
    Abandoned,
    Closure,
    WorkerLink,
    WorkerLost,
)
from clusterflow.strategies.coordinator.graph import DependencyGraph
from clusterflow.strategies.coordinator.pickling import Packer
from clusterflow.strategies.parameter_server import ParameterServerStrategy

log = logging.getLogger(__name__)

__all__ = ["ClusterCoordinator"]

PROBE_MIN_S, PROBE_MAX_S = 0.2, 5.0
MEMBERSHIP_POLL_S = 0.5
"""How often the coordinator asks the manager for the newest spec (``manager.spec``), to
use the workers an elastic cluster gained and stop using those it lost."""
"""Back-off between probes of a worker that does not answer."""


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
        seconds("worker_timeout_s", worker_timeout_s)
        whole("max_attempts", max_attempts, least=1)
        resolver = strategy.cluster_resolver
        spec = resolver.cluster_spec()
        if "worker" not in spec.jobs:
            raise ConfigError(f"the cluster has no worker job to schedule on: {spec.as_dict()}")
        credentials: Credentials = resolver.require_credentials()
        self._credentials = credentials
        self._worker_timeout_s = worker_timeout_s
        self._strategy = strategy
        self._max_attempts = max_attempts
        self._id = uuid.uuid4().hex[:8]
        self._cond = threading.Condition()
        self._workers = [
            WorkerLink(
                index=i,
                name=f"worker:{i}",
                address=spec.task_address("worker", i),
                credentials=credentials,
                timeout_s=worker_timeout_s,
            )
            for i in spec.task_indices("worker")
        ]
        self._manager = ManagerLink.from_env()
        self._ready: deque[Closure] = deque()
        """Functions ready to run, oldest first (a retried one at the front)."""
        self._closures = itertools.count()
        self._graph = DependencyGraph()
        self._unfinished: dict[int, Closure] = {}
        """The closures in the graph, by index: waiting for inputs, queued or running."""
        self._errors: list[CoordinatorError] = []
        self._packer = Packer(strategy, self)
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
        self._spec_version = 0
        if self._manager is not None:  # an elastic cluster's workers come and go
            threading.Thread(
                target=self._follow_membership, name="coordinator-membership", daemon=True
            ).start()
        atexit.register(self.close)

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    @property
    def num_workers(self) -> int:
        """The workers functions are sent to now (an elastic cluster's change them)."""
        return sum(1 for w in self._workers if not w.retired)

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
        function, blob, inputs = self._packer.pack(fn, tuple(args or ()), kwargs or {}, name)
        with self._cond:
            if self._closed:
                raise CoordinatorClosed("the coordinator is closed")
            index = next(self._closures)
            closure = Closure(index, name, function, blob, inputs, RemoteValue(self, index, name))
            self._scheduled += 1
            self._unfinished[index] = closure
            failed = next((rv for rv in inputs if rv.error() is not None), None)
            if failed is not None:
                self._fail(closure, self._dependency_error(closure, failed))
            elif self._graph.add(index, (rv.index for rv in inputs)):
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
        return map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, values)

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
            for closure in list(self._unfinished.values()):
                self._fail(closure, CoordinatorClosed(f"{closure.name}: coordinator closed"))
            self._ready.clear()
            self._closing.set()
            self._cond.notify_all()
        atexit.unregister(self.close)
        if stop_workers:
            stoppers = [
                threading.Thread(target=w.stop, daemon=True) for w in self._workers if not w.retired
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

    # Scheduling (the lock is held) -------------------------------------------------

    def _enqueue(self, closure: Closure, *, front: bool = False, avoid: int | None = None) -> None:
        """Onto the queue: at its end, or (``front``, a retry) at its front, to be taken
        by a worker other than ``avoid`` (the one that lost it) while another is up."""
        closure.avoid = avoid
        if front:
            self._ready.appendleft(closure)
        else:
            self._ready.append(closure)
        self._cond.notify_all()

    def _take(self, worker: WorkerLink) -> Closure | None:
        """The oldest ready closure ``worker`` may run (None once closing or retired)."""
        with self._cond:
            while not self._closing.is_set() and not worker.retired:
                picked = next((c for c in self._ready if c.avoid != worker.index), None)
                if picked is None and self._ready and not self._others_up(worker):
                    picked = self._ready[0]  # the worker that lost it is the only one up
                if picked is not None:
                    self._ready.remove(picked)
                    return picked
                self._cond.wait(POLL_S)
        return None

    def _others_up(self, worker: WorkerLink) -> bool:
        return any(w.up and not w.retired for w in self._workers if w is not worker)

    def _succeed(self, closure: Closure, blob: bytes) -> None:
        if closure.index not in self._unfinished:
            return  # failed meanwhile (the coordinator closed)
        self._completed += 1
        del self._unfinished[closure.index]
        for ready in self._graph.succeed(closure.index):
            self._enqueue(self._unfinished[ready])
        closure.result.set_result(blob)
        self._cond.notify_all()

    def _fail(self, closure: Closure, error: CoordinatorError) -> None:
        """Fails ``closure`` and, transitively, every function waiting for it."""
        if closure.index not in self._unfinished:
            return
        failed = {closure.index: closure}
        self._settle_failed(closure, error)
        for index, cause in self._graph.fail(closure.index):
            dependent = failed[index] = self._unfinished[index]
            self._settle_failed(dependent, self._dependency_error(dependent, failed[cause].result))
        self._cond.notify_all()

    def _settle_failed(self, closure: Closure, error: CoordinatorError) -> None:
        self._failed += 1
        if isinstance(error, FunctionError | WorkerFailure):
            self._errors.append(error)
        del self._unfinished[closure.index]
        closure.result.set_error(error)

    @staticmethod
    def _dependency_error(closure: Closure, failed: RemoteValue) -> DependencyError:
        error = DependencyError(
            f"{closure.name} did not run: its input {failed!r} failed: {failed.error()}"
        )
        error.__cause__ = failed.error()
        return error

    def _raise_first_error(self) -> None:
        if self._errors:
            first = self._errors[0]
            self._errors.clear()
            raise first

    # Dispatching (one thread per worker) -------------------------------------------

    def _follow_membership(self) -> None:
        """Polls the manager's newest spec; at a new version, starts sending to the
        workers it added and stops sending to those it dropped (``clusterflow scale``,
        or a worker lost above MIN). A function running on a dropped worker comes back
        as ``WorkerLost`` and runs elsewhere, as for any failed worker."""
        assert self._manager is not None
        while not self._closing.wait(MEMBERSHIP_POLL_S):
            reply = self._manager.spec()
            if reply is None or reply.spec is None or reply.spec_version <= self._spec_version:
                continue
            version = self._spec_version = reply.spec_version
            try:
                spec = ClusterSpec(reply.spec)
            except ClusterflowError as exc:
                log.warning("cannot read spec version %d: %s", version, exc)
                continue
            self._apply_membership(spec, version)

    def _apply_membership(self, spec: ClusterSpec, version: int) -> None:
        indexes = set(spec.task_indices("worker")) if "worker" in spec.jobs else set()
        with self._cond:
            if self._closed:
                return
            known = {w.index: w for w in self._workers}
            live = {i for i, w in known.items() if not w.retired}
            for index in sorted(indexes - live):  # new, or a name that left and came back
                link = WorkerLink(
                    index=index,
                    name=f"worker:{index}",
                    address=spec.task_address("worker", index),
                    credentials=self._credentials,
                    timeout_s=self._worker_timeout_s,
                )
                thread = threading.Thread(
                    target=self._dispatch,
                    args=(link,),
                    name=f"coordinator-{link.name}",
                    daemon=True,
                )
                if index in known:  # its old link's thread ends (retired): take its place
                    at = self._workers.index(known[index])
                    self._workers[at], self._threads[at] = link, thread
                else:
                    self._workers.append(link)
                    self._threads.append(thread)
                thread.start()
                log.info("%s joined (spec version %d): functions go to it too", link.name, version)
            for index, link in known.items():
                if index in indexes or link.retired:  # kept, or gone already
                    continue
                link.retired = True
                log.info(
                    "%s left (spec version %d): nothing more is sent to it", link.name, version
                )
            self._cond.notify_all()

    def _dispatch(self, worker: WorkerLink) -> None:
        delay = PROBE_MIN_S
        while not self._closing.is_set() and not worker.retired:
            if not worker.up:
                if worker.probe():
                    log.info("%s serves the coordinator", worker.name)
                    delay = PROBE_MIN_S
                    with self._cond:
                        self._cond.notify_all()
                else:
                    if self._manager is not None:  # else addresses stay as TF_CONFIG gave them
                        worker.follow(self._manager)
                    self._closing.wait(delay)
                    delay = min(delay * 2, PROBE_MAX_S)
                continue
            closure = self._take(worker)
            if closure is None:
                continue
            try:
                blob, error = worker.run(closure, self._id, self._closing)
            except WorkerLost as lost:
                worker.up = False
                self._requeue(worker, closure, str(lost))
                continue
            except Abandoned:
                continue
            with self._cond:
                if error is not None:
                    self._fail(closure, error)
                else:
                    assert blob is not None
                    self._succeed(closure, blob)

    def _requeue(self, worker: WorkerLink, closure: Closure, reason: str) -> None:
        log.warning("%s failed while running %s: %s", worker.name, closure.name, reason)
        with self._cond:
            if closure.index not in self._unfinished:
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
