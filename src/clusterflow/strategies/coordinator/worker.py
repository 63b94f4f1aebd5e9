"""The worker's side of ``ClusterCoordinator``: the ``worker.*`` service and ``serve_worker``.

In TensorFlow 2's coordinator form every task runs the user's script; worker tasks
only serve (``server.join()``) while the chief schedules functions on them. Here a
worker task calls ``serve_worker()``, which starts the task's ``Server`` with this
service and blocks until the chief's coordinator closes or the task is stopped.

What arrives: a function pickled with cloudpickle by the chief, sent once per worker
and cached here under its content hash; then, per call, only that hash, the pickled
arguments and the pickled values of the ``RemoteValue`` s the call takes. They come
only over the task's authenticated RPC channel (a peer without the cluster's secret
is refused at connect), and nothing else is ever unpickled here.

Variables: the chief pickles the strategy's variables as references (name, shape,
placement), not values. Unpickling binds each to one local tensor per variable, owned
by this worker's own ``ParameterServerStrategy`` (the same ps tasks and placement as
the chief's), and every function runs inside that strategy's ``run``: the newest
values are pulled first, ``optimizer.step()`` pushes the gradients to the ps, and the
push is answered before the function's result goes back to the chief. Every copy of a
function's model on this worker shares those tensors.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import queue
import signal
import threading
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
import torch

from clusterflow.cluster import TFConfig
from clusterflow.errors import ConfigError
from clusterflow.ps.api import Placement
from clusterflow.rpc import Credentials, Request
from clusterflow.server import Server
from clusterflow.server.manager_link import ManagerLink
from clusterflow.strategies.api import StrategyError
from clusterflow.strategies.coordinator.api import map_structure
from clusterflow.strategies.coordinator.protocol import (
    METHOD_INFO,
    METHOD_RESULT,
    METHOD_RUN,
    METHOD_STOP,
    CallReply,
    CallState,
    ErrorReport,
    ResultRequest,
    RunRequest,
    StrategySettings,
    WorkerInfo,
    digest_of,
)
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.strategies.pipeline.placed_service import PlacedService
from clusterflow.strategies.resolver import ClusterResolver

log = logging.getLogger(__name__)

FUNCTION_CACHE = 64
"""Unpickled functions kept per worker; a training loop schedules a handful."""
FINISHED_CALLS = 64
"""Finished calls kept so a chief whose poll was lost can still collect the result."""


# Unpickling binds variables to the worker whose service is unpickling, on this thread.
_binding = threading.local()


def _service() -> WorkerService:
    service = getattr(_binding, "service", None)
    if service is None:
        raise StrategyError(
            "a strategy variable can only be unpickled by a worker's service "
            "(it is a reference to a variable on the ps tasks, not a value)"
        )
    bound: WorkerService = service
    return bound


def bound_variable(
    settings: StrategySettings, name: str, is_parameter: bool, requires_grad: bool
) -> torch.Tensor:
    """Unpickles a reference to a strategy variable as this worker's tensor for it."""
    return _service().strategy(settings).variable(name, is_parameter, requires_grad)


def bound_strategy(settings: StrategySettings) -> ReplicaStrategy:
    """Unpickles the chief's strategy as the worker's strategy, seen from inside a function."""
    return ReplicaStrategy(_service().strategy(settings))


class ReplicaStrategy:
    """What a scheduled function's ``strategy`` is on a worker.

    ``run(step, args)`` calls ``step`` at once: the worker already runs the whole
    scheduled function inside its strategy's ``run`` (values pulled, pushes armed), as
    a TensorFlow function's ``strategy.run`` runs the replica function in place. Every
    other attribute is the worker's ``ParameterServerStrategy``.
    """

    def __init__(self, strategy: WorkerStrategy) -> None:
        self._strategy = strategy

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        return fn(*args, **(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)


class WorkerStrategy(ParameterServerStrategy):
    """This worker's replica of the chief's strategy: its ps tasks, placement and options.

    Variables are bound as the chief's functions arrive, one local tensor per variable;
    nothing is created on the ps (the chief created every variable in its scope).
    """

    def __init__(self, resolver: ClusterResolver, settings: StrategySettings) -> None:
        super().__init__(resolver, **dict(settings.options))
        self.settings = settings
        self._known = {spec.name: (spec, shards) for spec, shards in settings.variables}
        self.placement = Placement({name: shards for name, (_, shards) in self._known.items()})
        self._bound: dict[str, torch.Tensor] = {}

    @property
    def bound(self) -> int:
        """Variables bound so far (0: functions run without pulling anything)."""
        return len(self._bound)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """Runs ``fn`` as every replica does, from the newest values, push included.

        A between-graph replica starts a step from the values its own last push got
        back, and may leave its push in flight. A scheduled function must see what the
        other workers pushed since, and its own update must be applied before the chief
        hears it finished: then a function scheduled after ``join()`` sees every update
        made before it, as TensorFlow's reads at the ps do.
        """
        self.discard_staged_values()  # else the values our last push brought back
        try:
            return super().run(fn, args, kwargs, **options)
        finally:
            self.flush()

    def leave(self) -> None:
        """Nothing to leave: the coordinator is asynchronous only, so no sync step waits.

        (And ``close()`` at a task's SIGTERM must not wait on a ps that stops with it.)
        """

    def update(self, settings: StrategySettings) -> None:
        """Takes the variables the chief created since; its options must not change.

        Raises:
            StrategyError: the chief's strategy now has other options than before.
        """
        if settings == self.settings:
            return
        if settings.options != self.settings.options:
            raise StrategyError(
                f"the chief's strategy changed its options from {dict(self.settings.options)} "
                f"to {dict(settings.options)}; one coordinator serves one strategy"
            )
        self._known.update({spec.name: (spec, shards) for spec, shards in settings.variables})
        self.placement.shards.update({name: shards for name, (_, shards) in self._known.items()})
        self.settings = settings

    def variable(self, name: str, is_parameter: bool, requires_grad: bool) -> torch.Tensor:
        """The one local tensor of variable ``name`` on this worker, bound on first use.

        It holds zeros until the next ``run`` pulls the values, which happens before
        every scheduled function.
        """
        tensor = self._bound.get(name)
        if tensor is not None:
            return tensor
        if name not in self._known:
            raise StrategyError(f"variable {name!r} is not in the chief's strategy")
        spec, shards = self._known[name]
        tensor = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype))
        if is_parameter:
            tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
        elif requires_grad:
            tensor.requires_grad_(True)
        self.adopt_variable(tensor, spec, shards)
        self._bound[name] = tensor
        return tensor


@dataclass(slots=True, eq=False)
class _Call:
    id: str
    finished: threading.Event = field(default_factory=threading.Event)
    reply: CallReply | None = None


class _NeedFunction(Exception):
    """The function was evicted from the cache before its call ran; the chief resends it."""


class _InputUnpickler(pickle.Unpickler):
    """Unpickles arguments, putting each input ``RemoteValue``'s value in its place."""

    def __init__(self, data: bytes, inputs: list[Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._inputs = inputs

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "input":
            return self._inputs[int(pid[1])]
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


class WorkerService:
    """Runs the functions a ``ClusterCoordinator`` schedules on this worker task.

    Functions run one at a time, in arrival order, on one thread of their own, so the
    RPC server keeps answering the chief's polls while a function runs.

    Args:
        server: this worker task's server; the service registers ``worker.*`` on it.
        resolver: the cluster, for this worker's strategy; by default the server's.
    """

    def __init__(self, server: Server, *, resolver: ClusterResolver | None = None) -> None:
        self.server = server
        self.incarnation = uuid.uuid4().hex
        """Tells the chief that a worker at the same address is a new process."""
        self._resolver = resolver or ClusterResolver(
            server.cluster_spec, server.task, server.credentials
        )
        self._lock = threading.Lock()
        self._functions: OrderedDict[str, Callable[..., Any]] = OrderedDict()
        self._calls: OrderedDict[str, _Call] = OrderedDict()
        self._strategy: WorkerStrategy | None = None
        # A daemon thread, not an executor: a task told to stop must not wait at exit
        # for a function that may run for a long time (or forever).
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._runner = threading.Thread(target=self._run_calls, name="worker-function", daemon=True)
        self._runner.start()
        self.stopped = threading.Event()
        """Set when the coordinator asked this worker to stop."""
        self.executed = 0
        """Calls started by this process (a re-run after a worker failure counts again)."""
        server.register(METHOD_RUN, self._on_run, blocking=True)
        server.register(METHOD_RESULT, self._on_result, blocking=True)
        server.register(METHOD_INFO, self._on_info)
        server.register(METHOD_STOP, self._on_stop)

    def strategy(self, settings: StrategySettings) -> WorkerStrategy:
        """This worker's strategy, built on first use from the chief's settings."""
        if self._strategy is None:
            self._strategy = WorkerStrategy(self._resolver, settings)
        else:
            self._strategy.update(settings)
        return self._strategy

    def close(self) -> None:
        """Runs no more calls (a running one is abandoned) and closes the ps connections."""
        self._queue.put(None)
        if self._strategy is not None:
            self._strategy.close()

    # Handlers ----------------------------------------------------------------------

    def _on_run(self, request: Request) -> dict[str, Any]:
        run = RunRequest.from_wire(request.body)
        with self._lock:
            call = self._calls.get(run.call)
            if call is None:
                if run.payload is None and run.fn not in self._functions:
                    return CallReply(state=CallState.NEED_FUNCTION).to_wire()
                call = _Call(run.call)
                self._calls[run.call] = call
                self._queue.put((call, run))
        return self._await(call, run.wait)

    def _on_result(self, request: Request) -> dict[str, Any]:
        poll = ResultRequest.from_wire(request.body)
        with self._lock:
            call = self._calls.get(poll.call)
        if call is None:  # a new incarnation: the call died with the old one
            return CallReply(state=CallState.UNKNOWN).to_wire()
        return self._await(call, poll.wait)

    def _on_info(self, request: Request) -> dict[str, Any]:
        return WorkerInfo(
            incarnation=self.incarnation,
            task=str(self.server.task),
            pid=os.getpid(),
            executed=self.executed,
        ).to_wire()

    def _on_stop(self, request: Request) -> dict[str, Any]:
        log.info("the coordinator closed; %s stops serving", self.server.task)
        self.stopped.set()
        # After this reply is on its way: stopping joins the thread that sends it.
        threading.Timer(0.2, self.server.stop).start()
        return {"stopping": True}

    def _await(self, call: _Call, wait: float) -> dict[str, Any]:
        if not call.finished.wait(max(0.0, min(wait, 30.0))) or call.reply is None:
            return CallReply(state=CallState.RUNNING).to_wire()
        return call.reply.to_wire()

    # Running a call ----------------------------------------------------------------

    def _run_calls(self) -> None:
        while (item := self._queue.get()) is not None:
            self._execute(*item)

    def _execute(self, call: _Call, run: RunRequest) -> None:
        reply: CallReply
        try:
            fn = self._function(run.fn, run.payload)
            values = [pickle.loads(blob) for blob in run.inputs]
            call_args, call_kwargs = self._loads(run.args, values)
            self.executed += 1
            strategy = self._strategy
            if strategy is not None and strategy.bound:
                result = strategy.run(fn, tuple(call_args), call_kwargs)
            else:
                result = fn(*call_args, **call_kwargs)
            value = cloudpickle.dumps(map_structure(_detached, result))
            reply = CallReply(state=CallState.DONE, value=value)
        except _NeedFunction:
            with self._lock:
                self._calls.pop(call.id, None)  # the resent call starts afresh
            reply = CallReply(state=CallState.NEED_FUNCTION)
        except BaseException as exc:  # the function's own error, reported to the chief
            log.info("call %s failed: %s: %s", call.id, type(exc).__name__, exc)
            reply = CallReply(state=CallState.FAILED, error=_describe(exc))
        call.reply = reply
        call.finished.set()
        with self._lock:
            done = [c for c in self._calls if self._calls[c].finished.is_set()]
            for stale in done[: max(0, len(done) - FINISHED_CALLS)]:
                del self._calls[stale]

    def _function(self, digest: str, payload: bytes | None) -> Callable[..., Any]:
        with self._lock:
            fn = self._functions.get(digest)
            if fn is not None:
                self._functions.move_to_end(digest)
                return fn
        if payload is None:
            raise _NeedFunction(digest)
        if digest_of(payload) != digest:
            raise StrategyError(f"function payload does not match its hash {digest[:12]}")
        loaded: Callable[..., Any] = self._loads(payload, [])
        if not callable(loaded):
            raise StrategyError(f"the chief sent {type(loaded).__name__}, not a function")
        with self._lock:
            self._functions[digest] = loaded
            while len(self._functions) > FUNCTION_CACHE:
                self._functions.popitem(last=False)
        return loaded

    def _loads(self, data: bytes, inputs: list[Any]) -> Any:
        _binding.service = self
        try:
            return _InputUnpickler(data, inputs).load()
        finally:
            _binding.service = None


def _detached(value: Any) -> Any:
    """Without autograd history: a tensor with a graph cannot cross processes."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach()
    return value


def _describe(exc: BaseException) -> ErrorReport:
    """An error as the chief re-raises it: type, message, traceback and, if it pickles, itself."""
    try:
        pickled: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    kind = type(exc)
    return ErrorReport(
        type=f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins."),
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
        exception=pickled,
    )


def serve_worker(environ: Mapping[str, str] | None = None) -> None:
    """Serves this worker task for the chief's ``ClusterCoordinator``, as TF's ``server.join()``.

    Call it on worker tasks, in place of the training code; the chief's script builds
    the strategy and the coordinator. Reads ``TF_CONFIG`` and the cluster's secret from
    the environment that ``clusterflow start`` set.

    Blocks until the coordinator's ``close()`` asks this worker to stop, or SIGTERM or
    SIGINT arrives (handled only when called on the main thread).

    Raises:
        ConfigError: ``TF_CONFIG`` is unset or names no task, there are no cluster
            credentials, or this task's address cannot be served.
    """
    config = TFConfig.from_env(environ)
    if config is None or config.task is None:
        raise ConfigError("TF_CONFIG is not set or has no 'task': run under `clusterflow start`")
    credentials = Credentials.from_env(None if environ is None else dict(environ))
    # Not started until the service is registered: a chief that sees the port answer
    # must find `worker.*` there.
    server = Server(
        config.cluster, config.task.job, config.task.index, credentials=credentials, start=False
    )
    service = WorkerService(server)
    PlacedService(server)  # modules the chief placed here with cf.device (in-graph)
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def _stop(signum: int, frame: FrameType | None) -> None:
            server.stop()

        for stop_signal in (signal.SIGTERM, signal.SIGINT):
            previous[stop_signal] = signal.signal(stop_signal, _stop)
    link = ManagerLink.from_env(environ)
    if link is not None and config.task.job == "worker":
        # It holds nothing the chief cannot send again: relaunch it alone when it dies,
        # and let an elastic cluster add or remove it (the coordinator follows the spec).
        link.declare(respawnable=True, resizable=True)
        link.close()
    try:
        server.start()
        log.info("%s serves the coordinator at %s", server.task, server.target)
        server.join()
    finally:
        for stop_signal, handler in previous.items():
            signal.signal(stop_signal, handler)
        service.close()
        server.stop()
