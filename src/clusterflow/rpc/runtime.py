"""The ZeroMQ context of the RPC layer, and its orderly shutdown at interpreter exit.

Why an exit hook: a server's loop thread and its blocking-handler threads are daemon
threads, so that a handler that waits (a long poll, a barrier) never keeps a finished
process alive. But CPython kills a daemon thread that touches the interpreter while it
finalizes, and when that thread is inside a torch op or a deleter (C++ frames that must
not unwind) the process aborts with "terminate called without an active exception"
(exit status 134). So, before finalization, the hook stops every live server (joining
its loop thread), gives running handlers a moment to return, stops the ZAP threads,
closes the clients and terminates the context, which returns only once libzmq has
released every zero-copy message.

Why a context of our own rather than ``zmq.Context.instance()``: at exit every socket
on it is ours, so it can be terminated without closing anybody else's sockets.

Why this module tunes glibc's malloc: libzmq allocates every received frame with
malloc, and by default glibc hands a freed 4 MiB frame straight back to the kernel, so
the next message page-faults all of its memory again. Measured here, each 64 MiB call
took 16,384 minor faults on the server and 100-190 ms; keeping freed memory for reuse
cut it to no faults and 50-70 ms. Like ``ReceivePool``, this trades resident memory for
speed, so it is applied only to processes that build an RPC socket, and never over a
``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` the user set.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import platform
import threading
import time
import weakref
from typing import Any, Protocol

import zmq

# Imported for its side effect: pyzmq's zero-copy garbage collector registers its own
# exit hook on import. Ours, registered after it, runs before it (atexit is LIFO), so
# libzmq releases our zero-copy frames while that collector still listens.
import zmq.utils.garbage

from clusterflow.rpc import auth

log = logging.getLogger(__name__)

EXIT_GRACE_S = 1.0
"""How long the exit hook waits for running handlers: long enough for a torch op to
finish, short enough that a handler blocked on an event does not delay exit noticeably."""

TERM_TIMEOUT_S = 5.0
"""Most seconds the exit hook waits for libzmq to release the context."""

MALLOC_MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks below this come from malloc's reusable heap, not fresh mmaps: glibc's own
ceiling for its sliding threshold, which it reaches only by chance, set from the start so
received frames (``FRAME_BYTES``) reuse warm memory."""

MALLOC_TRIM_THRESHOLD = 256 * 1024 * 1024
"""Free memory a heap keeps before returning it to the kernel: a few large messages."""

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def _keep_freed_memory() -> None:
    """Makes glibc reuse freed receive buffers instead of returning them (see above)."""
    if platform.libc_ver()[0] != "glibc":
        return
    if "MALLOC_TRIM_THRESHOLD_" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return  # the user chose; theirs wins
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)


_SNDMORE = int(zmq.SNDMORE)  # a plain int: pyzmq's enum costs a conversion per use


def send(sock: zmq.Socket[bytes], frames: list[Any]) -> None:
    """Sends one message, part by part, tensor parts without a copy.

    ``send_multipart`` first checks every part's type in Python, a cost a no-op round
    trip notices (docs/benchmarks.md, "RPC latency"). pyzmq still copies parts under its
    ``copy_threshold`` (a header, a routing id), which costs less than a ``zmq.Frame``.
    Blocks as ``sock.send`` does (its ``SNDTIMEO``).
    """
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _SNDMORE if i < last else 0, copy=False)


class _Server(Protocol):
    def stop(self, timeout: float = ...) -> None: ...

    def _wait_handlers(self, timeout: float) -> bool: ...

    def _closed(self) -> bool: ...


class _Client(Protocol):
    def _close_at_exit(self, timeout: float) -> bool: ...


class _Runtime:
    """The context of this process and what was built on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pid = 0
        self._servers: weakref.WeakSet[_Server] = weakref.WeakSet()
        self._clients: weakref.WeakSet[_Client] = weakref.WeakSet()

    def context(self) -> zmq.Context[zmq.Socket[bytes]]:
        with self._lock:
            if self._pid != os.getpid():
                # A forked child owns none of its parent's servers, clients or context.
                self._servers.clear()
                self._clients.clear()
                self._context = None
            if self._context is None or self._context.closed:
                if self._pid != os.getpid():
                    _keep_freed_memory()  # once per process
                self._context = zmq.Context()
                self._pid = os.getpid()
            return self._context

    def shutdown(self, grace: float) -> None:
        if self._pid != os.getpid():
            return  # nothing here was built by this process (never used, or forked)
        end = time.monotonic() + grace
        servers = list(self._servers)
        for server in servers:
            server.stop()
        all_closed = all(server._closed() for server in servers)
        for server in servers:
            server._wait_handlers(max(0.0, end - time.monotonic()))
        for client in list(self._clients):
            all_closed &= client._close_at_exit(max(0.1, end - time.monotonic()))
        with self._lock:
            ctx, self._context = self._context, None
        if ctx is None or ctx.closed:
            return
        auth.stop_authenticators(ctx)
        if not all_closed:
            log.debug("rpc: sockets still in use at exit; the context is left to the OS")
            return
        # term() waits for every socket of the context; were one left open after all
        # (built on it by hand), a bounded wait keeps exit from hanging on it.
        terminator = threading.Thread(target=ctx.term, name="rpc-context-term", daemon=True)
        terminator.start()
        terminator.join(TERM_TIMEOUT_S)
        if terminator.is_alive():
            log.warning("rpc: context not terminated within %.0f s; exiting anyway", TERM_TIMEOUT_S)


_RUNTIME = _Runtime()


def context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process's RPC context (a fresh one after a fork or after ``shutdown``)."""
    return _RUNTIME.context()


def track_server(server: _Server) -> None:
    """Has ``shutdown`` stop ``server`` (held weakly)."""
    _RUNTIME.context()
    _RUNTIME._servers.add(server)


def track_client(client: _Client) -> None:
    """Has ``shutdown`` close ``client`` (held weakly)."""
    _RUNTIME.context()
    _RUNTIME._clients.add(client)


def shutdown(grace: float = EXIT_GRACE_S) -> None:
    """Stops every server, the ZAP threads and every client; terminates the context.

    Runs at interpreter exit; safe to call earlier and more than once. The context is
    terminated only when every socket on it was closed, since ``term()`` would
    otherwise wait forever for a socket in use by some other thread.
    """
    _RUNTIME.shutdown(grace)


atexit.register(shutdown)
