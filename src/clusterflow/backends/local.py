"""The default backend: every task is a local process.

Each supervisor leads its own session and process group, so the terminal's Ctrl-C
reaches only the manager (which then stops the tasks in order), and one ``killpg``
reaches the supervisor, the job command and anything the job started.

Where this process started the warm fork server (``forkserver.py``: ``clusterflow
start``, a detached manager), each supervisor is forked from it instead of started as a
new Python: torch is then already imported in the supervisor, which forks its job from
itself (``zygote.fork_zygote``), so no local job pays ``import torch``. The supervisor
is then the server's child, not this process's: its exit status comes over the
server's socket (``forked.ForkedJob``). Without a server, or when it is gone, a
supervisor starts as before (one warning says so).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

from clusterflow.backends import forkserver
from clusterflow.backends.api import TaskLaunch, TaskProcess
from clusterflow.backends.forked import ForkedJob, Unavailable, fork_job
from clusterflow.backends.gpu_topology import (
    Topology,
    read_topology,
    split,
    visible_gpus,
)
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import CUDA_VISIBLE_DEVICES

log = logging.getLogger(__name__)

SUPERVISOR_MODULE = "clusterflow.backends.supervisor"


class LocalProcess:
    """A supervisor running as a child process of the manager (or of its warm fork
    server: ``forked`` and ``output``, the read end of its stdout's pipe, given)."""

    def __init__(
        self,
        task: TaskId,
        popen: subprocess.Popen[bytes] | None,
        forked: ForkedJob | None = None,
        output: IO[bytes] | None = None,
    ) -> None:
        self._task = task
        self._popen = popen
        self._forked = forked
        self._output = output

    @property
    def task(self) -> TaskId:
        return self._task

    @property
    def pid(self) -> int:
        if self._forked is not None:
            return self._forked.pid
        assert self._popen is not None
        return self._popen.pid

    @property
    def output(self) -> IO[bytes] | None:
        if self._forked is not None:
            return self._output
        assert self._popen is not None
        return self._popen.stdout

    def poll(self) -> int | None:
        if self._forked is not None:
            return self._forked.poll()
        assert self._popen is not None
        return self._popen.poll()

    @property
    def memory_kill(self) -> bool:
        return False  # local tasks ask for no memory: nothing to grow

    def wait(self, timeout: float) -> int | None:
        """Blocks up to ``timeout`` seconds for the exit; None if still running.

        Woken by the exit itself (a pidfd turns readable), not found by a later look:
        ``Popen.wait(timeout)`` sleeps between looks, up to 50 ms each, which a whole
        restart paid once per task it stopped (docs/benchmarks.md, "Recovery by phase").
        A forked supervisor's exit is reported by the server the moment it reaped it.
        """
        if self._forked is not None:
            try:
                return self._forked.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        assert self._popen is not None
        code = self._popen.poll()
        if code is not None:
            return code
        try:
            exit_fd = os.pidfd_open(self._popen.pid)
        except OSError:  # reaped meanwhile by another thread's look, or no pidfd here
            return self._popen_wait(timeout)
        try:
            exited, _, _ = select.select([exit_fd], [], [], timeout)
        finally:
            os.close(exit_fd)
        if not exited:
            return self._popen.poll()
        return self._popen.wait()  # exited: reaped at once (or already, by a look)

    def _popen_wait(self, timeout: float) -> int | None:
        assert self._popen is not None
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, signum: int) -> None:
        # The group outlives its leader when the job ignores the signal: always killpg.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)  # a forked one leads its own session too


class LocalBackend:
    """Supervisors as child processes.

    Args:
        gpus: each task's ``CUDA_VISIBLE_DEVICES`` (``split_gpus``); tasks left out see
            what the manager sees.
    """

    name = "local"

    def __init__(self, gpus: Mapping[str, str] | None = None) -> None:
        self.gpus = dict(gpus or {})
        self._warned = False

    @classmethod
    def split_gpus(
        cls,
        wants: Sequence[tuple[TaskId, int]],
        env: Mapping[str, str] = os.environ,
        topology: Topology | bool | None = True,
    ) -> LocalBackend:
        """A backend giving each task in ``wants`` its own ``n`` GPUs of this machine,
        chosen by topology (``gpu_topology.split``; ``topology`` True: read it here).
        Without GPUs, or with too few for every task, tasks share them as before."""
        links = read_topology() if topology is True else topology or None
        visible = visible_gpus(env, links)
        wanted = [(task, n) for task, n in wants if n > 0]
        if not visible or not wanted:
            return cls()
        try:
            groups = split(links, visible, [n for _, n in wanted])
        except ValueError as exc:
            log.warning("GPUs not split between tasks (they share them): %s", exc)
            return cls()
        return cls(
            {str(task): ",".join(map(str, g)) for (task, _), g in zip(wanted, groups, strict=True)}
        )

    def job_env(self, task: TaskId) -> dict[str, str]:
        """The task's own GPUs, if the machine's were split."""
        gpus = self.gpus.get(str(task))
        return {CUDA_VISIBLE_DEVICES: gpus} if gpus is not None else {}

    def launch(self, launch: TaskLaunch) -> LocalProcess:
        forked = self._fork(launch)
        if forked is not None:
            return forked
        popen = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE],
            env=dict(launch.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return LocalProcess(launch.task, popen)

    def _fork(self, launch: TaskLaunch) -> LocalProcess | None:
        """The supervisor forked from the warm server, or None: start it as before.

        Blocks until the server is warm (its imports done) on the first launch: that
        wait replaces the supervisor's and its job's own start-up."""
        server = forkserver.address()
        if server is None:
            return None
        read_end, write_end = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            job = fork_job(
                server,
                [sys.executable, "-m", SUPERVISOR_MODULE],
                launch.env,
                os.getcwd(),
                stdio=(null, write_end, write_end),
            )
        except Unavailable as exc:
            os.close(read_end)
            if not self._warned:
                self._warned = True
                log.warning("tasks start their own Python (%s)", exc)
            return None
        finally:
            os.close(null)
            os.close(write_end)
        return LocalProcess(launch.task, None, job, os.fdopen(read_end, "rb"))

    def adopt(self, process: TaskProcess, task: TaskId) -> None:
        """Nothing to do: the manager's own records say which task a process runs."""

    def reserve(self, tasks: Sequence[TaskId]) -> None:
        """Nothing to hold: a local task takes this machine's room when it starts."""

    def release(self, task: TaskId) -> None:
        """Nothing was held for it."""


class LocalLauncher:
    """``--backend local``'s tasks: child processes of a manager on this machine, each
    given GPUs of its own where the machine has enough (``LocalBackend.split_gpus``)."""

    def check(self, config: Any) -> None:
        """Nothing to check before the cluster's folder is made: this machine is here."""

    def backend(self, config: Any) -> tuple[Any, LocalBackend]:
        """``config`` unchanged (a ``RunConfig``), and a backend with its GPUs split."""
        return config, LocalBackend.split_gpus(config.gpu_hosts())
