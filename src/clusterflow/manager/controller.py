"""The manager's controller loop: launch, watch, decide, act.

The loop polls the tasks, builds a frozen ``ClusterStatus`` and asks ``policy.decide``
what to do; all side effects (signals, state files, output) happen here. Its
collaborators each do one job and are passed in (``Controller.__init__`` builds the
defaults): the backend starts supervisors, the ``Rendezvous`` holds the registration
barrier and the spec versions, ``job_env`` computes every environment, the
``StandbyPool`` keeps a warm supervisor, ``RestorePoints`` picks the checkpoint, the
``OutputRouter`` routes output, the ``DispatcherService`` is the data service, and
``ClusterState`` is what ``state.json`` holds. The recovery actions (respawn one task,
restart them all) are ``recovery.py``'s, mixed in.

When the run ends (success, failure or a stop request) the controller, in this order:
releases registrations still held at the barrier, stops the tasks that still run
(SIGTERM to each process group, SIGKILL after the grace period), stops the torch store,
ends whatever the tasks left behind (found by the cluster id in their environment),
waits for their output, and only then records the final status, so whoever sees a
final status in ``state.json`` also sees every line in the logs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from clusterflow.backends import forkserver
from clusterflow.backends.api import Backend, TaskProcess
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import (
    ENV_CLUSTER_ID,
    ENV_SECRET_FILE,
    ManagerMethod,
)
from clusterflow.data.dispatcher import DispatcherService
from clusterflow.errors import ClusterflowError
from clusterflow.manager import registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.elastic import Elastic
from clusterflow.manager.job_env import (
    ClusterPlace,
    Incarnation,
    job_env,
    replica_env,
    supervisor_env,
)
from clusterflow.manager.output import OutputRouter
from clusterflow.manager.policy import ClusterStatus, Decision, Verdict, decide
from clusterflow.manager.recovery import Recovery
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.rendezvous import Arrival, RegistrationError, Rendezvous
from clusterflow.manager.restore import RestorePoints
from clusterflow.manager.standby import StandbyPool
from clusterflow.manager.state import ClusterState, ManagerProcess
from clusterflow.manager.stopper import cluster_processes, kill_processes
from clusterflow.manager.store_host import StoreHost
from clusterflow.manager.tasks import TaskRecord, TaskTable
from clusterflow.manager.trial_reports import TrialReports
from clusterflow.rpc import Credentials, Request, RpcServer
from clusterflow.server.manager_messages import (
    CheckpointsReply,
    CheckpointsRequest,
    DeclareReply,
    DeclareRequest,
    ExitedRequest,
    HeartbeatRequest,
    RegisterReply,
    RegisterRequest,
    ReportRequest,
    SpecReply,
    SpecRequest,
    StandbyRequest,
    StatusRequest,
    StopRequest,
)

log = logging.getLogger(__name__)

__all__ = ["POLL_S", "Controller", "RegistrationError"]

POLL_S = 0.1
"""Longest the loop waits between looks at the tasks (an exit also wakes it at once)."""
EXIT_REPORT_WAIT_S = 10.0
"""How long a waiter watches a supervisor that reported its job's exit (it exits at once;
one that does not is found by the loop's looks all the same)."""
STATE_EVERY_S = 2.0
"""``state.json`` is rewritten at least this often (live figures), and at every change."""


StoreFactory = Callable[[bool], StoreHost]
"""Starts the hosted torch store of one attempt (a fresh one for each); True: start its
process at once (``StoreHost``'s ``eager``)."""


class Controller(Recovery, Elastic):
    """Runs one cluster from launch to exit.

    Args:
        cluster: the cluster's folder (its config and secret are already written).
        config: what to run.
        backend: where tasks run.
        echo: also write task output to this process's stdout (foreground ``start``).
        rpc, output, data, rendezvous, standby, restore_points, store: the collaborators;
            each defaults to the one a real cluster uses (tests pass their own).
    """

    def __init__(
        self,
        cluster: ClusterDir,
        config: RunConfig,
        backend: Backend,
        *,
        echo: bool = False,
        rpc: RpcServer | None = None,
        output: OutputRouter | None = None,
        data: DispatcherService | None = None,
        rendezvous: Rendezvous | None = None,
        standby: StandbyPool | None = None,
        restore_points: RestorePoints | None = None,
        store: StoreFactory | None = None,
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.backend = backend
        self.tasks = TaskTable(config)
        self._init_elastic()
        self._arrivals = threading.Lock()
        """Held by a registration from the rendezvous to its record (``_on_register``)."""
        self._wake = threading.Event()
        self._stop_requested = False
        self.failure: str | None = None
        """Why the run failed, in one line, once ``run`` returned; None unless it failed."""
        self._grace_s = config.grace_s
        self._status = "starting"
        self._created = time.time()
        self._store: StoreHost | None = None
        self._spare_store: StoreHost | None = None
        """The next attempt's store, started ahead (``--warm-restarts``)."""
        self._restarts = 0
        self._memory_restarts = 0
        self._attempt = 0
        self.output = output or OutputRouter(cluster.output_file, echo=echo)
        self._rpc = rpc or _manager_server(
            cluster, config, len(self.tasks) + config.most_workers - config.workers
        )
        self.rendezvous = rendezvous or Rendezvous(
            list(self.tasks), timeout_s=config.register_timeout_s
        )
        self.standby = standby or StandbyPool(
            backend,
            self.output,
            cluster,
            stopping=lambda: self._stop_requested,
            on_change=self.tasks.changed,
        )
        self.restore_points = restore_points or RestorePoints(
            config.checkpoint_dir or str(cluster.path / "checkpoints")
        )
        self._new_store = store or (
            lambda eager: StoreHost(
                {**os.environ, ENV_CLUSTER_ID: cluster.id}, config.host, eager=eager
            )
        )
        self.place = ClusterPlace(
            cluster_id=cluster.id,
            manager=self._rpc.address,
            secret_file=str(cluster.secret_file),
            state_dir=str(cluster.path),
            checkpoint_url=self.restore_points.url,
        )
        for method, handler, blocking in (
            (ManagerMethod.REGISTER, self._on_register, True),
            (ManagerMethod.HEARTBEAT, self._on_heartbeat, False),
            (ManagerMethod.EXITED, self._on_exited, False),
            (ManagerMethod.STOP, self._on_stop, False),
            (ManagerMethod.STATUS, self._on_status, False),
            (ManagerMethod.DECLARE, self._on_declare, False),
            (ManagerMethod.CHECKPOINTS, self._on_checkpoints, False),
            (ManagerMethod.STANDBY, self._on_standby, True),
            (ManagerMethod.SPEC, self._on_spec, False),
            (ManagerMethod.SCALE, self._on_scale, True),
            (ManagerMethod.REPORT, self._on_report, False),
            (ManagerMethod.TRIAL_REPORT, TrialReports(cluster.path).on_report, False),
        ):
            # Each handler parses its body with its type (server/manager_messages.py): a
            # body that breaks the contract is MalformedBody, answered as `malformed`.
            self._rpc.register(method, handler, blocking=blocking)
        # The data service lives here for clusters started by `clusterflow start`: every
        # task reaches it at CLUSTERFLOW_MANAGER, and the manager learns of deaths first.
        self.data = (data or DispatcherService()).register_on(self._rpc)

    # The public face ---------------------------------------------------------------

    def request_stop(self) -> None:
        """Asks the loop to stop the cluster; the loop sees it within ``POLL_S``.

        Safe from signal handlers because it takes no lock: a handler runs on the main
        thread between two bytecodes, possibly inside the loop's own ``Event`` calls,
        whose lock is not reentrant.
        """
        self._stop_requested = True

    def run(self) -> int:
        """Runs the cluster to its end; returns the exit code for ``clusterflow start``."""
        self._rpc.start()
        self.cluster.append_event("starting", tasks=[str(t) for t in self.tasks])
        self._write_state()
        try:
            self._store = self._new_store(False)  # a job may never use it
            restore = self._choose_checkpoint(restore_data=True)
            for task in self.tasks.values():
                self._launch(task, restore)
            self._write_state()
            verdict = self._loop()
        except BaseException:
            self._shut_down()
            self._finish("failed", 1, "the manager failed")
            raise
        return self._conclude(verdict)

    def state(self) -> ClusterState:
        """The cluster as ``state.json`` and ``manager.status`` show it.

        The tasks are read before the spec: a respawned task's registration publishes its
        new address in the spec first and marks the task running second, so this order
        never shows a task running at an address the spec does not hold yet.
        """
        me = psutil.Process()
        tasks = self.tasks.states()
        spec, version = self.rendezvous.current()
        return ClusterState(
            id=self.cluster.id,
            status=self._status,
            created=self._created,
            backend=self.backend.name,
            command=tuple(self.config.command),
            manager=ManagerProcess(
                pid=me.pid, create_time=me.create_time(), address=self._rpc.address
            ),
            spec=spec.as_dict() if spec else None,
            spec_version=version,
            restarts=self._restarts,
            max_restarts=self.config.max_restarts,
            memory_restarts=self._memory_restarts,
            standby=self.standby.state(),
            checkpoint_dir=self.restore_points.url,
            tasks=tasks,
            workers_range=self.workers_range(),
            membership=self.membership(),
        )

    # The loop ----------------------------------------------------------------------

    def _loop(self) -> Verdict:
        last_write = time.monotonic()
        while True:
            self._wake.wait(POLL_S)
            self._wake.clear()
            changed = False
            for task in self.tasks.values():
                if task.exit_code is None and task.process is not None:
                    code = task.process.poll()
                    if code is not None:
                        self._record_exit(task, code)
                        changed = True
            verdict = decide(self._snapshot())
            if verdict.decision == Decision.RESPAWN:
                self._respawn(verdict)
                continue
            if verdict.decision == Decision.RESTART:
                self._restart_all(verdict)
                continue
            if verdict.decision == Decision.SHRINK:
                self._lose(verdict)
                continue
            if verdict.decision != Decision.CONTINUE:
                return verdict
            self._apply_scale()
            self._keep_standby()
            if (
                self.tasks.take_changed()
                or changed
                or time.monotonic() - last_write > STATE_EVERY_S
            ):
                self._write_state()
                last_write = time.monotonic()

    def _snapshot(self) -> ClusterStatus:
        return ClusterStatus(
            tasks=self.tasks.statuses(),
            stop_requested=self._stop_requested,
            registration_overdue=self.rendezvous.overdue(),
            heartbeat_timeout_s=self.config.heartbeat_timeout_s,
            stall_timeout_s=self.config.stall_timeout_s,
            trailing_grace_s=self.config.evaluator_grace_s,
            restarts=self._restarts,
            max_restarts=self.config.max_restarts,
            workers=len(self.tasks.workers()),
            min_workers=self._workers_min if self.config.elastic else None,
        )

    def _conclude(self, verdict: Verdict) -> int:
        self._shut_down()
        if verdict.decision == Decision.SUCCEED:
            self._finish("succeeded", 0, verdict.reason or "every tracked task exited 0")
            return 0
        if verdict.decision == Decision.STOP:
            self._finish("stopped", verdict.exit_code, "stopped on request")
            return verdict.exit_code
        self.failure = f"cluster {self.cluster.id} failed: {verdict.reason}"
        self._finish("failed", verdict.exit_code, verdict.reason)
        return verdict.exit_code

    def _shut_down(self) -> None:
        """Stops everything the cluster runs; returns once it is gone and its output read."""
        # Registrations held at the barrier would otherwise wait out the registration
        # timeout, and the interpreter joins their threads before this process exits.
        self.rendezvous.close()
        self._stop_tasks([t for t in self.tasks.values() if t.exit_code is None])
        self.standby.close()
        for store in (self._store, self._spare_store):
            if store is not None:
                store.close()
        forkserver.stop()  # no launch is left: the warm server (if this process has one)
        self._sweep()
        self.output.join()

    def _sweep(self) -> None:
        """Ends what the tasks left behind, such as a job's background processes.

        They may have outlived their supervisor's process group (a job that exited 0
        leaves its children there; a daemon starts its own session), but each carries
        the cluster id in its environment, as ``clusterflow stop`` finds them.
        """
        leftovers = cluster_processes(self.cluster.id)
        if leftovers:
            log.info(
                "ending %d process(es) left behind by the tasks: %s",
                len(leftovers),
                ", ".join(str(p.pid) for p in leftovers),
            )
            kill_processes(leftovers, self._grace_s)

    def _stop_tasks(self, tasks: list[TaskRecord]) -> None:
        """SIGTERM to each task's process group; SIGKILL to whatever is left after grace."""
        live = [t for t in tasks if t.process is not None]
        for task in live:
            task.status = "stopping"
            assert task.process is not None
            task.process.signal(signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        for task in live:
            assert task.process is not None
            code = task.process.wait(max(0.0, deadline - time.monotonic()))
            if code is None:
                task.process.signal(signal.SIGKILL)
                code = task.process.wait(5.0)
            # The supervisor is gone; a job that ignored SIGTERM may linger in its group.
            task.process.signal(signal.SIGKILL)
            if task.exit_code is None and code is not None:
                self._record_exit(task, code, stopped=True)

    def _finish(self, status: str, code: int, summary: str) -> None:
        self._status = status
        self.cluster.append_event(status, exit_code=code, summary=summary)
        self._write_state(self.state().finished(exit_code=code, summary=summary, ended=time.time()))
        self.output.close()
        self._rpc.stop()

    def _record_exit(self, task: TaskRecord, code: int, *, stopped: bool = False) -> None:
        if not self.tasks.exited(task, code, stopped=stopped):
            return
        self.cluster.append_event("task_exited", task=str(task.id), exit_code=code)
        if code != 0:
            returned = self.data.release_worker(str(task.id))
            if returned:
                self.cluster.append_event("leases_returned", task=str(task.id), leases=returned)

    # Environment -------------------------------------------------------------------

    def _task_env(self, task: TaskId) -> dict[str, str]:
        return supervisor_env(os.environ, self.config, self.place, task)

    def _incarnation(self, task: TaskId, version: int) -> Incarnation:
        state = self.tasks[task]
        return Incarnation(
            spec_version=version,
            attempt=self._attempt,
            restarts=state.restarts,
            restore=state.restore,
            store_port=self._store.port if self._store else 0,
        )

    # RPC handlers ------------------------------------------------------------------

    def _on_register(self, request: Request) -> dict[str, Any]:
        """A supervisor registers: held at the barrier, answered with what to run."""
        registration = RegisterRequest.from_wire(request.body)
        task = self.tasks.find(registration.task)
        pid, address = registration.pid, registration.address
        if task.process is not None and pid is not None and pid != task.process.pid:
            raise RegistrationError(f"{task.id}: pid {pid} is not its current supervisor")
        # relaunched alone, or added by `clusterflow scale`, while the others run
        respawned = task.status in ("restarting", "joining") and self.rendezvous.spec is not None
        if not respawned:
            self.tasks.registered(task, address, running=False)
        # One arrival at a time from register to its record: the history's version and
        # size are those of the spec this arrival published, not of a newcomer's that
        # registered meanwhile (two of one grow: 3 workers, then 4).
        with self._arrivals:
            arrival = self.rendezvous.register(task.id, address, respawned=respawned)
            if arrival == Arrival.ASSEMBLED:
                self._on_assembled()
            if respawned:
                self.tasks.registered(task, address, running=True)
                if arrival == Arrival.JOINED:
                    self._record_membership(task.id, "joined", self.rendezvous.version)
                    self._joined()
                if arrival == Arrival.MOVED:
                    self.cluster.append_event(
                        "spec_updated",
                        version=self.rendezvous.version,
                        task=str(task.id),
                        address=address,
                    )
        try:
            spec, version = self.rendezvous.wait(lambda: self._stop_requested)
        except RegistrationError as exc:
            raise RegistrationError(f"cluster {self.cluster.id}: {exc}") from None
        return RegisterReply(
            spec=spec.as_dict(),
            spec_version=version,
            env={
                **job_env(
                    self.config, self.place, spec, task.id, self._incarnation(task.id, version)
                ),
                **self.backend.job_env(task.id),
            },
            replicas=tuple(replica_env(self.config, spec, task.id)),
            command=tuple(self.config.command_for(task.id)),
        ).to_wire()

    def _on_assembled(self) -> None:
        """Every task registered: the spec is assembled, the commands run."""
        self._status = "running"
        self.tasks.all_running()
        spec, version = self.rendezvous.current()
        assert spec is not None
        self.cluster.append_event("spec_assembled", version=version, spec=spec.as_dict())
        self._restart_assembled()  # a resizing restart's joins and departures
        self._wake.set()

    def _on_heartbeat(self, request: Request) -> None:
        """A supervisor is alive; the answer itself is all it needs (the manager lives).

        It carries no spec version: a running job cannot take a new ``TF_CONFIG``, and
        what connects to workers reads the newest spec through ``manager.spec`` when a
        worker stops answering (docs/architecture.md section 3).
        """
        self.tasks.heartbeat(HeartbeatRequest.from_wire(request.body).task)

    def _on_declare(self, request: Request) -> dict[str, Any]:
        """A job says how it recovers and whether it resizes live: ``{"task",
        "respawnable": bool, "resizable": bool (optional)}``."""
        declared = DeclareRequest.from_wire(request.body)
        self.tasks.declare(
            self.tasks.find(declared.task),
            respawnable=declared.respawnable,
            resizable=declared.resizable,
        )
        # elastic: an all-reduce group then watches for newcomers and leavers
        return DeclareReply(
            max_restarts=self.config.max_restarts, elastic=self.workers_range() is not None
        ).to_wire()

    def _on_checkpoints(self, request: Request) -> dict[str, Any]:
        """The chief's checkpoints live at ``{"url"}``: restarts restore from there.

        A job may keep its checkpoints outside the cluster's folder (``fit``'s
        ``Checkpoint(directory)``). Unless the manager restores from that same place, a
        whole restart would start the ps tasks and the data cursor afresh while the
        chief reloads its own checkpoint, and records would be applied twice; and a
        respawned task would not be told which checkpoint the others continue from.
        The new place is kept in the cluster's config, so ``start --resume`` finds it.
        """
        moved = CheckpointsRequest.from_wire(request.body)
        task, url = self.tasks.find(moved.task), moved.url
        if url != self.restore_points.url:
            self.restore_points = RestorePoints(url)
            self.place = dataclasses.replace(self.place, checkpoint_url=url)
            self.cluster.append_event("checkpoints_moved", task=str(task.id), url=url)
            try:
                settings = self.cluster.read_config()
                settings["checkpoint_dir"] = url
                registry.write_json_atomic(self.cluster.config_file, settings)
            except (ClusterflowError, OSError) as exc:  # this run restores from it all the same
                log.warning("cannot keep %s for --resume in the cluster's config: %s", url, exc)
                self.output.line(f"clusterflow: --resume will not find {url}: {exc}")
            log.info("%s keeps its checkpoints at %s: restarts restore from there", task.id, url)
        return CheckpointsReply(url=url).to_wire()

    def _on_status(self, request: Request) -> dict[str, Any]:
        StatusRequest.from_wire(request.body)
        return self.state().to_dict()

    def _on_spec(self, request: Request) -> dict[str, Any]:
        SpecRequest.from_wire(request.body)
        spec, version = self.rendezvous.current()
        return SpecReply(spec=spec.as_dict() if spec else None, spec_version=version).to_wire()

    def _on_standby(self, request: Request) -> dict[str, Any]:
        """A standby waits here (bounded rounds) until a task is handed to it."""
        waiting = StandbyRequest.from_wire(request.body)
        return self.standby.wait(waiting.pid, waiting.wait_s).to_wire()

    def _on_report(self, request: Request) -> None:
        """Live figures from a job (``ReportRequest``)."""
        figures = ReportRequest.from_wire(request.body)
        self.tasks.report(self.tasks.find(figures.task), figures.figures())

    def _on_exited(self, request: Request) -> None:
        """A supervisor reports its job's exit, just before it exits with the same code.

        The loop reads the exit code from the supervisor process itself, which is still
        alive while this answer goes back to it: a waiter wakes the loop again the
        moment it has exited, so a respawn or restart does not wait for the loop's next
        look (``POLL_S``).
        """
        exited = ExitedRequest.from_wire(request.body)
        if exited.error:
            self.tasks.failed_to_run(exited.task, exited.error)
        self._wake.set()
        process = self.tasks.find(exited.task).process
        if process is not None:
            threading.Thread(
                target=self._wake_on_exit, args=(process,), name="exit-waiter", daemon=True
            ).start()

    def _wake_on_exit(self, process: TaskProcess) -> None:
        process.wait(EXIT_REPORT_WAIT_S)
        self._wake.set()

    def _on_stop(self, request: Request) -> dict[str, Any]:
        grace = StopRequest.from_wire(request.body).grace_s
        if grace is not None and grace > 0:
            self._grace_s = float(grace)
        self.cluster.append_event("stop_requested", by="rpc")
        self.request_stop()
        self._wake.set()
        return {"stopping": True}

    # State -------------------------------------------------------------------------

    def _write_state(self, state: ClusterState | None = None) -> None:
        try:
            self.cluster.write_state(state or self.state())
        except OSError as exc:
            log.warning("cannot write the state of cluster %s: %s", self.cluster.id, exc)


def _manager_server(cluster: ClusterDir, config: RunConfig, tasks: int) -> RpcServer:
    """The manager's RPC server, with the credentials its tasks use."""
    # The tasks' way, so CLUSTERFLOW_AUTH (plain or curve) means the same to both.
    credentials = Credentials.from_env(
        {**os.environ, **config.env, ENV_SECRET_FILE: str(cluster.secret_file)}
    )
    assert credentials is not None
    # Registrations wait at the barrier and a standby waits for a task, each holding a
    # handler thread: room for every task (threads start only when needed).
    return RpcServer(
        credentials,
        host=config.host,
        port=0,
        name="manager",
        workers=tasks * max(1, config.replicas_per_host) + 16,
        tensors=False,
    )
