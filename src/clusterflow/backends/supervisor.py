"""A task's supervisor: reserves the task's port, registers, runs the job, reports.

``python -m clusterflow.backends.supervisor``, started by a backend with:

* ``CLUSTERFLOW_MANAGER``: the manager's ``host:port``;
* ``CLUSTERFLOW_SECRET_FILE``: the cluster's credentials;
* ``CLUSTERFLOW_TASK``: ``job:index`` of this task;
* ``CLUSTERFLOW_BIND_HOST``: interface for the task's address (default 127.0.0.1).

Order of events: (1) bind the task's port and keep the socket; (2) register
``(task, host:port)`` with the manager, which answers once every task has registered,
with the assembled spec, the environment and the command; (3) run the command with the
reserved socket inherited (``CLUSTERFLOW_LISTEN_FD``): clusterflow's ``Server`` adopts
it; a foreign runtime binds the same port beside it (the socket is bound, never
listening, with ``SO_REUSEPORT``, so it receives no connections; TensorFlow needs
``TF_GRPC_REUSE_PORT=1`` for this, which is set); (4) heartbeat until the command exits;
(5) report the exit code and end with the same status (re-raising a fatal signal).

If the manager stops answering for longer than ``CLUSTERFLOW_MANAGER_TIMEOUT`` seconds
(it died), the supervisor stops its command: no task outlives its manager. The manager
also reads this supervisor's output through a pipe, so once it died every write to
stdout or stderr fails (EPIPE); the supervisor's own messages tolerate that, or a dead
manager would make the supervisor crash and leave its command running.

**Standby** (``CLUSTERFLOW_STANDBY=1``): a supervisor started before anything failed. It
reserves a port, starts a zygote (``zygote.py``: a Python process with torch already
imported) and waits at the manager (``manager.standby``) until a task dies that may be
respawned alone. Then it becomes that task's supervisor: it registers as the task, and
the zygote runs the job's command in-process, skipping the interpreter's start and
torch's import, most of a replacement's start-up. A command the zygote cannot run
in-process is started as usual. A standby forked from the warm fork server (below)
forks its zygote as the others do, which then warms itself up (``fork_zygote(warm=
True)``): no second Python and no second ``import torch`` per standby.

**Forked** (``backends/forkserver.py``): a local supervisor is usually forked from the
cluster's warm fork server, torch already imported. ``main`` then binds the task's port
and forks the job's zygote (``zygote.fork_zygote``) before this process starts any
thread; the zygote runs the command in-process once registration brings it, as a
standby's does, and is this supervisor's own child in its process group, so every
step below is unchanged. A command it cannot run so starts as usual.

SIGTERM or SIGINT before the command started (while the registration barrier holds)
ends the supervisor at once with that signal; afterwards it is forwarded to the command.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import IO, NoReturn

from clusterflow.backends.api import REPLICA_TAG
from clusterflow.backends.forkserver import refusal
from clusterflow.backends.gpu_topology import read_topology, replica_devices
from clusterflow.backends.zygote import ForkedZygote, fork_zygote, run_command, runnable
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import (
    CUDA_VISIBLE_DEVICES,
    ENV_BIND_HOST,
    ENV_HEARTBEAT_S,
    ENV_LISTEN_FD,
    ENV_MANAGER,
    ENV_MANAGER_TIMEOUT,
    ENV_REGISTER_TIMEOUT,
    ENV_STANDBY,
    ENV_TASK,
    ENV_ZYGOTE_READY_FD,
)
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.rpc import Credentials, RpcClient, RpcError
from clusterflow.server.manager_messages import (
    ExitedRequest,
    HeartbeatRequest,
    RegisterReply,
    RegisterRequest,
    StandbyReply,
    StandbyRequest,
)

log = logging.getLogger("clusterflow.supervisor")

ZYGOTE_WARM_S = 300.0
"""The most a standby waits for its zygote's imports (seconds of CPU on a small box)."""
STANDBY_ROUND_S = 20.0
"""A standby's wait at the manager is answered at least this often (a bounded call)."""
GRACE_S = 10.0
Zygote = subprocess.Popen[bytes] | ForkedZygote
"""A standby's zygote (a process of its own) or one forked from a warm supervisor."""
_OUTPUT_LOCK = threading.Lock()


def say(message: str) -> None:
    """One line to stderr (the manager's pipe), never failing: the manager may be gone."""
    with contextlib.suppress(OSError, ValueError):
        print(f"clusterflow: {message}", file=sys.stderr, flush=True)


def _seconds(environ: dict[str, str], name: str, default: float) -> float:
    """A positive duration from the environment (a user may set the manager timeout)."""
    raw = environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


def reserve_port(host: str) -> socket.socket:
    """A TCP socket bound to an ephemeral port of ``host`` and kept, not listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    sock.set_inheritable(True)
    return sock


class Supervisor:
    def __init__(self, environ: dict[str, str]) -> None:
        try:
            self.manager = environ[ENV_MANAGER]
            self.task = TaskId.parse(environ[ENV_TASK])
        except KeyError as exc:
            raise ConfigError(f"supervisor started without {exc.args[0]}") from exc
        credentials = Credentials.from_env(environ)
        if credentials is None:
            raise ConfigError("supervisor started without CLUSTERFLOW_SECRET_FILE")
        self.credentials = credentials
        self.host = environ.get(ENV_BIND_HOST, "127.0.0.1")
        self.heartbeat_s = _seconds(environ, ENV_HEARTBEAT_S, 1.0)
        self.manager_timeout_s = _seconds(environ, ENV_MANAGER_TIMEOUT, 15.0)
        self.register_timeout_s = _seconds(environ, ENV_REGISTER_TIMEOUT, 180.0)
        self.environ = environ
        self.children: list[subprocess.Popen[bytes] | ForkedZygote] = []
        self.standby = environ.get(ENV_STANDBY) == "1"
        self.zygote: subprocess.Popen[bytes] | ForkedZygote | None = None
        self._exited = threading.Event()
        self.terminating = False
        self.manager_lost = False
        """The last heartbeat went unanswered (the manager may be dead)."""

    def run(self, reserved: socket.socket | None = None) -> int:
        """Registers, runs the job, reports; ``reserved``: the task's port, if bound
        already (before ``main`` forked a zygote that inherits it)."""
        reserved = reserved or reserve_port(self.host)
        address = f"{self.host}:{reserved.getsockname()[1]}"
        client = RpcClient(self.manager, self.credentials, deadline=10.0)
        try:
            if self.standby and not self._take_over(client, reserved.fileno()):
                return 0
            registration = RegisterRequest(task=str(self.task), address=address, pid=os.getpid())
            reply = RegisterReply.from_wire(
                client.call(
                    registration.METHOD, registration.to_wire(), deadline=self.register_timeout_s
                ).body
            )
            env = dict(self.environ)
            env.pop(ENV_STANDBY, None)
            env[ENV_TASK] = str(self.task)
            env.update(reply.env)
            env[ENV_LISTEN_FD] = str(reserved.fileno())
            command = list(reply.command)
            replicas = [dict(r) for r in reply.replicas]
            if self.terminating:
                return 143
            try:
                self._start(command, env, replicas, reserved.fileno())
            except OSError as exc:
                self.stop_child()
                error = f"cannot run {command[0]!r}: {exc.strerror or exc}"
                say(f"{self.task}: {error}")
                self._report(client, 127, error)
                return 127
            reserved.close()  # the job holds its own copy now
            code = self._watch(client)
            self._report(client, code)
            return code
        finally:
            client.close()

    def _start(
        self, command: list[str], env: dict[str, str], replicas: list[dict[str, str]], fd: int
    ) -> None:
        """Starts the job: one process, or one per replica with its own ranks.

        Only replica 0 gets the reserved socket (one server per task address). The
        replicas' output goes through this process, each line tagged with the replica,
        so the manager prefixes it ``[worker:0/1]``.
        """
        zygote, self.zygote = self.zygote, None
        if zygote is not None:
            if not replicas and zygote.poll() is None and self._in_process(zygote, command, env):
                request = {"argv": command, "env": env, "cwd": os.getcwd()}
                assert zygote.stdin is not None
                zygote.stdin.write(json.dumps(request).encode() + b"\n")
                zygote.stdin.close()
                self.children.append(zygote)
                self._watch_exit(zygote)
                return
            _dismiss(zygote)
        if not replicas:
            self.children.append(subprocess.Popen(command, env=env, pass_fds=(fd,)))
            self._watch_exit(self.children[0])
            return
        # One device per replica, the best-connected ones the task may use (gpu_topology).
        devices = replica_devices(env, len(replicas), read_topology())
        for index, overrides in enumerate(replicas):
            replica_env = {**env, **overrides}
            if devices is not None:
                replica_env[CUDA_VISIBLE_DEVICES] = devices[index]
            if index:
                replica_env.pop(ENV_LISTEN_FD, None)
            child = subprocess.Popen(
                command,
                env=replica_env,
                pass_fds=(fd,) if index == 0 else (),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            self.children.append(child)
            self._watch_exit(child)
            assert child.stdout is not None
            threading.Thread(
                target=_relay, args=(index, child.stdout), name=f"replica-{index}", daemon=True
            ).start()

    def _in_process(self, zygote: Zygote, command: list[str], env: dict[str, str]) -> bool:
        """Whether ``zygote`` can run ``command`` as a fresh ``python`` would. A forked
        one holds the imports made under this process's environment, so the job's may
        not differ in a variable read at start-up (``forkserver.refusal``)."""
        if not isinstance(zygote, ForkedZygote):
            return runnable(command)
        reason = refusal(command, env, self.environ)
        if reason is not None:
            log.info("%s: started as a new process: %s", self.task, reason)
        return reason is None

    def _take_over(self, client: RpcClient, fd: int) -> bool:
        """Standby: warms a zygote (or has one forked by ``main`` warm up), then waits
        to be given a task; False: not needed."""
        if isinstance(self.zygote, ForkedZygote) and self.zygote.ready is not None:
            ready_pipe, self.zygote.ready = self.zygote.ready, None
        else:
            read_end, write_end = os.pipe()
            env = {k: v for k, v in self.environ.items() if k != ENV_STANDBY}
            env[ENV_ZYGOTE_READY_FD] = str(write_end)
            self.zygote = subprocess.Popen(
                [sys.executable, "-m", "clusterflow.backends.zygote"],
                env=env,
                stdin=subprocess.PIPE,
                pass_fds=(fd, write_end),
            )
            os.close(write_end)
            ready_pipe = os.fdopen(read_end, "rb")
        # Report for duty once warm (or dead: EOF), so the manager can say it is ready.
        with ready_pipe as ready:
            # Bounded: a zygote stuck in its imports must not keep a task from starting.
            answered, _, _ = select.select([ready], [], [], ZYGOTE_WARM_S)
            warm = bool(answered) and ready.read(1) == b"1"
        if not warm:
            # Killed, hung or failed to import torch: a task given to it starts cold.
            say("standby: the zygote did not warm up; a task given to it starts cold")
            self.zygote.kill()
            self.zygote.wait()
            self.zygote = None
        while not self.terminating:
            waiting = StandbyRequest(pid=os.getpid(), wait_s=STANDBY_ROUND_S)
            reply = StandbyReply.from_wire(
                client.call(waiting.METHOD, waiting.to_wire(), deadline=STANDBY_ROUND_S + 10.0).body
            )
            if reply.exit:
                break
            if reply.task:
                self.task = TaskId.parse(reply.task)
                return True
        if self.zygote is not None:
            _dismiss(self.zygote)
            self.zygote = None
        return False

    def _watch_exit(self, child: Zygote) -> None:
        """Wakes ``_watch`` the moment ``child`` exits (the others are then stopped)."""

        def wait() -> None:
            child.wait()
            self._exited.set()

        threading.Thread(target=wait, name=f"wait-{child.pid}", daemon=True).start()

    @property
    def child(self) -> subprocess.Popen[bytes] | ForkedZygote | None:
        """The job's first process (the only one unless the task runs replicas)."""
        return self.children[0] if self.children else None

    def _outcome(self) -> int | None:
        """The task's exit code once decided: the first failure, else 0 when all exited 0."""
        codes = [c.poll() for c in self.children]
        failed = [code for code in codes if code is not None and code != 0]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        return None

    def _watch(self, client: RpcClient) -> int:
        last_ok = time.monotonic()
        while True:
            self._exited.wait(self.heartbeat_s)
            self._exited.clear()
            code = self._outcome()
            if code is not None:
                if code != 0 and len(self.children) > 1:
                    # One replica failed: its peers would hang in their next collective.
                    self.stop_child()
                return code
            try:
                beat = HeartbeatRequest(task=str(self.task), pid=self.children[0].pid)
                client.call(beat.METHOD, beat.to_wire(), deadline=max(2.0, self.heartbeat_s * 2))
                last_ok = time.monotonic()
                self.manager_lost = False
            except RpcError as exc:
                self.manager_lost = True
                if time.monotonic() - last_ok > self.manager_timeout_s:
                    say(
                        f"manager {self.manager} unreachable for "
                        f"{self.manager_timeout_s:g}s ({exc}); stopping {self.task}"
                    )
                    self.stop_child()
                    return self._outcome() or 1

    def _report(self, client: RpcClient, code: int, error: str | None = None) -> None:
        if self.manager_lost:
            return  # not worth another deadline: the manager reads the exit code itself
        exited = ExitedRequest(task=str(self.task), code=code, error=error)
        with contextlib.suppress(RpcError):
            client.call(exited.METHOD, exited.to_wire(), deadline=2.0)

    def stop_child(self) -> None:
        """SIGTERM to the job's processes, SIGKILL after the grace period."""
        live = [c for c in self.children if c.poll() is None]
        for child in live:
            with contextlib.suppress(ProcessLookupError):
                child.terminate()
        deadline = time.monotonic() + GRACE_S
        for child in live:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.terminating = True
        if not self.children:
            # Still in the registration barrier (a blocking call that may last the whole
            # registration timeout): nothing to stop gracefully, so end now, as the signal
            # would have. A command being started this very moment shares our process
            # group, which the manager signals as a whole.
            _exit_like(-signum)
        for child in self.children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signum)


def _dismiss(zygote: subprocess.Popen[bytes] | ForkedZygote) -> None:
    """Ends an unused zygote: EOF on its stdin makes it exit 0."""
    with contextlib.suppress(OSError, ValueError):
        if zygote.stdin is not None:
            zygote.stdin.close()
    try:
        zygote.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        zygote.kill()
        zygote.wait()


def _relay(replica: int, stream: IO[bytes]) -> None:
    """Copies a replica's output to ours line by line, tagged for the manager's router."""
    tag = REPLICA_TAG + str(replica).encode() + REPLICA_TAG
    out = sys.stdout.buffer
    try:
        for raw in iter(stream.readline, b""):
            line = raw if raw.endswith(b"\n") else raw + b"\n"
            with _OUTPUT_LOCK, contextlib.suppress(OSError, ValueError):
                out.write(tag + line)
                out.flush()
    finally:
        stream.close()


def _exit_like(code: int) -> NoReturn:
    """Ends this process the way the job ended, so the manager sees the same status."""
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set: no need
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def main() -> None:
    try:
        supervisor = Supervisor(dict(os.environ))
    except ClusterflowError as exc:
        say(str(exc))
        sys.exit(2)
    reserved = None
    if "torch" in sys.modules:
        # Forked from the warm server (backends/local.py): fork the job's zygote now,
        # while this process has no thread (and no logging set up: the job sets its
        # own), with the task's port bound for it to inherit. A standby's warms itself
        # up while it waits (``_take_over``), instead of a Python of its own.
        reserved = reserve_port(supervisor.host)
        supervisor.zygote, request = fork_zygote(warm=supervisor.standby)
        if request is not None:  # the zygote, given its job: run it and end as it ends
            run_command(list(request["argv"]))  # type: ignore[call-overload]
            return
    logging.basicConfig(level=logging.WARNING, format="clusterflow: %(message)s")
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    signal.signal(signal.SIGINT, supervisor.on_signal)
    try:
        code = supervisor.run(reserved)
    except RpcError as exc:
        say(f"{supervisor.task}: {exc}")
        supervisor.stop_child()
        code = 1
    _exit_like(code)


if __name__ == "__main__":
    main()
