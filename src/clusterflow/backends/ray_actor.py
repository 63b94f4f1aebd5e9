"""One task on a Ray node: the actor that hosts its supervisor, and the manager's handle.

The actor (``SupervisorHost``) holds the task's resources (a bundle of a placement group
that ``ray_backend.RayBackend`` reserved) and starts the same supervisor the local
backend starts (``python -m clusterflow.backends.supervisor``) as its child (under a
node's agent, forked from the agent's warm fork server instead: ``_start``), so the
manager's contract is unchanged: registration, heartbeats and exit go over clusterflow's
RPC; the actor only carries what a local process gives for free: the output stream, the
exit code and signals. Ray's own calls carry them, each with a deadline. ``RayProcess``
is the manager's side of one such actor, with the interface of a local process.

On the node, the supervisor:

* binds the node's own address (``CLUSTERFLOW_BIND_HOST`` is the node's IP), so the
  spec, ``TF_CONFIG`` and ``MASTER_ADDR`` hold addresses every node reaches;
* reads the cluster secret from a file the actor wrote (mode 0600, in a private
  temporary folder, removed when the task ends): the secret travels inside the actor's
  creation call, never in an environment variable, the job folder or Ray's logs;
* sees ``CUDA_VISIBLE_DEVICES`` as Ray set it for the actor (the GPUs Ray assigned).

Split from ``ray_backend.py``, which places the cluster (what runs where, how much
memory each job asks, the placement groups of grows) and launches through this module.
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
from collections.abc import Mapping
from typing import IO, Any, Final

from clusterflow.backends.forked import ForkedJob, Unavailable, fork_job
from clusterflow.backends.memory_watch import MemoryWatch, tree_rss
from clusterflow.backends.ray_placement import TaskRequest
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import (
    CUDA_VISIBLE_DEVICES,
    ENV_BIND_HOST,
    ENV_NODE,
    ENV_SECRET_FILE,
    ENV_TASK,
    GLOO_IFNAME,
)
from clusterflow.errors import ClusterflowError

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
SAMPLE_S = 0.2
"""How often a task's memory (its whole process tree) is measured."""
PRIVATE_SAMPLE_S = 1.0
"""How often a forked tree's own pages (USS) are read for its peak while its RSS stays
under its limit (``SupervisorHost._measure``)."""


class SupervisorHost:
    """The actor under which one task's supervisor runs (a Ray actor, see ``actor_class``).

    Threaded (``max_concurrency``), so a ``signal`` is served while a ``read`` waits.
    """

    def __init__(
        self,
        task: str,
        env: Mapping[str, str],
        secret: str,
        memory_limit: float | None = None,
        assigned: Mapping[str, float] | None = None,
        warm: str | None = None,
    ) -> None:
        """``warm``: the node's warm fork server (``NAME:PID``, its agent's), which
        forks the supervisor when it can; otherwise, or when it cannot, a fresh one."""
        import ray

        self.task = task
        self._assigned = dict(assigned) if assigned is not None else None
        """The bundle's resources, when a node's agent (``ray_agent``) hosts this task:
        the placement group holds them, not this process, so Ray cannot say."""
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
        self._popen, self._out = _start(full, warm)
        self._forked = isinstance(self._popen, ForkedJob)
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
        private_at = 0.0
        while self._popen.poll() is None:
            total = tree_rss(root)
            if self._forked:
                # RSS bounds the tree's own pages from above (it adds those shared with
                # the server) and costs microseconds; USS walks every page (about 7 ms
                # a process with torch imported), so it is read only when RSS crosses
                # the limit, and for the peak once every PRIVATE_SAMPLE_S.
                over = self._memory.limit is not None and total > self._memory.limit
                if not over and time.monotonic() < private_at:
                    time.sleep(SAMPLE_S)
                    continue
                total = tree_rss(root, private=True)
                private_at = time.monotonic() + PRIVATE_SAMPLE_S
            if self._memory.sample(total):
                log.warning(
                    "%s uses %d bytes, over its %d: killed", self.task, total, self._memory.limit
                )
                self.signal(signal.SIGKILL)
            time.sleep(SAMPLE_S)

    def _read_pipe(self) -> None:
        fd = self._out.fileno()
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
            "resources": (
                dict(context.get_assigned_resources()) if self._assigned is None else self._assigned
            ),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()] if self._assigned is None else [],
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

    def close(self) -> None:
        """Kills what is left of the tree and removes the secret's folder: the task ended
        or its manager let it go (an agent's host; an actor's own end does this by dying,
        and its node's tree is killed with it only when the node dies)."""
        if self._popen.poll() is None:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(EXIT_DRAIN_S)
        shutil.rmtree(self._dir, ignore_errors=True)


def _start(
    env: Mapping[str, str], warm: str | None
) -> tuple[ForkedJob | subprocess.Popen[bytes], IO[bytes]]:
    """The supervisor, forked by the node's warm server (``warm``) or started fresh
    (no server, or one that cannot fork it: one log line says why); and its output.

    Forked, it leads a session of its own and is the server's child, not this
    process's: its exit status comes over the server's socket (``forked.ForkedJob``),
    as a ``Popen``'s would, and ``signal`` reaches its group as before."""
    if warm is not None:
        read_end, write_end = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            argv = [sys.executable, "-m", SUPERVISOR_MODULE]
            job = fork_job(warm, argv, env, os.getcwd(), stdio=(null, write_end, write_end))
            return job, os.fdopen(read_end, "rb")
        except Unavailable as exc:
            os.close(read_end)
            log.warning("%s starts its own Python (%s)", env.get(ENV_TASK, "a task"), exc)
        finally:
            os.close(null)
            os.close(write_end)
    popen = subprocess.Popen(
        [sys.executable, "-m", SUPERVISOR_MODULE],
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert popen.stdout is not None
    return popen, popen.stdout


@functools.cache
def actor_class() -> Any:
    """``SupervisorHost`` as a Ray actor class, made on first use (Ray is optional)."""
    import ray

    return ray.remote(max_concurrency=4, max_restarts=0)(SupervisorHost)


class OwnActor:
    """A task in an actor of its own, which holds its bundle's resources (GPUs, a run's
    runtime environment, a standby; otherwise a node's agent hosts it, ``ray_agent``)."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def start(self) -> None:
        """Nothing: the actor started its supervisor when Ray placed it."""

    def info(self) -> Any:
        return self._actor.info.remote()

    def read(self, wait_s: float) -> Any:
        return self._actor.read.remote(wait_s)

    def signal(self, signum: int) -> Any:
        return self._actor.signal.remote(signum)

    def hold_to(self, limit: float | None) -> Any:
        return self._actor.hold_to.remote(limit)

    def end(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)


class RayProcess:
    """The manager's view of one supervisor actor (``TaskProcess``).

    A thread pulls the actor's output into a local pipe (``output``, read by the
    manager's output router) and records the exit code. An actor that dies (its node
    died, or it was killed) counts as a task killed with SIGKILL.
    """

    def __init__(self, task: TaskId, host: Any, request: TaskRequest) -> None:
        self._task = task
        self._host = host
        """``OwnActor`` or ``ray_agent.AgentSlot``: where the supervisor runs."""
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
        self._pending: list[int] = []
        """Signals sent before the supervisor started, sent to it once it did."""
        self._pending_lock = threading.Lock()
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
            self._host.hold_to(request.bundle().get("memory"))

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

        if not self._placed.is_set():
            # Not started yet (an agent's slot waits for its bundle): kept, sent once it is.
            with self._pending_lock:
                if not self._placed.is_set():
                    self._pending.append(signum)
                    return
        # Awaited, so a SIGKILL has landed before the caller waits for the exit.
        with contextlib.suppress(ray.exceptions.RayError):
            ref = self._host.signal(signum)
            if ref is not None:
                ray.get(ref, timeout=CALL_DEADLINE_S)

    def end(self) -> None:
        """Ends the task's actor (and with it the supervisor's hold on its resources),
        or lets its agent end what is left of it."""
        self._host.end()

    def _pump(self) -> None:
        import ray

        code = -signal.SIGKILL
        try:
            # No deadline on placement itself: after a node died, Ray places the bundle
            # again when a node is free, and the manager's registration timeout bounds it.
            self._host.start()
            self._info = ray.get(self._host.info())
            with self._pending_lock:
                self._placed.set()
                pending, self._pending = self._pending, []
            for signum in pending:
                self.signal(signum)
            while True:
                try:
                    got = ray.get(self._host.read(READ_WAIT_S), timeout=CALL_DEADLINE_S)
                except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                    continue  # a node briefly unreachable; Ray says when it is dead
                self.memory_peak = max(self.memory_peak, int(got["memory_peak"]))
                self.oom = bool(got["oom"])
                if got["data"]:
                    _write_all(self._write_fd, got["data"])
                if got["code"] is not None:
                    code = got["code"]
                    break
        except ClusterflowError as exc:  # no agent answered on the bundle's node
            log.warning("%s: %s; counted as killed", self._task, exc)
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
                    self._growable = asked < largest_node_memory()
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


def largest_node_memory() -> float:
    """The memory of the largest live Ray node: the most a job may grow to."""
    import ray

    return max(
        (float((n.get("Resources") or {}).get("memory", 0.0)) for n in ray.nodes() if n["Alive"]),
        default=0.0,
    )
