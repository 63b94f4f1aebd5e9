"""The chief's line to one worker task: run a function there, probe it, follow it, stop it.

One call of ``worker.run`` starts a function and waits a little (``POLL_S``); while it
runs, the chief polls ``worker.result``, so no RPC waits longer than a poll plus the
worker's timeout, however long the function takes. Every way a call can fail (no
answer in time, a refused call, a reply from a new process that never heard of the
call) means the same to the scheduler: the worker is lost for now, and the function
goes to another (``WorkerLost``).
"""

from __future__ import annotations

import logging
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any

from clusterflow.cluster import ClusterSpec
from clusterflow.errors import ClusterflowError
from clusterflow.rpc import Credentials, RemoteError, RpcClient, RpcError
from clusterflow.server.manager_link import ManagerLink
from clusterflow.strategies.coordinator.api import FunctionError, RemoteValue
from clusterflow.strategies.coordinator.pickling import PickledFunction
from clusterflow.strategies.coordinator.protocol import (
    METHOD_INFO,
    METHOD_RESULT,
    METHOD_RUN,
    METHOD_STOP,
    CallReply,
    CallState,
    ErrorReport,
    MalformedMessage,
    ResultRequest,
    RunRequest,
    WorkerInfo,
)

log = logging.getLogger(__name__)

__all__ = ["POLL_S", "Abandoned", "Closure", "WorkerLink", "WorkerLost"]

POLL_S = 1.0
"""How long one call to a worker waits for the function to finish before the chief polls."""
STOP_DEADLINE_S = 2.0
"""How long ``close`` waits for a worker to acknowledge the stop."""


@dataclass(slots=True, eq=False)
class Closure:
    """One scheduled call of a function: what a worker runs, and where its result goes."""

    index: int
    name: str
    function: PickledFunction
    args: bytes
    inputs: list[RemoteValue]
    """The ``RemoteValue`` s among the arguments, in the order of their placeholders."""
    result: RemoteValue
    attempts: int = 0
    """Workers it was sent to so far."""
    avoid: int | None = None
    """The index of the worker that lost it last: another one takes it while one is up."""


class WorkerLost(Exception):
    """The worker did not answer, or answered as a new process: re-run the function elsewhere."""


class Abandoned(Exception):
    """The coordinator closed while the function ran."""


@dataclass(slots=True, eq=False)
class WorkerLink:
    """One worker task as the chief sees it; used by its own dispatch thread only."""

    index: int
    name: str
    address: str
    credentials: Credentials
    timeout_s: float
    client: RpcClient = field(init=False)
    up: bool = False
    incarnation: str | None = None
    sent: set[str] = field(default_factory=set)
    """Digests of the functions this incarnation of the worker holds."""
    retired: bool = False
    """The worker left the cluster (a newer spec version drops it): its thread ends,
    and nothing is sent to it again."""

    def __post_init__(self) -> None:
        self.client = RpcClient(self.address, self.credentials)

    def call(self, method: str, body: Any, wait: float = 0.0) -> dict[str, Any]:
        """One call; every way it can fail means the worker is lost for now.

        Raises:
            WorkerLost: no reply within ``wait`` plus the worker's timeout, a refusal,
                or a reply that is not a dict.
        """
        try:
            reply = self.client.call(method, body, deadline=wait + self.timeout_s)
        except RemoteError as exc:
            raise WorkerLost(f"{self.name} refused {method}: {exc}") from exc
        except RpcError as exc:
            raise WorkerLost(f"{self.name} did not answer {method}: {exc}") from exc
        if not isinstance(reply.body, dict):
            raise WorkerLost(f"{self.name} answered {method} with {reply.body!r}")
        return reply.body

    def probe(self) -> bool:
        """Whether the worker serves the coordinator now; notes a restarted worker."""
        try:
            info = WorkerInfo.from_wire(self.call(METHOD_INFO, None))
        except (WorkerLost, MalformedMessage) as exc:
            log.debug("%s not serving yet: %s", self.name, exc)
            return False
        if info.incarnation != self.incarnation:
            if self.incarnation is not None:
                log.info("%s is a new process (pid %s)", self.name, info.pid)
            self.incarnation = info.incarnation
            self.sent.clear()
        self.up = True
        return True

    def follow(self, manager: ManagerLink) -> None:
        """Re-points the client if the manager's newest spec moved this worker.

        A worker the manager respawned comes back on a new port: the spec version it
        made names the new address (``manager.spec``).
        """
        reply = manager.spec()
        if not reply or not reply.spec:
            return
        try:
            address = ClusterSpec(reply.spec).task_address("worker", self.index)
        except ClusterflowError:
            return
        if address != self.address:
            log.info("%s moved to %s (spec version %s)", self.name, address, reply.spec_version)
            self.client.close()
            self.address = address
            self.client = RpcClient(address, self.credentials)

    def run(
        self, closure: Closure, caller: str, closing: threading.Event
    ) -> tuple[bytes | None, FunctionError | None]:
        """Runs ``closure`` here: (value blob, None) or (None, the function's error).

        Blocks until the function returned or raised; ``caller`` names this attempt's
        calls apart from every other coordinator's.

        Raises:
            WorkerLost: the worker did not answer, or lost the call.
            Abandoned: ``closing`` was set meanwhile.
        """
        closure.attempts += 1
        function = closure.function
        inputs = [rv.pickled() for rv in closure.inputs]
        for resend in range(2):
            call = f"{caller}.{closure.index}.{closure.attempts}.{resend}"
            run = RunRequest(
                call=call,
                fn=function.digest,
                args=closure.args,
                inputs=inputs,
                wait=POLL_S,
                payload=None if function.digest in self.sent else function.payload,
            )
            reply = self._reply(METHOD_RUN, run.to_wire())
            if reply.state is not CallState.NEED_FUNCTION:
                self.sent.add(function.digest)
            while reply.state is CallState.RUNNING:
                if closing.is_set():
                    raise Abandoned
                reply = self._reply(METHOD_RESULT, ResultRequest(call=call, wait=POLL_S).to_wire())
            if reply.state is CallState.NEED_FUNCTION:  # evicted from its cache: send it again
                self.sent.discard(function.digest)
                continue
            if reply.state is CallState.DONE and reply.value is not None:
                return reply.value, None
            if reply.state is CallState.FAILED and reply.error is not None:
                return None, self._function_error(closure, reply.error)
            raise WorkerLost(f"{self.name} lost call {call} (it answered {reply.state.value!r})")
        raise WorkerLost(f"{self.name} keeps asking for {closure.name}")

    def _reply(self, method: str, body: dict[str, Any]) -> CallReply:
        """A ``worker.run`` or ``worker.result`` call; a reply off the contract loses it."""
        try:
            return CallReply.from_wire(self.call(method, body, POLL_S))
        except MalformedMessage as exc:
            raise WorkerLost(f"{self.name} answered {method} off the contract: {exc}") from exc

    def stop(self) -> None:
        """Asks the worker's ``serve_worker`` to return; waits ``STOP_DEADLINE_S`` at most.

        A fresh client: the dispatch thread may still hold this worker's own client in
        a call to a dead worker, for up to the worker's timeout.
        """
        try:
            with RpcClient(self.address, self.credentials, deadline=STOP_DEADLINE_S) as client:
                client.call(METHOD_STOP)
        except RpcError as exc:
            log.debug("%s did not take the stop: %s", self.name, exc)

    def _function_error(self, closure: Closure, report: ErrorReport) -> FunctionError:
        error = FunctionError(
            f"{closure.name} raised {report.type} on {self.name}: {report.message}",
            error_type=report.type,
            remote_traceback=report.traceback,
            worker=self.name,
        )
        if report.exception is not None:
            try:
                original = pickle.loads(report.exception)
            except Exception:
                original = None
            if isinstance(original, BaseException):
                error.__cause__ = original
        return error
