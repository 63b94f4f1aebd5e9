"""The manager's side of the warm fork server (``forkserver.py``): a process forked there.

:func:`fork_job` asks the server named ``NAME:PID`` to run a command (the local
backend's: a task's supervisor) and returns a :class:`ForkedJob`, which the backend keeps
as it keeps a ``Popen``: its pid, ``poll``, ``wait``, ``send_signal``, ``terminate``,
``kill``. The process is the server's child, not the caller's, so its exit status comes
over the connection (``exit STATUS``) and signals go through a pidfd the server sent
(never to a pid the kernel may have reused). EOF without a status: the server died, and
the process with it (``PR_SET_PDEATHSIG``), reported as killed.

:class:`Unavailable` means "start it as before": the server is gone or never came up, or
it refused the request (a command it cannot run in-process); its message says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

import psutil

from clusterflow.backends.forkserver import HEADER

CONNECT_S = 300.0
"""The most a request waits for the server's imports (seconds of CPU on a busy box)."""
KILLED = -signal.SIGKILL
"""The status of a job whose server died before reporting it (the kernel killed it)."""


class Unavailable(Exception):
    """The server could not run the job; the message says why, in a few words."""


class ForkedJob:
    """A job process forked by the warm server, seen as its supervisor sees a ``Popen``."""

    def __init__(self, conn: socket.socket, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._pidfd = pidfd
        self._done = threading.Event()
        threading.Thread(target=self._read_exit, name=f"forked-{pid}", daemon=True).start()

    def _read_exit(self) -> None:
        """Waits for ``exit STATUS``; EOF without it: the server died, and the kernel
        killed the job with it (``PR_SET_PDEATHSIG``)."""
        code = KILLED
        with contextlib.suppress(OSError, ValueError):
            line = self._conn.makefile("rb").readline().split()
            if len(line) == 2 and line[0] == b"exit":
                code = os.waitstatus_to_exitcode(int(line[1]))
        self.returncode = code
        self._done.set()
        with contextlib.suppress(OSError):
            self._conn.close()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_job(
    server: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    stdio: tuple[int, int, int] = (0, 1, 2),
    listen_fd: int | None = None,
) -> ForkedJob:
    """Runs ``argv`` in a child of the warm server ``server`` (``NAME:PID``), with
    ``stdio`` as its stdin, stdout and stderr, and ``listen_fd`` if given (a socket).

    Waits for the server to be warm (its imports done), at most ``CONNECT_S``: the
    request's own sends too, which block once its environment outgrows the socket's
    buffer while the server has not read it yet (busy, or wedged).

    Raises:
        Unavailable: the server is absent, died, or refused (the reason given).
    """
    name, _, pid = server.rpartition(":")
    conn = _connect(name, int(pid) if pid.isdigit() else 0)
    try:
        body = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode()
        fds = list(stdio) + ([listen_fd] if listen_fd is not None else [])
        conn.settimeout(CONNECT_S)
        socket.send_fds(conn, [HEADER.pack(len(body))], fds)
        conn.sendall(body)
        line = b""
        pidfd = -1
        while not line.endswith(b"\n"):
            part, got, _, _ = socket.recv_fds(conn, 256, 1)
            if not part:
                raise Unavailable("the warm process ended before answering")
            line += part
            if got:
                pidfd = got[0]
        word, _, rest = line.decode().strip().partition(" ")
        if word == "refused":
            raise Unavailable(rest)
        if word != "pid" or not rest.isdigit() or pidfd < 0:
            raise Unavailable(f"the warm process answered {line[:60]!r}")
        conn.settimeout(None)
        return ForkedJob(conn, int(rest), pidfd)
    except OSError as exc:
        conn.close()
        raise Unavailable(f"the warm process failed: {exc}") from exc
    except Unavailable:
        conn.close()
        raise


def _connect(name: str, pid: int) -> socket.socket:
    """Connects, retrying while the server runs but has not bound its socket yet, or
    has its backlog full (with a timeout set, a full backlog refuses at once, where a
    blocking connect would wait for as long as the server does not accept)."""
    deadline = time.monotonic() + 5.0
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(CONNECT_S)
        try:
            conn.connect("\0" + name)
            return conn
        except OSError as exc:
            conn.close()
            if not (pid and psutil.pid_exists(pid) and time.monotonic() < deadline):
                raise Unavailable(f"no warm process at {name} ({exc.strerror or exc})") from exc
        time.sleep(0.01)  # its socket is bound in its first milliseconds: a short retry
