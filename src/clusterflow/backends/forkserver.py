"""The warm fork server: one Python that imports torch once; every local task's
supervisor is forked from it, and forks its job from itself.

Started by the process that will be the manager (``clusterflow start``'s first instant,
``cli/__init__.py``; a detached manager's own start, ``manager/__main__.py``), so its
``import torch`` overlaps the CLI's imports and the manager's start, and is paid once
per cluster instead of once per rank and again at every restart. It runs in a session
of its own (a terminal's Ctrl-C reaches the manager, which stops the tasks in order).

The manager's backend (``backends/local.py``, through ``forked.py``) connects to its
abstract unix socket (only the same user is served: ``SO_PEERCRED``) and sends the
supervisor's ``argv``, ``env`` and ``cwd`` with its stdin, stdout and stderr
(``send_fds``: the manager's pipe). The server forks; the child leads a session of its
own, as a supervisor started by the manager does, and runs the supervisor in-process
(``zygote.run_command``). The supervisor, still without a thread, forks its job's
zygote at once (``zygote.fork_zygote``), so the job is the supervisor's own child, in
its process group, as before: the supervisor's promises (exit codes and fatal signals
reported, output routed, SIGTERM/SIGINT forwarded, stdin, the reserved socket, the
task's environment) are kept by the same code. The server answers the supervisor's pid
and, once it reaped it, ``exit STATUS``, which the manager reads as a ``Popen``'s.

Who ends what: a supervisor's job dies with its supervisor (``PR_SET_PDEATHSIG``); a
supervisor dies with this server (likewise, set by the child's only thread); this
server outlives its starter (the manager) only until its last child ended, taking no
request after it, so a dead manager's supervisors stop their jobs when it stays silent
(``CLUSTERFLOW_MANAGER_TIMEOUT``), as before. Every process forked here carries the
cluster's ``CLUSTERFLOW_CLUSTER_ID`` in its ``/proc/PID/environ`` (the server's,
given at its start), where ``clusterflow stop`` finds a stale cluster's processes.

Fork safety: the server imports and runs nothing that starts a thread of its own before
forking (no torch op, no OpenMP pool, no ZeroMQ context); the one thread an import
starts, OpenBLAS's pool under numpy, is shut down around ``fork`` by OpenBLAS's own
``pthread_atfork`` handlers. CUDA is never initialised here, so each job's
``CUDA_VISIBLE_DEVICES`` still picks its GPUs.

A request it cannot serve faithfully is refused and started by the caller as before
(``refused REASON``): a command this interpreter cannot run in-process, or an
environment that differs from this server's in a variable read once at start-up
(``PYTHON*``, thread-pool sizes, ``LD_*``, ``TORCH_*``). The same check keeps a job
whose own environment differs so from its zygote (``supervisor._in_process``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clusterflow.backends.zygote import TITLE_ROOM, become, die_with, run_command, runnable
from clusterflow.cluster.contract import (
    ENV_CLUSTER_ID,
    ENV_LISTEN_FD,
    ENV_WARM_FORK,
    PYTHONUNBUFFERED,
)

log = logging.getLogger(__name__)

PRELOAD = ("torch", "clusterflow.rpc", "clusterflow.server.manager_messages")
"""Imported before the first fork: what every job and every supervisor needs (not the
supervisor's module itself, which runs as ``__main__``: runpy warns of a module run
after it was imported)."""
PRELOAD_LATER = (
    "clusterflow.strategies",
    "clusterflow.strategies.parameter_server.strategy",
    "torch._dynamo",
)
"""Imported one by one while no request waits, once the manager asks for them
(:func:`preload_later`: the cluster runs and a restart, respawn or grow may still fork
from here). Not before: on a machine with no core to spare, seconds of imports here
(``torch._dynamo``, what an optimizer's first construction imports) slowed the launch
they overlapped by a tenth (the second supervisor's request waited behind the first
import; docs/benchmarks.md, "Issue 28 after the eighth session"), and a cluster that
never restarts would pay them for nothing. A job that needs them sooner imports them
itself."""
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "LD_", "TORCH_")
"""Variables read when the interpreter or a preloaded library starts: a job that sets
one otherwise than this server's environment does is started cold."""
STARTUP_EXEMPT = frozenset({PYTHONUNBUFFERED})
"""Read when the job's streams are made, which the child does again (``_streams``)."""
HEADER = struct.Struct("!Q")
"""A request: its JSON's length (with the fds), then the JSON: a command to fork
(``argv``, ``env``, ``cwd``), or ``{"preload": true}`` (:func:`preload_later`)."""
PRELOAD_S = 2.0
"""The most :func:`preload_later`'s request may take (the server reads it at once)."""
REQUEST_S = 10.0
"""The most a request's bytes may take to arrive (a client that stalls is dropped)."""
MAX_REQUEST = 64 << 20


class WarmServer:
    """A warm fork server this process started and owns: the manager's (one per
    cluster, the module's functions below) or a Ray node agent's (``ray_agent``: one
    per node, started with the agent, serving every cluster's tasks there)."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen[bytes] | None = None
        self._address: str | None = None
        self.cluster_id: str | None = None
        """The id its cluster will have: in the server's environment from its start, so
        every process forked from it carries it where ``clusterflow stop`` looks for a
        stale cluster's processes (``/proc/PID/environ``: a fork cannot change it).
        None for an agent's, which serves many clusters."""
        self.preloading = False
        """Whether it was asked for ``PRELOAD_LATER`` (once is enough)."""

    def ensure(self, cluster_id: str | None = None, *, tagged: bool = True) -> str | None:
        """Its address (``NAME:PID``), starting it if none runs; None when
        ``CLUSTERFLOW_WARM_FORK=0`` or it could not be started.

        ``cluster_id``: the cluster it serves (None: a new id, which ``cluster_id`` then
        gives to the cluster about to be made); ``tagged`` False: no cluster's (an
        agent's)."""
        if os.environ.get(ENV_WARM_FORK, "1") == "0":
            return None
        if self.popen is not None and self.popen.poll() is None:
            return self._address
        name = f"clusterflow-fork-{os.getpid()}-{os.urandom(8).hex()}"
        env = dict(os.environ)
        # Never this environment's id: that is the cluster of whoever ran `start` (a task).
        cid = (cluster_id or os.urandom(5).hex()) if tagged else None
        if cid is not None:
            env[ENV_CLUSTER_ID] = cid
        else:
            env.pop(ENV_CLUSTER_ID, None)
        try:
            popen = subprocess.Popen(
                [
                    *(sys.executable, "-m", "clusterflow.backends.forkserver"),
                    *(name, str(os.getpid()), TITLE_ROOM),  # the room: zygote.show_as
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            return None
        self.popen, self._address, self.cluster_id = popen, f"{name}:{popen.pid}", cid
        self.preloading = False
        return self._address

    def address(self) -> str | None:
        """The running server's ``NAME:PID``, or None; one warning when it has died."""
        if self.popen is None:
            return None
        code = self.popen.poll()
        if code is not None:
            log.warning("the warm fork server exited (%s); tasks start their own Python", code)
            self.popen = self._address = self.cluster_id = None
            return None
        return self._address

    def preload_later(self) -> None:
        """Asks the server, if it runs, to import ``PRELOAD_LATER`` while it idles, so
        a restart's or a grow's forks find them imported; once per server.

        The manager asks once its cluster runs and a fork may still come (a restart
        left, a respawn or grow possible: ``manager/recovery.py``). A server that cannot
        be reached is left alone: a job that needs the modules imports them itself."""
        if self.preloading:
            return
        server = self.address()
        if server is None:
            return
        self.preloading = True
        body = json.dumps({"preload": True}).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(PRELOAD_S)
                conn.connect("\0" + server.rpartition(":")[0])
                conn.sendall(HEADER.pack(len(body)) + body)
        except OSError as exc:
            log.info("the warm fork server was not asked to preload: %s", exc)

    def stop(self) -> None:
        """Ends the server (and any job it still holds: they die with it)."""
        popen, self.popen, self._address = self.popen, None, None
        self.cluster_id, self.preloading = None, False
        if popen is not None and popen.poll() is None:
            popen.kill()
            popen.wait()


_STARTED = WarmServer()
"""This process's server as the manager of one cluster (``clusterflow start``'s, a
detached manager's); a Ray agent keeps its own ``WarmServer`` and lends it (``lend``)."""
_LENT: list[WarmServer] = []
"""A server this process may fork from but must not end or preload: a Ray agent's, for
the managers it hosts (their torch store's helper, ``manager/store_host.py``)."""


# The side that starts it ------------------------------------------------------------


def start_early(argv: Sequence[str]) -> None:
    """Starts the server at ``clusterflow start``'s first instant, before the CLI's own
    imports; any other command (or ``--detach``, whose manager starts its own) starts
    none, nor does a ``--backend`` other than ``local`` named on the command line (a Ray
    launch would pay torch's import here for nothing). Later, ``start`` ends it if the
    cluster's tasks are not this machine's after all (a backend set in a cluster file).
    """
    if len(argv) < 2 or argv[1] != "start":
        return
    options = list(argv[2 : _dashdash(argv)])
    if any(a in ("--detach", "-h", "--help") for a in options):
        return
    if _backend(options) not in (None, "local"):
        return
    ensure()


def _backend(options: Sequence[str]) -> str | None:
    """The ``--backend`` that ``start``'s options name, if any (the last one counts)."""
    named = None
    for i, option in enumerate(options):
        if option == "--backend" and i + 1 < len(options):
            named = options[i + 1]
        elif option.startswith("--backend="):
            named = option.split("=", 1)[1]
    return named


def _dashdash(argv: Sequence[str]) -> int:
    return argv.index("--") if "--" in argv else len(argv)


def ensure(cluster_id: str | None = None) -> str | None:
    """This process's server's address, starting it if none runs (``WarmServer.ensure``)."""
    return _STARTED.ensure(cluster_id)


def cluster_id() -> str | None:
    """The id the running server was started for (the cluster to make), or None."""
    return _STARTED.cluster_id if _STARTED.popen is not None else None


def lend(server: WarmServer) -> None:
    """Lets this process's forks (``address``) use ``server``, which it does not own:
    ``stop`` and ``preload_later`` leave it alone (a Ray agent's, while the managers it
    hosts come and go)."""
    _LENT[:] = [server]


def address() -> str | None:
    """This process's own running server's ``NAME:PID``, else a lent one's, or None."""
    own = _STARTED.address()
    if own is None and _LENT:
        return _LENT[0].address()
    return own


def preload_later() -> None:
    """``WarmServer.preload_later`` for this process's server."""
    _STARTED.preload_later()


def stop() -> None:
    """Ends this process's server (and any job it still holds: they die with it)."""
    _STARTED.stop()


# The server ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Job:
    pid: int
    pidfd: int
    conn: socket.socket | None
    """The supervisor's connection; None once it closed (the job is then killed)."""


@dataclass(frozen=True, slots=True)
class Request:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]
    """stdin, stdout, stderr, then the reserved listening socket if any."""


def refusal(argv: Sequence[str], env: Mapping[str, str], own: Mapping[str, str]) -> str | None:
    """Why this server cannot run ``argv`` in ``env`` as a fresh interpreter would, or
    None when it can (``own``: this server's environment at its start)."""
    if not runnable(argv):
        return f"{argv[0] if argv else 'an empty command'} does not run in-process"
    for key in sorted(set(env) | set(own)):
        startup = key.startswith(STARTUP_PREFIXES) and key not in STARTUP_EXEMPT
        if startup and env.get(key) != own.get(key):
            return f"{key} differs from the warm process's"
    return None


@dataclass(frozen=True, slots=True)
class Preload:
    """The manager's ``{"preload": true}``: import ``PRELOAD_LATER`` while idle."""


def _receive(conn: socket.socket) -> Request | Preload:
    conn.settimeout(REQUEST_S)
    head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 8)
    try:
        if len(head) < HEADER.size:
            head += _exactly(conn, HEADER.size - len(head))
        (length,) = HEADER.unpack(head)
        if length > MAX_REQUEST:
            raise ValueError(f"request of {length} bytes")
        body = json.loads(_exactly(conn, length))
        if body.get("preload") is True and not fds:
            return Preload()
        return Request(
            argv=[str(a) for a in body["argv"]],
            env={str(k): str(v) for k, v in body["env"].items()},
            cwd=str(body["cwd"]),
            fds=list(fds),
        )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("request cut short")
        data += part
    return data


def serve(listener: socket.socket, own: Mapping[str, str], parent: int) -> Request | None:
    """Serves until its starter died and its children ended; returns a request only in a
    forked child (the one it became), None in the server when it is done. Imports
    ``PRELOAD_LATER`` while nothing waits, once asked to (:class:`Preload`).

    One thread: reads a request, forks, answers; wakes for a new connection, a job's
    exit (reaped and reported) or its starter's death (``parent``: a pidfd). A starter
    that died (the manager) is no reason to end the tasks at once: their supervisors
    stop their jobs once the manager stays silent (``CLUSTERFLOW_MANAGER_TIMEOUT``), as
    supervisors the manager started themselves do; so the server stops taking requests
    and stays, the parent its children die with, until the last of them ended.
    """
    jobs: dict[int, _Job] = {}  # by pidfd
    uid = os.getuid()
    later: list[str] = []
    asked = False
    while listener.fileno() >= 0 or jobs:
        conns = [j.conn for j in jobs.values() if j.conn is not None]
        starter = [parent] if listener.fileno() >= 0 else []
        waiting: list[socket.socket | int] = [*starter, *conns, *jobs]
        if listener.fileno() >= 0:
            waiting.append(listener)
        ready, _, _ = select.select(waiting, [], [], 0.0 if later else None)
        if not ready and later:
            with contextlib.suppress(Exception):  # a job that needs it will say why
                __import__(later.pop(0))
        for item in ready:
            if item is listener and listener.fileno() >= 0:
                child = _accept(listener, uid, own, jobs, parent)
                if isinstance(child, Preload):
                    if not asked:
                        later, asked = list(PRELOAD_LATER), True
                elif child is not None:
                    return child
            elif isinstance(item, socket.socket):
                job = next((j for j in jobs.values() if j.conn is item), None)
                if job is not None and _closed(item):
                    item.close()
                    job.conn = None  # its starter died: nobody to report to
            elif item == parent:
                listener.close()
            else:
                job = jobs.pop(int(item))
                _, status = os.waitpid(job.pid, 0)
                os.close(job.pidfd)
                if job.conn is not None:
                    with contextlib.suppress(OSError):
                        job.conn.sendall(f"exit {status}\n".encode())
                    job.conn.close()
    return None


def _closed(conn: socket.socket) -> bool:
    """Whether the other end closed ``conn`` (it sends nothing after its request)."""
    try:
        return not conn.recv(1)
    except OSError:
        return True


def _accept(
    listener: socket.socket, uid: int, own: Mapping[str, str], jobs: dict[int, _Job], parent: int
) -> Request | Preload | None:
    """Serves one connection: forks for a request (the child returns it), answers a
    refusal, or returns a :class:`Preload` (in the server)."""
    conn, _ = listener.accept()
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, peer_uid, _ = struct.unpack("3i", creds)
    if peer_uid != uid:
        conn.close()  # another user must never run code as this one
        return None
    try:
        request = _receive(conn)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        conn.close()
        return None
    if isinstance(request, Preload):
        conn.close()
        return request
    reason = refusal(request.argv, request.env, own)
    if reason is None and len(request.fds) < 3:
        reason = "stdin, stdout and stderr not sent"
    if reason is not None:
        _close(request.fds)
        with contextlib.suppress(OSError):
            conn.sendall(f"refused {reason}\n".encode())
        conn.close()
        return None
    server = os.getpid()
    gc.freeze()  # what is here now stays out of the child's collections (see main)
    pid = os.fork()
    if pid == 0:
        gc.enable()
        conn.close()
        listener.close()
        os.close(parent)
        for job in jobs.values():
            os.close(job.pidfd)
            if job.conn is not None:
                job.conn.close()
        _become_job(request, server)
        return request
    _close(request.fds)
    pidfd = os.pidfd_open(pid)
    try:
        socket.send_fds(conn, [f"pid {pid}\n".encode()], [pidfd])
    except OSError:
        os.kill(pid, signal.SIGKILL)  # who asked for it is gone already
        conn.close()
        jobs[pidfd] = _Job(pid, pidfd, None)
        return None
    jobs[pidfd] = _Job(pid, pidfd, conn)
    return None


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _become_job(request: Request, server: int) -> None:
    """In the child: the job's session, death with the server, stdio, socket, env, cwd."""
    os.setsid()  # its own group: killed whole when its supervisor dies
    die_with(server)
    stdin, stdout, stderr, *rest = request.fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    _close([stdin, stdout, stderr])
    env = dict(request.env)
    if rest:
        os.set_inheritable(rest[0], True)  # as the supervisor's pass_fds gave it
        env[ENV_LISTEN_FD] = str(rest[0])
        _close(rest[1:])
    become(env, request.cwd, request.argv)


def main() -> None:
    name, starter = sys.argv[1], int(sys.argv[2])
    parent = os.pidfd_open(starter)
    if os.getppid() != starter:
        return  # it died before we could watch it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)  # abstract: nothing on disk to leave behind
    listener.listen(64)  # bound before the imports: early clients wait in the backlog
    own = dict(os.environ)
    # Python's recipe for a process that forks without exec (the gc module's docs): no
    # collection here, so none runs during the imports (a seventh of torch's import time
    # on the machine of docs/benchmarks.md) and no freed holes dirty shared pages;
    # ``gc.freeze()`` before each fork, so a child's collections never walk (and copy)
    # the imported objects; ``gc.enable()`` in the child.
    gc.disable()
    for module in PRELOAD:
        __import__(module)
    request = serve(listener, own, parent)
    if request is not None:
        run_command(request.argv)  # the job, in this (forked) process


if __name__ == "__main__":
    main()
