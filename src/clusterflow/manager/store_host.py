"""The manager's side of torch's TCPStore for ``MASTER_PORT`` (the store: ``store.py``).

torchrun's agent hosts the store on ``MASTER_PORT`` and tells every rank to connect as
a client (``TORCHELASTIC_USE_AGENT_STORE=True``); clusterflow does the same.

``StoreHost`` (in the manager) reserves the port at once, bound and listening, so the
port in every task's environment is never free for another process to take. The store
itself runs in a helper process, ``python -m clusterflow.manager.store FD``, that adopts
that socket: importing torch takes ~2.5 s of CPU holding the GIL, which would stall the
manager's RPC loop while tasks register. That process is started only when the first
rank connects (a job that never calls ``init_process_group`` never pays for the
import); the ranks that connect before it is up wait in the socket's accept queue,
which the store inherits with the socket. The helper exits when its stdin (a pipe from
the manager) closes, so it never outlives the manager. Where this process runs the
warm fork server (``backends/forkserver.py``), or a Ray agent that hosts this manager
lent it its own (``forkserver.lend``), the helper is forked from it, torch already
imported: the ranks then wait for no store's import (on Ray, most of a second).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO

from clusterflow.backends import forkserver
from clusterflow.backends.forked import ForkedJob, Unavailable, fork_job

STORE_MODULE = "clusterflow.manager.store"
"""Not imported here: ``python -m`` of a module its package already imported warns."""
ACCEPT_BACKLOG = 1024
"""Ranks that may wait for the store process to come up: more than one host's worth."""


class StoreHost:
    """The manager's side of the store: the reserved port, and the process once needed.

    Call ``close()`` once the cluster's tasks are gone; it stops the store process (or
    makes sure it never starts) and frees the port.

    Args:
        env: the store process's environment.
        host: interface to bind; local clusters use loopback.
        eager: start the store process now, not when the first rank connects (its
            ranks are known to connect: the attempt before used the store).
    """

    def __init__(
        self, env: Mapping[str, str], host: str = "127.0.0.1", *, eager: bool = False
    ) -> None:
        self._env = dict(env)
        self._eager = eager
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(ACCEPT_BACKLOG)
        self.port: int = self._sock.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._closed = False
        self._proc: subprocess.Popen[bytes] | ForkedJob | None = None
        self._stdin: IO[bytes] | None = None
        """The helper's stdin: it exits when this closes."""
        self._thread = threading.Thread(target=self._start_on_demand, name="torch-store")
        self._thread.daemon = True
        self._thread.start()

    @property
    def started(self) -> bool:
        """Whether a rank connected and the store process was started for it."""
        return self._proc is not None

    def close(self, timeout: float = 5.0) -> None:
        """Stops the store process, or keeps it from starting; frees the port."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join()
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()
        proc = self._proc
        if proc is None:
            return
        # Nothing in the store is worth a clean shutdown once the tasks are gone; do not
        # wait for a store process that may still be importing torch.
        with contextlib.suppress(OSError):
            assert self._stdin is not None
            self._stdin.close()
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _start_on_demand(self) -> None:
        if not self._eager:
            with selectors.DefaultSelector() as selector:
                selector.register(self._sock, selectors.EVENT_READ)
                selector.register(self._wake_r, selectors.EVENT_READ)
                ready = {key.fileobj for key, _ in selector.select()}
            if self._sock not in ready:
                return
        with self._lock:
            if self._closed:
                return
            fd = self._sock.fileno()
            self._proc = self._fork(fd)
            if self._proc is None:
                popen = subprocess.Popen(
                    [sys.executable, "-m", STORE_MODULE, str(fd)],
                    stdin=subprocess.PIPE,
                    pass_fds=(fd,),
                    env=self._env,
                    start_new_session=True,
                )
                self._proc, self._stdin = popen, popen.stdin
            self._sock.close()  # the store holds the port from now on

    def _fork(self, fd: int) -> ForkedJob | None:
        """The helper forked from the warm server, or None (start it as before)."""
        server = forkserver.address()
        if server is None:
            return None
        read_end, write_end = os.pipe()
        try:
            job = fork_job(
                server,
                [sys.executable, "-m", STORE_MODULE, "env"],
                self._env,
                os.getcwd(),
                stdio=(read_end, 1, 2),
                listen_fd=fd,
            )
        except Unavailable:
            os.close(write_end)
            return None
        finally:
            os.close(read_end)
        self._stdin = os.fdopen(write_end, "wb")
        return job
