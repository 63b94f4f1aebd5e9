"""A warm Python process that becomes a job: torch already imported, command not yet known.

``python -m clusterflow.backends.zygote``: started by a standby supervisor (see
``supervisor.py``) long before anything fails. It imports torch and clusterflow's
training modules (about 2.5 s of CPU on a small machine: most of a replacement
worker's start), then waits for one line on stdin: the JSON ``{"argv", "env", "cwd"}``
of the job a dead task ran. It then takes that environment and runs the command in this
process, as ``python`` would have. EOF instead of a line ends it with status 0.

``fork_zygote`` is the other kind: a zygote forked from a supervisor that was itself
forked from the warm fork server (``forkserver.py``), so it costs no start and no
import at all; ``become`` makes it look like a fresh interpreter to its job. A standby
supervisor forked so keeps this kind too (``warm=True``): the fork then imports and
warms what a ``python -m`` zygote would, from torch already imported, and says so on
a pipe, as the other kind does. (Before, every local standby started a Python of its
own and imported torch again: about 2 s of CPU per standby, taken from the running
tasks, once per cluster that may respawn and once per task under ``--warm-restarts``.)

Only commands this interpreter can run in-process qualify (:func:`runnable`):
``python SCRIPT ARGS``, ``python -m MODULE ARGS`` and ``python -c CODE ARGS``, with this
very interpreter and at most ``-u`` before them. Variables read once at import (such as
``OMP_NUM_THREADS`` for torch's thread pool) take the zygote's values, which are the
same cluster environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

from clusterflow.cluster.contract import ENV_ZYGOTE_READY_FD, PYTHONUNBUFFERED

PRELOAD = ("torch", "clusterflow.strategies", "clusterflow.strategies.parameter_server.strategy")
FLAGS_OK = frozenset({"-u"})
PR_SET_PDEATHSIG = 1
_KEEP: list[object] = []
"""Std streams replaced by ``become``, kept: collecting one would close fds 0-2."""


def runnable(command: Sequence[str], executable: str = sys.executable) -> bool:
    """Whether a zygote of ``executable`` can run ``command`` in-process."""
    if not command or not _same_interpreter(command[0], executable):
        return False
    rest = list(command[1:])
    while rest and rest[0] in FLAGS_OK:
        rest.pop(0)
    if not rest:
        return False
    if rest[0] in ("-m", "-c"):
        return len(rest) >= 2
    return not rest[0].startswith("-")


def _same_interpreter(program: str, executable: str) -> bool:
    if program == executable:
        return True
    try:
        return os.path.samefile(program, executable)
    except OSError:
        return False


def run_command(argv: list[str]) -> None:
    """Runs ``argv`` (a :func:`runnable` command) in this process, as ``python`` would."""
    rest = argv[1:]
    while rest and rest[0] in FLAGS_OK:
        rest.pop(0)
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    elif rest[0] == "-c":
        sys.argv = ["-c", *rest[2:]]
        sys.path[0] = ""
        code = compile(rest[1], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(rest)
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))
        runpy.run_path(rest[0], run_name="__main__")


def die_with(parent: int) -> None:
    """SIGKILL to this process when ``parent`` dies (``PR_SET_PDEATHSIG``; it follows
    the parent's thread that forked us, so fork only from a thread that lives as long
    as its process); ends now if it already died (the race before ``prctl``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(137)


def become(env: Mapping[str, str], cwd: str, argv: Sequence[str]) -> None:
    """Makes this forked process look like a fresh ``python`` for ``argv``: its
    environment, folder, std streams (buffered as ``-u``/``PYTHONUNBUFFERED`` say) and
    its own random state (``random`` reseeds itself after a fork; numpy's does not)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    show_as(argv)
    _streams(bool(env.get(PYTHONUNBUFFERED)) or "-u" in argv[1:2])
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # type: ignore[attr-defined]


TITLE_ROOM = " " * 4096
"""The warm server's last argument: room in its command line's memory, which every
process forked from it rewrites with its own command (:func:`show_as`)."""


def show_as(argv: Sequence[str]) -> None:
    """Makes ``ps``, ``pgrep -f`` and ``/proc/PID/cmdline`` show ``argv`` for this forked
    process, not the command of the process it was forked from: the job's own command,
    arguments apart (NUL between them), as a fresh ``python`` would show.

    The kernel shows the memory that held this process's arguments at its start (the
    ``arg_start``-``arg_end`` range of ``/proc/self/stat``); Python copied them out long
    ago, so that memory is free to rewrite (as ``setproctitle`` does). A command longer
    than the room (the warm server's, ``TITLE_ROOM`` included) is cut to fit; where the
    range cannot be read, the title stays the parent's.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)
    except (OSError, ValueError, IndexError):
        return
    room = end - start
    if room < 2:
        return
    title = b"\0".join(os.fsencode(a) for a in argv)[: room - 1]
    ctypes.memmove(start, title.ljust(room, b"\0"), room)


def _streams(unbuffered: bool) -> None:
    """Fresh ``sys.stdin``/``stdout``/``stderr`` on fds 0-2, buffered as a new Python's."""
    _KEEP.extend([sys.stdin, sys.stdout, sys.stderr])
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"

    def writer(fd: int, errors: str, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        buffer: io.RawIOBase | io.BufferedWriter = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffer,  # type: ignore[arg-type]
            encoding=encoding,
            errors=errors,
            line_buffering=line,
            write_through=unbuffered,
        )

    sys.stdin = open(0, encoding=encoding, closefd=False)  # noqa: SIM115
    sys.stdout = writer(1, "strict", os.isatty(1))
    sys.stderr = writer(2, "backslashreplace", True)
    # The originals too: a job (faulthandler, a logger) may write to them.
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]


class ForkedZygote:
    """A zygote forked from this (warm, still single-threaded) process: a direct child
    waiting for its command on a pipe, seen as a ``Popen`` (``stdin``: that pipe).
    ``ready``: the pipe a warming one writes ``1`` on once warm (EOF: it died)."""

    def __init__(self, pid: int, command: int, ready: int | None = None) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = os.fdopen(command, "wb")
        self.ready: IO[bytes] | None = None if ready is None else os.fdopen(ready, "rb")
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
                    os.close(self._pidfd)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Woken by the exit (the pidfd turns readable); ``TimeoutExpired`` as Popen's."""
        with self._lock:
            fd = -1 if self.returncode is not None else os.dup(self._pidfd)
        if fd >= 0:
            try:
                exited, _, _ = select.select([fd], [], [], timeout)
            finally:
                os.close(fd)
            if not exited:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def send_signal(self, signum: int) -> None:
        with self._lock:
            if self.returncode is None:  # not reaped: the pid is still ours
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_zygote(warm: bool = False) -> tuple[ForkedZygote | None, dict[str, object] | None]:
    """Forks a zygote of this process; call before this process starts any thread.

    In the parent: ``(zygote, None)``. In the child: ``(None, request)`` once the parent
    wrote the job's ``{"argv", "env", "cwd"}`` and closed the pipe, already
    ``become`` that job (the caller then runs ``request["argv"]`` and returns, so
    the interpreter ends as the job's would); EOF alone ends the child with status 0.
    The child dies with its parent (``die_with``).

    ``warm``: for a job that comes much later (a standby's), the child first imports
    and warms what :func:`main` does, then writes ``1`` on ``zygote.ready``. A job
    given at once (a first launch's) would wait behind that, so it is not done then.
    """
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe() if warm else (None, None)
    parent = os.getpid()
    pid = os.fork()
    if pid:
        os.close(read_end)
        if ready_write is not None:
            os.close(ready_write)
        return ForkedZygote(pid, write_end, ready_read), None
    os.close(write_end)
    die_with(parent)
    if ready_read is not None and ready_write is not None:
        os.close(ready_read)
        try:
            _warm(ready_write)
        except BaseException:  # never return into the supervisor's code as a second one
            os._exit(1)  # its supervisor reads EOF: not warm, a task given to it starts cold
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    if not data:
        os._exit(0)
    request = json.loads(data)
    become(request["env"], request["cwd"], request["argv"])
    return None, request


def _warm_up() -> None:
    """One tiny training step: torch imports more on first use (an optimizer's first
    construction alone pulls in torch._dynamo, seconds on a small machine). The RNG
    state is put back, so the job draws what it would have drawn in a fresh process."""
    import torch

    state = torch.get_rng_state()
    layer = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.set_rng_state(state)


def _warm(ready: int | None) -> None:
    """Imports ``PRELOAD`` and warms them up, then says so on ``ready`` (if given)."""
    for name in PRELOAD:
        __import__(name)
    _warm_up()
    if ready is not None:  # tell the standby supervisor: warm now
        os.write(ready, b"1")
        os.close(ready)


def main() -> None:
    ready = os.environ.pop(ENV_ZYGOTE_READY_FD, None)
    _warm(int(ready) if ready else None)
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    request = json.loads(line)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the job's stdin, as the supervisor gives it
    run_command(list(request["argv"]))


if __name__ == "__main__":
    main()
