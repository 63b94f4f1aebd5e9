"""The manager's controller loop: launch, assemble the spec, watch, decide, act.

Registration is a barrier: each supervisor's ``manager.register`` call is held (on a
blocking handler) until every task has registered, and is then answered with the
assembled cluster spec, so every task starts its job with the same spec version.

The loop polls the tasks, builds a frozen ``ClusterStatus`` and asks ``policy.decide``
what to do; all side effects (signals, state files, output) happen here.

When the run ends (success, failure or a stop request) the controller, in this order:
releases registrations still held at the barrier, stops the tasks that still run
(SIGTERM to each process group, SIGKILL after the grace period), stops the torch store,
ends whatever the tasks left behind (found by the cluster id in their environment),
waits for their output, and only then records the final status, so whoever sees a
final status in ``state.json`` also sees every line in the logs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from clusterflow.backends.api import Backend, TaskLaunch, TaskProcess
from clusterflow.checkpoint import CheckpointStorage
from clusterflow.checkpoint.names import DATA_PART
from clusterflow.cluster import ClusterSpec, TaskId, TFConfig
from clusterflow.cluster.contract import (
    ENV_ATTEMPT,
    ENV_BIND_HOST,
    ENV_CHECKPOINT_DIR,
    ENV_CLUSTER_ID,
    ENV_HEARTBEAT_S,
    ENV_JOB,
    ENV_MANAGER,
    ENV_REGISTER_TIMEOUT,
    ENV_REPLICA,
    ENV_RESTORE,
    ENV_SECRET_FILE,
    ENV_SPEC_VERSION,
    ENV_STANDBY,
    ENV_STATE_DIR,
    ENV_TASK,
    ENV_TASK_INDEX,
    ManagerMethod,
)
from clusterflow.data.dispatcher import DispatcherService
from clusterflow.errors import ClusterflowError
from clusterflow.manager.config import REPLICA_JOBS, RunConfig
from clusterflow.manager.output import Label, OutputRouter
from clusterflow.manager.policy import ClusterStatus, Decision, TaskStatus, Verdict, decide
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.stopper import cluster_processes, kill_processes
from clusterflow.manager.store_host import StoreHost
from clusterflow.rpc import Credentials, Request, RpcServer

log = logging.getLogger(__name__)

POLL_S = 0.1
"""Longest the loop waits between looks at the tasks (an exit also wakes it at once)."""


class RegistrationError(ClusterflowError):
    """A supervisor's registration was refused (unknown task, cluster stopping)."""


@dataclass(slots=True)
class _Task:
    id: TaskId
    tracked: bool
    process: TaskProcess | None = None
    address: str | None = None
    exit_code: int | None = None
    last_heartbeat: float | None = None
    """When the supervisor last reported; set once its command is released to run."""
    status: str = "starting"
    error: str | None = None
    """Why the supervisor could not run the command (from ``manager.exited``)."""
    respawnable: bool = False
    """Its job declared it can be relaunched alone (``manager.declare``)."""
    restarts: int = 0
    """Times this task was relaunched (alone or with every task)."""
    restore: str | None = None
    """The checkpoint its job restores from, chosen when it was launched."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Live figures its job reported (``task.report``): step, loss, samples/s."""
    step_changed: float | None = None
    """When the reported step last advanced (stall detection)."""


@dataclass(slots=True)
class _Standby:
    """A warm supervisor waiting to replace a respawnable task (see backends/supervisor)."""

    process: TaskProcess
    label: Label | None
    waiting: bool = False
    """Its ``manager.standby`` call is held here: it can take a task at once."""
    task: str | None = None
    """The task it was given; None while it waits."""


class Controller:
    """Runs one cluster from launch to exit.

    Args:
        cluster: the cluster's folder (its config and secret are already written).
        config: what to run.
        backend: where tasks run.
        echo: also write task output to this process's stdout (foreground ``start``).
    """

    def __init__(
        self, cluster: ClusterDir, config: RunConfig, backend: Backend, *, echo: bool
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.backend = backend
        # The tasks' way, so CLUSTERFLOW_AUTH (plain or curve) means the same to both.
        credentials = Credentials.from_env(
            {**os.environ, **config.env, ENV_SECRET_FILE: str(cluster.secret_file)}
        )
        assert credentials is not None
        self.credentials = credentials
        self.output = OutputRouter(cluster.output_file, echo=echo)
        self.tasks = {t: _Task(t, config.is_tracked(t)) for t in config.tasks()}
        self._lock = threading.Condition()
        self._wake = threading.Event()
        self._stop_requested = False
        self._closing = False
        self._dirty = False
        self.failure: str | None = None
        """Why the run failed, in one line, once ``run`` returned; None unless it failed."""
        self._grace_s = config.grace_s
        self._spec: ClusterSpec | None = None
        self._spec_version = 0
        self._status = "starting"
        self._started = time.monotonic()
        self._created = time.time()
        self._store: StoreHost | None = None
        self._restarts = 0
        self._attempt = 0
        self._standby: _Standby | None = None
        self._verified_step: int | None = None
        """The newest checkpoint whose parts were all read and matched their checksums."""
        self._handed: dict[int, str] = {}
        """Standby supervisors (by pid) given a task before they asked for one."""
        self.checkpoint_url = config.checkpoint_dir or str(cluster.path / "checkpoints")
        # Registrations wait at the barrier and a standby waits for a task, each holding
        # a handler thread: room for every task (threads start only when needed).
        self._rpc = RpcServer(
            self.credentials,
            host=config.host,
            port=0,
            name="manager",
            workers=len(self.tasks) * max(1, config.replicas_per_host) + 16,
        )
        self._rpc.register(ManagerMethod.REGISTER, self._on_register, blocking=True)
        self._rpc.register(ManagerMethod.HEARTBEAT, self._on_heartbeat)
        self._rpc.register(ManagerMethod.EXITED, self._on_exited)
        self._rpc.register(ManagerMethod.STOP, self._on_stop)
        self._rpc.register(ManagerMethod.STATUS, lambda request: self._state())
        self._rpc.register(ManagerMethod.DECLARE, self._on_declare)
        self._rpc.register(ManagerMethod.STANDBY, self._on_standby, blocking=True)
        self._rpc.register(ManagerMethod.SPEC, self._on_spec)
        self._rpc.register(ManagerMethod.REPORT, self._on_report)
        # The data service lives here for clusters started by `clusterflow start`: every
        # task reaches it at CLUSTERFLOW_MANAGER, and the manager learns of deaths first.
        self.data = DispatcherService().register_on(self._rpc)

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
            self._store = StoreHost(
                {**os.environ, ENV_CLUSTER_ID: self.cluster.id}, self.config.host
            )
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
            if verdict.decision != Decision.CONTINUE:
                return verdict
            self._keep_standby()
            with self._lock:
                changed, self._dirty = changed or self._dirty, False
            if changed or time.monotonic() - last_write > 2.0:
                self._write_state()
                last_write = time.monotonic()

    def _snapshot(self) -> ClusterStatus:
        now = time.monotonic()
        with self._lock:
            registered = all(t.address for t in self.tasks.values())
            tasks = tuple(
                TaskStatus(
                    task=str(t.id),
                    tracked=t.tracked,
                    exit_code=t.exit_code,
                    heartbeat_age_s=None if t.last_heartbeat is None else now - t.last_heartbeat,
                    error=t.error,
                    respawnable=t.respawnable,
                    step_age_s=None if t.step_changed is None else now - t.step_changed,
                )
                for t in self.tasks.values()
            )
        return ClusterStatus(
            tasks=tasks,
            stop_requested=self._stop_requested,
            registration_overdue=(
                not registered and now - self._started > self.config.register_timeout_s
            ),
            heartbeat_timeout_s=self.config.heartbeat_timeout_s,
            stall_timeout_s=self.config.stall_timeout_s,
            restarts=self._restarts,
            max_restarts=self.config.max_restarts,
        )

    def _conclude(self, verdict: Verdict) -> int:
        self._shut_down()
        if verdict.decision == Decision.SUCCEED:
            self._finish("succeeded", 0, "every tracked task exited 0")
            return 0
        if verdict.decision == Decision.STOP:
            self._finish("stopped", verdict.exit_code, "stopped on request")
            return verdict.exit_code
        self.failure = f"cluster {self.cluster.id} failed: {verdict.reason}"
        self._finish("failed", verdict.exit_code, verdict.reason)
        return verdict.exit_code

    def _shut_down(self) -> None:
        """Stops everything the cluster runs; returns once it is gone and its output read."""
        with self._lock:
            # Registrations held at the barrier would otherwise wait out the registration
            # timeout, and the interpreter joins their threads before this process exits.
            self._closing = True
            self._lock.notify_all()
        self._stop_tasks([t for t in self.tasks.values() if t.exit_code is None])
        standby, self._standby = self._standby, None
        if standby is not None:  # idle: nothing to lose
            standby.process.signal(signal.SIGKILL)
            standby.process.wait(5.0)
        if self._store is not None:
            self._store.close()
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

    def _stop_tasks(self, tasks: list[_Task]) -> None:
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

    # Recovery ----------------------------------------------------------------------

    def _launch(self, task: _Task, restore: str | None) -> None:
        """Starts ``task``'s supervisor (again), following its output into its log."""
        task.restore = restore
        if self._hand_to_standby(task):
            return
        task.process = self.backend.launch(TaskLaunch(task=task.id, env=self._task_env(task.id)))
        if task.process.output is not None:
            self.output.follow(
                str(task.id), task.process.output, self.cluster.task_log(str(task.id))
            )

    def _keep_standby(self) -> None:
        """Keeps one warm standby supervisor while a respawn may still be needed.

        Only once a job declared a task respawnable (so runs that restart everything
        pay nothing) and only while restarts remain. It is started while training runs:
        its torch import then costs the running tasks CPU once, instead of costing the
        replacement its start-up at every respawn.
        """
        standby = self._standby
        if standby is not None:
            if standby.process.poll() is None:
                return
            self._standby = None  # it died (killed by a user?): make another
        if self._spec is None or self._restarts >= self.config.max_restarts:
            return
        first = next((t for t in self.tasks.values() if t.respawnable), None)
        if first is None:
            return
        env = {**self._task_env(first.id), ENV_STANDBY: "1"}
        process = self.backend.launch(TaskLaunch(task=first.id, env=env))
        label = None
        if process.output is not None:
            label = self.output.follow("standby", process.output, self.cluster.task_log("standby"))
        self._standby = _Standby(process, label)
        log.info("standby supervisor started (pid %d)", process.pid)

    def _hand_to_standby(self, task: _Task) -> bool:
        """Gives ``task`` to the waiting standby, if there is one; whether it took it."""
        with self._lock:
            standby = self._standby
            if standby is None or standby.process.poll() is not None or not task.respawnable:
                return False
            # Even a standby still warming up beats a cold start: it has a head start.
            standby.task = str(task.id)
            standby.waiting = False
            self._standby = None
            self._handed[standby.process.pid] = standby.task
            task.process = standby.process
            self._lock.notify_all()
        if standby.label is not None:
            standby.label.rename(str(task.id), self.cluster.task_log(str(task.id)))
        self.cluster.append_event("standby_took_over", task=str(task.id), pid=standby.process.pid)
        return True

    def _on_standby(self, request: Request) -> dict[str, Any]:
        """A standby waits here (bounded rounds) until a task is handed to it."""
        body = request.body or {}
        wait_s = float(body.get("wait_s") or 20.0)
        deadline = time.monotonic() + min(max(wait_s, 0.1), 60.0)
        with self._lock:
            handed = self._handed.pop(body.get("pid"), None)  # type: ignore[arg-type]
            if handed is not None:
                return {"task": handed}  # given a task while it was still warming up
            standby = self._standby
            if standby is None or standby.process.pid != body.get("pid"):
                return {"exit": True}  # not (or no longer) the standby this manager keeps
            if not standby.waiting:
                standby.waiting = True
                self._dirty = True
            while standby.task is None and not (self._closing or self._stop_requested):
                if not self._lock.wait(max(0.0, deadline - time.monotonic())):
                    break
            if standby.task is not None:
                self._handed.pop(standby.process.pid, None)
                return {"task": standby.task}
            if self._closing or self._stop_requested:
                return {"exit": True}
            return {"task": None}

    def _kill(self, tasks: list[_Task]) -> None:
        """SIGKILL at once: every committed checkpoint is a consistent cut, so nothing is
        gained by waiting for a task being replaced (and a hung one would not listen)."""
        for task in tasks:
            if task.process is not None and task.exit_code is None:
                task.process.signal(signal.SIGKILL)
        for task in tasks:
            if task.process is not None and task.exit_code is None:
                code = task.process.wait(10.0)
                self._record_exit(task, -signal.SIGKILL if code is None else code, stopped=True)

    def _reset(self, task: _Task) -> None:
        with self._lock:
            task.exit_code = None
            task.error = None
            task.last_heartbeat = None
            task.step_changed = None
            task.figures = {}
            task.status = "restarting"
            task.restarts += 1
            self._dirty = True

    def _respawn(self, verdict: Verdict) -> None:
        """Relaunches the dead task alone; it rejoins at the next spec version."""
        task = self.tasks[TaskId.parse(str(verdict.failed_task))]
        self._restarts += 1
        self._kill([task])  # it may be hung rather than gone
        self.data.release_worker(str(task.id))
        log.info("%s; respawning it (restart %d)", verdict.reason, self._restarts)
        self.output.line(f"clusterflow: {verdict.reason}; respawning it")
        self.cluster.append_event(
            "task_respawned", task=str(task.id), reason=verdict.reason, restarts=self._restarts
        )
        self._reset(task)
        self._launch(task, self._choose_checkpoint(restore_data=False))
        self._write_state()

    def _restart_all(self, verdict: Verdict) -> None:
        """Stops every task and relaunches them all from the last committed checkpoint."""
        self._restarts += 1
        self._attempt += 1
        live = [t for t in self.tasks.values() if t.exit_code is None]
        self._kill(live)
        log.info("%s; restarting every task (restart %d)", verdict.reason, self._restarts)
        self.output.line(f"clusterflow: {verdict.reason}; restarting every task")
        with self._lock:
            # A new barrier: the restarted supervisors register anew (new addresses).
            self._spec = None
            self._status = "restarting"
            for task in self.tasks.values():
                task.address = None
        if self._store is not None:
            # A fresh store: the old one holds the dead incarnation's rendezvous keys.
            self._store.close()
            self._store = StoreHost(
                {**os.environ, ENV_CLUSTER_ID: self.cluster.id}, self.config.host
            )
        restore = self._choose_checkpoint(restore_data=True)
        self.cluster.append_event(
            "cluster_restarted",
            task=verdict.failed_task,
            reason=verdict.reason,
            restarts=self._restarts,
            checkpoint=restore,
        )
        self._started = time.monotonic()  # the registration timeout counts afresh
        for task in self.tasks.values():
            self._reset(task)
            self._launch(task, restore)
        self._write_state()

    def _choose_checkpoint(self, *, restore_data: bool) -> str | None:
        """The newest intact committed checkpoint (every task restores this one).

        With ``restore_data`` the data service's cursor is reset to the checkpoint's
        (or to nothing, without one), so the data position and the parameters come from
        the same cut.
        """
        manifest, cursor = None, None
        try:
            storage = CheckpointStorage(self.checkpoint_url)
            # Verifying reads every byte: do it once per checkpoint, not per respawn.
            manifest = storage.latest(verify=False)
            if manifest is not None and manifest.step != self._verified_step:
                manifest = storage.latest(verify=True)
                self._verified_step = None if manifest is None else manifest.step
            if restore_data and manifest is not None and DATA_PART in manifest.parts:
                cursor = storage.read_json(manifest, DATA_PART)
        except (ClusterflowError, OSError) as exc:
            # Restarting without a checkpoint beats not restarting: the run then starts
            # over, which is also what the tasks would find.
            log.warning("cannot read checkpoints at %s: %s", self.checkpoint_url, exc)
            self.output.line(f"clusterflow: cannot read checkpoints: {exc}")
            manifest, cursor = None, None
        if restore_data:
            self.data.reset(cursor)
        if manifest is None:
            return None
        log.info("tasks restore checkpoint %s (step %d)", manifest.directory, manifest.step)
        return str(manifest.step)

    def _finish(self, status: str, code: int, summary: str) -> None:
        self._status = status
        self.cluster.append_event(status, exit_code=code, summary=summary)
        self._write_state(exit_code=code, summary=summary, ended=time.time())
        self.output.close()
        self._rpc.stop()

    def _record_exit(self, task: _Task, code: int, *, stopped: bool = False) -> None:
        with self._lock:
            if task.exit_code is not None:
                return
            task.exit_code = code
            task.status = "stopped" if stopped else ("succeeded" if code == 0 else "failed")
        self.cluster.append_event("task_exited", task=str(task.id), exit_code=code)
        if code != 0:
            returned = self.data.release_worker(str(task.id))
            if returned:
                self.cluster.append_event("leases_returned", task=str(task.id), leases=returned)

    # Environment -------------------------------------------------------------------

    def _task_env(self, task: TaskId) -> dict[str, str]:
        """The supervisor's environment: how to find the manager and prove membership."""
        env = dict(os.environ)
        env.update(self.config.env)
        env.update(
            {
                ENV_MANAGER: self._rpc.address,
                ENV_SECRET_FILE: str(self.cluster.secret_file),
                ENV_TASK: str(task),
                ENV_CLUSTER_ID: self.cluster.id,
                ENV_BIND_HOST: self.config.host,
                ENV_HEARTBEAT_S: str(self.config.heartbeat_s),
                ENV_REGISTER_TIMEOUT: str(self.config.register_timeout_s),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def _job_env(self, task: TaskId, spec: ClusterSpec) -> dict[str, str]:
        """What the job command sees: TF_CONFIG, torchrun's variables, CLUSTERFLOW_*."""
        restore = self.tasks[task].restore
        env = {
            "TF_CONFIG": TFConfig(spec, task).to_json(),
            ENV_JOB: task.job,
            ENV_TASK_INDEX: str(task.index),
            ENV_SPEC_VERSION: str(self._spec_version),
            ENV_STATE_DIR: str(self.cluster.path),
            ENV_CHECKPOINT_DIR: self.checkpoint_url,
            ENV_ATTEMPT: str(self._attempt),
            # A TensorFlow gRPC server may then bind beside the reserved socket.
            "TF_GRPC_REUSE_PORT": "1",
        }
        if restore is not None:
            env[ENV_RESTORE] = restore
        ranks = [t for t in self.config.tasks() if t.job in REPLICA_JOBS]
        if task in ranks:
            rank, world = ranks.index(task), len(ranks)
            env.update(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    # One host: every rank of a local cluster is local, unless each task
                    # stands for a host of its own (--replicas-per-host, replica_env).
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world),
                    "GROUP_RANK": "0",
                    "GROUP_WORLD_SIZE": "1",
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world),
                    "MASTER_ADDR": self.config.host,
                    "MASTER_PORT": str(self._store.port if self._store else 0),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCHELASTIC_RESTART_COUNT": str(self.tasks[task].restarts),
                    "TORCHELASTIC_MAX_RESTARTS": str(self.config.max_restarts),
                }
            )
        return env

    def _replica_env(self, task: TaskId) -> list[dict[str, str]]:
        """Per-process overrides when ``task`` runs several replicas; [] when it runs one.

        The task stands for a host with ``n`` devices, as a torchrun node with
        ``--nproc-per-node n``: its processes hold the contiguous ranks ``i*n .. i*n+n-1``
        (``i``: the task's position among chief and workers), ``LOCAL_RANK`` picks the
        device, and ``GROUP_RANK`` is the task's position. All share the task's TF_CONFIG.
        """
        n = self.config.replicas_of(task)
        if n == 1:
            return []
        ranks = [t for t in self.config.tasks() if t.job in REPLICA_JOBS]
        position, hosts = ranks.index(task), len(ranks)
        world = hosts * n
        out = []
        for replica in range(n):
            rank = position * n + replica
            out.append(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(replica),
                    "LOCAL_WORLD_SIZE": str(n),
                    "GROUP_RANK": str(position),
                    "GROUP_WORLD_SIZE": str(hosts),
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world),
                    ENV_REPLICA: str(replica),
                }
            )
        return out

    # RPC handlers ------------------------------------------------------------------

    def _on_register(self, request: Request) -> dict[str, Any]:
        body = request.body or {}
        try:
            task_id = TaskId.parse(str(body.get("task")))
        except ClusterflowError as exc:
            raise RegistrationError(f"bad registration {body!r}: {exc}") from exc
        with self._lock:
            deadline = self._started + self.config.register_timeout_s
            task = self.tasks.get(task_id)
            if task is None:
                raise RegistrationError(f"task {task_id} is not part of cluster {self.cluster.id}")
            pid = body.get("pid")
            if task.process is not None and isinstance(pid, int) and pid != task.process.pid:
                raise RegistrationError(f"{task_id}: pid {pid} is not its current supervisor")
            address = str(body.get("address"))
            if self._spec is None:
                task.address = address
                task.status = "registered"
                self._dirty = True
                if all(t.address for t in self.tasks.values()):
                    self._assemble_spec()
            elif task.status == "restarting":
                self._rejoin(task, address)
            while self._spec is None and not (self._stop_requested or self._closing):
                if not self._lock.wait(max(0.0, deadline - time.monotonic())):
                    raise RegistrationError("not every task registered in time")
            if self._spec is None or self._closing:
                raise RegistrationError(f"cluster {self.cluster.id} is stopping")
            return {
                "spec": self._spec.as_dict(),
                "spec_version": self._spec_version,
                "env": self._job_env(task_id, self._spec),
                "replicas": self._replica_env(task_id),
                "command": list(self.config.command_for(task_id)),
            }

    def _rejoin(self, task: _Task, address: str) -> None:
        """A respawned task registers while the others run: called with the lock held.

        Its new address makes a new spec version, which the others learn from
        ``manager.spec`` (their heartbeats carry the version number).
        """
        task.status = "running"
        task.last_heartbeat = time.monotonic()
        self._dirty = True
        if address == task.address:
            return
        task.address = address
        assert self._spec is not None
        jobs: dict[str, dict[int, str]] = {
            job: {i: self._spec.task_address(job, i) for i in self._spec.task_indices(job)}
            for job in self._spec.jobs
        }
        jobs[task.id.job][task.id.index] = address
        self._spec = ClusterSpec(jobs)
        self._spec_version += 1
        self.cluster.append_event(
            "spec_updated", version=self._spec_version, task=str(task.id), address=address
        )

    def _assemble_spec(self) -> None:
        """Called with the lock held, once every task has registered."""
        jobs: dict[str, list[str]] = {}
        for task in self.tasks.values():
            assert task.address is not None
            jobs.setdefault(task.id.job, []).append(task.address)
        self._spec = ClusterSpec(jobs)
        self._spec_version += 1
        self._status = "running"
        now = time.monotonic()
        for task in self.tasks.values():
            # Heartbeats start with the command; waiting at the barrier is bounded by
            # the registration timeout instead.
            task.status = "running"
            task.last_heartbeat = now
        self._dirty = True
        self._lock.notify_all()
        self.cluster.append_event(
            "spec_assembled", version=self._spec_version, spec=self._spec.as_dict()
        )
        self._wake.set()

    def _on_heartbeat(self, request: Request) -> dict[str, Any]:
        body = request.body or {}
        with contextlib.suppress(ClusterflowError):
            task = self.tasks.get(TaskId.parse(str(body.get("task"))))
            if task is not None:
                task.last_heartbeat = time.monotonic()
        return {"stop": self._stop_requested, "spec_version": self._spec_version}

    def _on_declare(self, request: Request) -> dict[str, Any]:
        """A job says how it recovers: ``{"task", "respawnable": bool}``."""
        body = request.body or {}
        task = self._task_of(body)
        with self._lock:
            task.respawnable = bool(body.get("respawnable"))
            self._dirty = True
        return {"max_restarts": self.config.max_restarts}

    def _on_spec(self, request: Request) -> dict[str, Any]:
        with self._lock:
            spec = self._spec.as_dict() if self._spec else None
            return {"spec": spec, "spec_version": self._spec_version}

    def _on_report(self, request: Request) -> None:
        """Live figures from a job: ``{"task", "step", "loss", "samples_per_s"}``."""
        body = request.body or {}
        task = self._task_of(body)
        figures = {
            k: body[k]
            for k in ("step", "loss", "samples_per_s")
            if isinstance(body.get(k), int | float) and not isinstance(body.get(k), bool)
        }
        with self._lock:
            step = figures.get("step")
            if step is not None and step != task.figures.get("step"):
                task.step_changed = time.monotonic()
            task.figures.update(figures)
            self._dirty = True

    def _task_of(self, body: dict[str, Any]) -> _Task:
        try:
            task = self.tasks.get(TaskId.parse(str(body.get("task"))))
        except ClusterflowError as exc:
            raise RegistrationError(f"bad task in {body!r}: {exc}") from exc
        if task is None:
            raise RegistrationError(f"task {body.get('task')!r} is not part of this cluster")
        return task

    def _on_exited(self, request: Request) -> None:
        body = request.body or {}
        error = body.get("error")
        if isinstance(error, str) and error:
            with contextlib.suppress(ClusterflowError):
                task = self.tasks.get(TaskId.parse(str(body.get("task"))))
                if task is not None:
                    with self._lock:
                        task.error = error[:500]
        self._wake.set()  # the loop reads the exit code from the process itself

    def _on_stop(self, request: Request) -> dict[str, Any]:
        grace = (request.body or {}).get("grace_s")
        if isinstance(grace, int | float) and grace > 0:
            self._grace_s = float(grace)
        self.cluster.append_event("stop_requested", by="rpc")
        self.request_stop()
        self._wake.set()
        return {"stopping": True}

    # State -------------------------------------------------------------------------

    def _state(self, **extra: Any) -> dict[str, Any]:
        me = psutil.Process()
        with self._lock:
            tasks = [
                {
                    "task": str(t.id),
                    "tracked": t.tracked,
                    "status": t.status,
                    "address": t.address,
                    "pid": t.process.pid if t.process else None,
                    "exit_code": t.exit_code,
                    "restarts": t.restarts,
                    **t.figures,
                }
                for t in self.tasks.values()
            ]
        state: dict[str, Any] = {
            "id": self.cluster.id,
            "status": self._status,
            "created": self._created,
            "backend": self.backend.name,
            "command": list(self.config.command),
            "manager": {
                "pid": me.pid,
                "create_time": me.create_time(),
                "address": self._rpc.address,
            },
            "spec": self._spec.as_dict() if self._spec else None,
            "spec_version": self._spec_version,
            "restarts": self._restarts,
            "max_restarts": self.config.max_restarts,
            "standby": (
                {"pid": self._standby.process.pid, "ready": self._standby.waiting}
                if self._standby is not None
                else None
            ),
            "checkpoint_dir": self.checkpoint_url,
            "tasks": tasks,
        }
        state.update(extra)
        return state

    def _write_state(self, **extra: Any) -> None:
        try:
            self.cluster.write_state(self._state(**extra))
        except OSError as exc:
            log.warning("cannot write the state of cluster %s: %s", self.cluster.id, exc)
