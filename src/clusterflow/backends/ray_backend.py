"""The Ray backend: each task's supervisor runs under a Ray actor on the node Ray chose.

The actor (``SupervisorHost``) holds the task's resources (a bundle of the cluster's
placement group, see ``ray_placement``) and starts the same supervisor the local
backend starts (``python -m clusterflow.backends.supervisor``) as its child, so the
manager's contract is unchanged: registration, heartbeats and exit go over clusterflow's
RPC; the actor only carries what a local process gives for free: the output stream, the
exit code and signals. Ray's own calls carry them, each with a deadline.

On the node, the supervisor:

* binds the node's own address (``CLUSTERFLOW_BIND_HOST`` is the node's IP), so the
  spec, ``TF_CONFIG`` and ``MASTER_ADDR`` hold addresses every node reaches;
* reads the cluster secret from a file the actor wrote (mode 0600, in a private
  temporary folder, removed when the task ends): the secret travels inside the actor's
  creation call, never in an environment variable, the job folder or Ray's logs;
* sees ``CUDA_VISIBLE_DEVICES`` as Ray set it for the actor (the GPUs Ray assigned).

The manager is the actors' owner: if it dies, Ray ends them, and their supervisors stop
their jobs once the manager stops answering (``CLUSTERFLOW_MANAGER_TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import IO, Any, Final

from clusterflow.backends.api import TaskLaunch
from clusterflow.backends.memory_watch import MemoryWatch, tree_rss, within_run
from clusterflow.backends.ray_placement import TaskRequest
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import (
    CUDA_VISIBLE_DEVICES,
    ENV_BIND_HOST,
    ENV_NODE,
    ENV_SECRET_FILE,
    ENV_STANDBY,
    GLOO_IFNAME,
)
from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

SUPERVISOR_MODULE = "clusterflow.backends.supervisor"
NODE_LOCAL = frozenset(
    {ENV_SECRET_FILE, ENV_BIND_HOST, ENV_NODE, CUDA_VISIBLE_DEVICES, GLOO_IFNAME}
)
"""Variables each node sets for itself; the manager's values mean nothing there."""
READ_WAIT_S = 1.0
"""How long one output read waits on the node for something to send."""
CALL_DEADLINE_S = 30.0
"""The deadline of one call to a supervisor's actor (the read's wait included)."""
EXIT_DRAIN_S = 2.0
"""After the supervisor exits, how long its last output may take to reach the pipe."""
NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its own id (``ray.util.placement_group``)."""
SAMPLE_S = 0.2
"""How often a task's memory (its whole process tree) is measured."""


class SupervisorHost:
    """The actor under which one task's supervisor runs (a Ray actor, see ``_actor_class``).

    Threaded (``max_concurrency``), so a ``signal`` is served while a ``read`` waits.
    """

    def __init__(
        self, task: str, env: Mapping[str, str], secret: str, memory_limit: float | None = None
    ) -> None:
        import ray

        self.task = task
        # mkdtemp makes the folder 0700: only this user's processes can list it.
        self._dir = tempfile.mkdtemp(prefix="clusterflow-task-")
        secret_file = os.path.join(self._dir, "secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        full = {**os.environ, **env, ENV_SECRET_FILE: secret_file, ENV_BIND_HOST: self.node_ip}
        full[ENV_NODE] = self.node_id  # how cache:// tells this node's partitions (cache/)
        iface = interface_of(self.node_ip)
        if iface and GLOO_IFNAME not in env:
            full[GLOO_IFNAME] = iface  # gloo's peers on other nodes reach it there
        self._popen = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE],
            env=full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._buffer = bytearray()
        self._eof = False
        self._cond = threading.Condition()
        self._memory = MemoryWatch(memory_limit)
        threading.Thread(target=self._read_pipe, name="output", daemon=True).start()
        threading.Thread(target=self._measure, name="memory", daemon=True).start()

    def _measure(self) -> None:
        """Samples the tree's memory; kills the tree once it outgrows the task's request
        (``memory_watch``: enforced here, since Ray only places by it)."""
        import psutil

        try:
            root = psutil.Process(self._popen.pid)
        except psutil.Error:
            return
        while self._popen.poll() is None:
            total = tree_rss(root)
            if self._memory.sample(total):
                log.warning(
                    "%s uses %d bytes, over its %d: killed", self.task, total, self._memory.limit
                )
                self.signal(signal.SIGKILL)
            time.sleep(SAMPLE_S)

    def _read_pipe(self) -> None:
        assert self._popen.stdout is not None
        fd = self._popen.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            with self._cond:
                if chunk:
                    self._buffer += chunk
                else:
                    self._eof = True
                self._cond.notify_all()
            if not chunk:
                return

    def info(self) -> dict[str, Any]:
        """Where the supervisor runs and what Ray gave it."""
        import ray

        context = ray.get_runtime_context()
        return {
            "pid": self._popen.pid,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "resources": dict(context.get_assigned_resources()),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def read(self, wait_s: float) -> dict[str, Any]:
        """Output since the last read (``data``, waiting up to ``wait_s`` for some), the
        exit ``code`` once the supervisor ended and its output was all sent, the
        ``memory_peak`` so far and whether it was killed for memory (``oom``)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._buffer) or self._eof, wait_s)
            if not self._buffer and self._popen.poll() is not None:
                # Its job's children may hold the pipe open: wait for EOF only briefly.
                self._cond.wait_for(lambda: self._eof, EXIT_DRAIN_S)
            data = bytes(self._buffer)
            self._buffer.clear()
        code = self._popen.poll() if not data else None
        if code is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        oom = self._memory.killed_for_memory(code)
        return {"data": data, "code": code, "memory_peak": self._memory.peak, "oom": oom}

    def signal(self, signum: int) -> None:
        """``signum`` to the supervisor's process group (it, the job and its children)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signum)

    def hold_to(self, limit: float | None) -> None:
        """From now on, the tree is killed once over ``limit`` (a standby that took a task
        over is held to that task's request)."""
        self._memory.limit = limit


@functools.cache
def _actor_class() -> Any:
    """``SupervisorHost`` as a Ray actor class, made on first use (Ray is optional)."""
    import ray

    return ray.remote(max_concurrency=4, max_restarts=0)(SupervisorHost)


class RayProcess:
    """The manager's view of one supervisor actor (``TaskProcess``).

    A thread pulls the actor's output into a local pipe (``output``, read by the
    manager's output router) and records the exit code. An actor that dies (its node
    died, or it was killed) counts as a task killed with SIGKILL.
    """

    def __init__(self, task: TaskId, actor: Any, request: TaskRequest) -> None:
        self._task = task
        self._actor = actor
        self._request = request
        read_end, self._write_fd = os.pipe()
        self._output = os.fdopen(read_end, "rb")
        self._code: int | None = None
        self._info: dict[str, Any] | None = None
        self.memory_peak = 0
        """The task's measured peak memory (bytes, its whole process tree)."""
        self.oom = False
        """It was killed for memory: over its request (by its actor), by Ray's OOM
        killer, or by the kernel's (a cgroup limit)."""
        self._growable = False
        self._placed = threading.Event()
        self._done = threading.Event()
        threading.Thread(target=self._pump, name=f"ray-{task}", daemon=True).start()

    @property
    def task(self) -> TaskId:
        return self._task

    @property
    def pid(self) -> int:
        """The supervisor's pid on its node; 0 while the actor is not placed yet."""
        self._placed.wait(2.0)
        return int(self._info["pid"]) if self._info else 0

    @property
    def output(self) -> IO[bytes] | None:
        return self._output

    def hold_to(self, request: TaskRequest) -> None:
        """The task runs under ``request`` now: its actor enforces its memory (a standby
        that took a task over; the call is not awaited, it only sets a number)."""
        self._request = request
        with contextlib.suppress(Exception):
            self._actor.hold_to.remote(request.bundle().get("memory"))

    @property
    def memory_asked(self) -> float:
        """The memory it was held to (bytes; 0: none)."""
        return float(self._request.bundle().get("memory") or 0.0)

    @property
    def memory_kill(self) -> bool:
        """Killed for memory, and its job's request is below the largest node's memory
        (so a relaunch can ask for more); known once it ended."""
        return self._done.is_set() and self.oom and self._growable

    @property
    def placement(self) -> dict[str, Any] | None:
        """Node id, node IP, the resources Ray assigned, GPU ids, and memory requested and
        measured; None until placed."""
        if not self._info:
            return None
        return {
            **self._info,
            "memory_requested": self._request.bundle().get("memory"),
            "memory_peak": self.memory_peak,
        }

    def poll(self) -> int | None:
        return self._code

    def wait(self, timeout: float) -> int | None:
        self._done.wait(timeout)
        return self._code

    def signal(self, signum: int) -> None:
        if self._done.is_set():
            return
        import ray

        # Awaited, so a SIGKILL has landed before the caller waits for the exit.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self._actor.signal.remote(signum), timeout=CALL_DEADLINE_S)

    def end(self) -> None:
        """Ends the actor (and with it the supervisor's hold on its resources)."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)

    def _pump(self) -> None:
        import ray

        code = -signal.SIGKILL
        try:
            # No deadline on placement itself: after a node died, Ray places the bundle
            # again when a node is free, and the manager's registration timeout bounds it.
            self._info = ray.get(self._actor.info.remote())
            self._placed.set()
            while True:
                try:
                    got = ray.get(self._actor.read.remote(READ_WAIT_S), timeout=CALL_DEADLINE_S)
                except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                    continue  # a node briefly unreachable; Ray says when it is dead
                self.memory_peak = max(self.memory_peak, int(got["memory_peak"]))
                self.oom = bool(got["oom"])
                if got["data"]:
                    _write_all(self._write_fd, got["data"])
                if got["code"] is not None:
                    code = got["code"]
                    break
        except ray.exceptions.RayError as exc:
            if _ray_oom(exc):
                self.oom = True
                log.warning("%s: killed by Ray's OOM killer (%s)", self._task, exc)
            else:
                log.warning("%s: its actor is gone (%s); counted as killed", self._task, exc)
        finally:
            self._placed.set()
            with contextlib.suppress(OSError):
                os.close(self._write_fd)
            self.end()  # frees the task's bundle at once, for its replacement
            if self.oom:
                asked = self._request.bundle().get("memory") or 0.0
                with contextlib.suppress(Exception):
                    self._growable = asked < _largest_node_memory()
            self._code = code
            self._done.set()


_RAY_OOM_MARKERS: Final = ("low on memory", "Memory on the node")
"""What Ray's raylet (2.60) writes into the death message of a worker its memory monitor
killed: "N worker(s) were killed due to the node running low on memory" and "Memory on
the node (IP: ..., ID: ...) was ...GB used / ...GB limit"."""


def _ray_oom(exc: BaseException) -> bool:
    """Whether Ray's error says its memory monitor killed the actor's worker.

    The type is the signal where Ray gives one: ``OutOfMemoryError`` (a task the
    monitor killed). An actor's worker killed for memory reaches ``ray.get`` as a plain
    ``ActorDiedError`` instead, and that one keeps no structured cause: Ray builds its
    message from the death context (``ActorDiedErrorContext``, whose ``reason`` enum has
    no memory value; the raylet puts the OOM details into ``error_message``) and drops
    the context. So for an actor the message is the only signal, read here and nowhere
    else; a Ray that words it otherwise makes the kill an ordinary one (no growth).
    """
    import ray

    if isinstance(exc, ray.exceptions.OutOfMemoryError):
        return True
    if not isinstance(exc, ray.exceptions.RayActorError):
        return False
    text = str(exc)
    return any(marker in text for marker in _RAY_OOM_MARKERS)


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface holding ``address``; None if none
    does (or it is a loopback address: gloo finds that one by itself)."""
    import ipaddress

    import psutil

    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(address).is_loopback:
            return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:
            return  # nobody reads the output any more (the manager is closing)


OOM_GROWTH = 1.5
"""How much more memory a job asks for after one of its tasks was killed for memory."""


def _largest_node_memory() -> float:
    import ray

    return max(
        (float((n.get("Resources") or {}).get("memory", 0.0)) for n in ray.nodes() if n["Alive"]),
        default=0.0,
    )


class RayBackend:
    """Starts each task's supervisor in its bundle of the cluster's placement group.

    When the whole cluster is relaunched (a restart from the last checkpoint), each job
    asks anew: a job one of whose tasks was killed for outgrowing its memory asks for
    1.5 times as much (bounded by the largest node); a job sized automatically asks for
    the peak its tasks reached so far in this run x ``HEADROOM``
    (``memory_sizing.within_run``); and the placement group is made anew when a size
    changed, since a group's bundles cannot change. A task respawned alone, beside tasks
    still running, goes back into its bundle as it was (sized at the last whole
    placement). A standby holds no bundle; the task it takes over is held to the size
    ``within_run`` gives at that moment.

    Args:
        requests: one per task, in the placement group's bundle order.
        group: the cluster's placement group (``ray_placement.reserve``).
        name: the group's name (for a group made anew).
        placement_timeout_s: how long a group made anew may take to be placed.
    """

    name = "ray"

    def __init__(
        self,
        requests: Sequence[TaskRequest],
        group: Any,
        *,
        name: str = "",
        placement_timeout_s: float = 60.0,
    ) -> None:
        self._requests = {r.task: r for r in requests}
        self._order = [r.task for r in requests]
        self._bundles = {r.task: i for i, r in enumerate(requests)}
        self._group = group
        self._group_name = name
        self._placement_timeout_s = placement_timeout_s
        self._grown: set[int] = set()
        """Processes (by id) whose OOM kill already made their job's memory grow."""
        self._grown_jobs: set[str] = set()
        """Jobs whose memory a kill for memory grew (never asked for less after)."""
        self._grown_groups: dict[TaskId, Any] = {}
        """A task a grow added: the placement group of its change (``reserve``)."""
        self._unplaced: dict[TaskId, tuple[Any, int]] = {}
        """Bundles a grow reserved whose task is not launched yet: (group, index)."""
        self._left: set[TaskId] = set()
        """Tasks of the start that left (a shrink): their bundles of the cluster's group
        stay held (a group's bundles cannot be released one by one) for a later grow."""
        self._changes = 0
        self._lock = threading.Lock()
        self._processes: dict[str, RayProcess] = {}
        """The current process of each task (standbys are not a task's until they take one)."""
        self._all: list[RayProcess] = []

    def launch(self, launch: TaskLaunch) -> RayProcess:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._take_reserved(launch.task)
        request = self._requests.get(launch.task)
        if request is None:
            raise ConfigError(f"task {launch.task} has no place in this cluster")
        secret_file = launch.env.get(ENV_SECRET_FILE)
        if not secret_file:
            raise ConfigError(f"{launch.task}: launched without {ENV_SECRET_FILE}")
        with open(secret_file) as f:
            secret = f.read()
        # What the manager added to its own environment is the task's; the rest of the
        # manager's environment belongs to its node, and the actor's node has its own.
        env = {
            k: v for k, v in launch.env.items() if os.environ.get(k) != v and k not in NODE_LOCAL
        }
        standby = launch.env.get(ENV_STANDBY) == "1"
        if not standby:
            self._resize_for_relaunch()
            request = self._requests[launch.task]
        if standby:
            # A standby waits idle beside the running tasks, whose bundles are all taken:
            # it holds nothing, on a node the job's labels select, until it takes a task;
            # on a node none of the job's tasks runs on when there is one, so that a node
            # that dies does not take the standby with the task it is to replace.
            labels = dict(request.labels)
            options: dict[str, Any] = {"num_cpus": 0, "label_selector": labels}
            busy = self._nodes_of(launch.task.job)
            if busy:
                elsewhere = f"!in({','.join(sorted(busy))})"
                options["label_selector"] = {**labels, NODE_ID_LABEL: elsewhere}
                options["fallback_strategy"] = [{"label_selector": labels}]
        else:
            bundle = request.bundle()
            options = {
                "num_cpus": bundle.get("CPU", 0.0),
                "num_gpus": bundle.get("GPU", 0.0),
                "memory": bundle.get("memory") or None,
                "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self._grown_groups.get(launch.task, self._group),
                    placement_group_bundle_index=self._bundles[launch.task],
                ),
            }
        if standby:
            # It holds no bundle, but is held to what the task it takes over would ask
            # for now (``adopt`` sets it again when it takes one).
            request = self._sized(request)
        limit = request.bundle().get("memory")
        actor = (
            _actor_class()
            .options(name=None, **options)
            .remote(str(launch.task), env, secret, limit)
        )
        process = RayProcess(launch.task, actor, request)
        with self._lock:
            self._all.append(process)
            if not standby:
                self._processes[str(launch.task)] = process
        return process

    def job_peak(self, job: str) -> float:
        """The largest peak memory any task of ``job`` reached so far in this run."""
        with self._lock:
            processes = list(self._all)
        return float(max((p.memory_peak for p in processes if p.task.job == job), default=0))

    def _sized(self, request: TaskRequest, largest: float = 0.0) -> TaskRequest:
        """``request`` with an automatic memory sized by this run's peak so far."""
        asked = request.resources.get("memory")
        if request.memory_named or not asked:
            return request
        job = request.task.job
        memory = within_run(
            float(asked),
            self.job_peak(job),
            before=request.memory_before,
            grown=job in self._grown_jobs,
            largest=largest,
        )
        return replace(request, resources={**request.resources, "memory": memory})

    def _resize_for_relaunch(self) -> None:
        """Before a relaunch of every task: each job's memory asked anew (see the class)."""
        from ray.util.placement_group import remove_placement_group

        from clusterflow.backends.ray_placement import reserve

        with self._lock:
            processes = list(self._processes.values())
        if not processes or any(p.poll() is None for p in processes):
            return  # the first launch, or a relaunch already under way
        killed = [p for p in processes if p.oom and id(p) not in self._grown]
        largest = _largest_node_memory()
        # The start's tasks only: a grow's tasks keep the group of their change.
        grown = {t: self._sized(self._requests[t], largest) for t in self._order}
        for process in killed:
            self._grown.add(id(process))
            self._grown_jobs.add(process.task.job)
            had = process.memory_asked or float(process.memory_peak)
            more = min(had * OOM_GROWTH, largest) if largest else had * OOM_GROWTH
            for task, other in grown.items():
                if task.job == process.task.job:
                    grown[task] = replace(other, resources={**other.resources, "memory": more})
            log.warning(
                "%s was killed for memory (%d bytes asked); job %s now asks %d",
                process.task, had, process.task.job, more,
            )  # fmt: skip
        if all(grown[t] == self._requests[t] for t in grown):
            return
        for task, request in grown.items():
            if request != self._requests[task]:
                log.info("%s asks %s now", task, request.describe(["memory"]))
        remove_placement_group(self._group)
        self._group = reserve(
            [grown[t] for t in self._order], self._group_name, self._placement_timeout_s
        )
        self._requests = {**self._requests, **grown}

    def reserve(self, tasks: Sequence[TaskId]) -> None:
        """Places the tasks a grow adds, before any is launched: one placement group for
        the change (gang-scheduled: all of them or none), never one sized for MAX held
        from the start. A task of the start that left in a shrink takes its bundle of the
        cluster's group again instead. Blocks until Ray placed them, at most the
        placement timeout.

        Raises:
            PlacementError: they cannot be placed (no node has the room, or it was not
                free in time); nothing is held then, and the cluster is untouched.
        """
        from clusterflow.backends.ray_placement import reserve

        if not tasks:
            return
        with self._lock:
            template = next(r for t, r in self._requests.items() if t.job == tasks[0].job)
            fresh = [t for t in tasks if t not in self._left]
            self._left -= set(tasks)
        if not fresh:
            return
        requests = [replace(self._sized(template), task=t) for t in fresh]
        self._changes += 1
        name = f"{self._group_name}-grow-{self._changes}"
        group = reserve(requests, name, self._placement_timeout_s)  # raises: nothing held
        with self._lock:
            for index, request in enumerate(requests):
                self._requests[request.task] = request
                self._unplaced[request.task] = (group, index)
        log.info("%s placed for %s", name, ", ".join(map(str, fresh)))

    def _take_reserved(self, task: TaskId) -> None:
        """A grow's task is launched: it runs in the bundle ``reserve`` placed for it."""
        with self._lock:
            found = self._unplaced.pop(task, None)
            if found is None and task not in self._requests:
                # Named otherwise when reserved (a worker lost in between): same job, same room.
                other = next((t for t in self._unplaced if t.job == task.job), None)
                if other is not None:
                    found = self._unplaced.pop(other)
                    self._requests[task] = replace(self._requests.pop(other), task=task)
            if found is not None:
                self._grown_groups[task], self._bundles[task] = found

    def release(self, task: TaskId) -> None:
        """``task`` left the cluster (a shrink, or lost above MIN), after it stopped: its
        actor ends, and the placement group of the grow that added it is removed once
        none of that change's tasks is left. A task of the start keeps its bundle of the
        cluster's group for a later grow (``reserve``)."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            process = self._processes.pop(str(task), None)
            group = self._grown_groups.pop(task, None) or self._unplaced.pop(task, (None, 0))[0]
            if group is None:
                self._left.add(task)
            else:
                self._requests.pop(task, None)
                self._bundles.pop(task, None)
            still = [*self._grown_groups.values(), *(g for g, _ in self._unplaced.values())]
        if process is not None:
            process.end()
        if group is not None and all(g is not group for g in still):
            with contextlib.suppress(Exception):
                remove_placement_group(group)
            log.info("the placement group of %s's grow was released", task)

    def job_env(self, task: TaskId) -> dict[str, str]:
        return {}  # Ray sets each actor's CUDA_VISIBLE_DEVICES itself

    def _nodes_of(self, job: str) -> set[str]:
        """The nodes the job's current tasks run on (those placed so far)."""
        with self._lock:
            processes = [p for t, p in self._processes.items() if TaskId.parse(t).job == job]
        return {str(p.placement["node_id"]) for p in processes if p.placement is not None}

    def adopt(self, process: Any, task: TaskId) -> None:
        """A standby took ``task`` over: its node is the task's now (``placements``), and
        it is held to the memory the task would ask for now (``_sized``)."""
        with self._lock:
            self._processes[str(task)] = process
        request = self._requests.get(task)
        if request is not None and isinstance(process, RayProcess):
            process.hold_to(self._sized(request))

    def placements(self) -> dict[str, dict[str, Any]]:
        """Each task's node and resources, as its current actor reported them."""
        with self._lock:
            processes = dict(self._processes)
        out = {}
        for task, process in processes.items():
            where = process.placement
            if where is not None:
                where.pop("pid", None)
                out[task] = where
        return out

    def close(self) -> None:
        """Ends every actor still there and releases the cluster's placement groups (the
        start's and each grow's)."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            processes, self._all = self._all, []
        for process in processes:
            process.end()
        deadline = time.monotonic() + 10.0
        for process in processes:
            process.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            groups = [self._group, *self._grown_groups.values()]
            groups += [g for g, _ in self._unplaced.values()]
            self._grown_groups.clear()
            self._unplaced.clear()
        for group in {id(g): g for g in groups}.values():
            with contextlib.suppress(Exception):
                remove_placement_group(group)
