"""The default backend: every task is a local process.

Each supervisor leads its own session and process group, so the terminal's Ctrl-C
reaches only the manager (which then stops the tasks in order), and one ``killpg``
reaches the supervisor, the job command and anything the job started.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import IO

from clusterflow.backends.api import TaskLaunch
from clusterflow.cluster import TaskId

SUPERVISOR_MODULE = "clusterflow.backends.supervisor"


class LocalProcess:
    """A supervisor running as a child process of the manager."""

    def __init__(self, task: TaskId, popen: subprocess.Popen[bytes]) -> None:
        self._task = task
        self._popen = popen

    @property
    def task(self) -> TaskId:
        return self._task

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def output(self) -> IO[bytes] | None:
        return self._popen.stdout

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float) -> int | None:
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, signum: int) -> None:
        # The group outlives its leader when the job ignores the signal: always killpg.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signum)


class LocalBackend:
    name = "local"

    def launch(self, launch: TaskLaunch) -> LocalProcess:
        popen = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE],
            env=dict(launch.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return LocalProcess(launch.task, popen)
