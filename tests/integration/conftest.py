"""Fixtures for the CLI and server integration tests.

Every test gets its own ``CLUSTERFLOW_HOME`` (under ``tmp_path``), runs the CLI as a
subprocess, and is cleaned up by the ``cf`` fixture's finalizer, even when it fails:
each cluster the test created that has not ended is stopped with ``clusterflow stop``,
then any process still carrying the cluster's id in its environment (whether or not
the cluster had ended) is killed, and the finalizer fails the test if it found one: a
finished or stopped cluster must leave nothing behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import psutil
import pytest

from clusterflow.manager.registry import TERMINAL
from clusterflow.manager.stopper import cluster_processes, kill_processes
from clusterflow.testing.waiting import wait_for

if TYPE_CHECKING:
    from clusterflow.rpc import Credentials
    from clusterflow.server import Server

CLI = (sys.executable, "-m", "clusterflow.cli.main")
"""How the tests run the CLI: the module of this interpreter (the venv's script works too)."""


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls ``predicate`` until it returns something truthy; fails naming ``what``
    (``clusterflow.testing.waiting``, the benchmarks' wait too). The timeout is a safety
    net for a hung cluster, not a measurement: it is generous."""
    return wait_for(predicate, what, timeout)


class LineReader:
    """Collects a subprocess's output lines on a thread, so tests can wait for one."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, line: str, timeout: float = 60.0) -> None:
        """Blocks until ``line`` was printed (a whole line)."""
        with self._cond:
            if not self._cond.wait_for(lambda: line in self.lines, timeout):
                raise AssertionError(f"no line {line!r} within {timeout:g}s; got {self.lines!r}")

    def join(self, timeout: float = 30.0) -> list[str]:
        """Every line, once the stream reached its end."""
        self._thread.join(timeout)
        with self._cond:
            return list(self.lines)


class Clusterflow:
    """The CLI of one test, with its private home and the clusters it made."""

    def __init__(self, home: Path, workdir: Path) -> None:
        self.home = home
        self.workdir = workdir
        self.procs: list[subprocess.Popen[str]] = []

    def run(
        self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``clusterflow ARGS`` to its end; stdout and stderr captured as text."""
        return subprocess.run(
            [*CLI, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.workdir,
            env=self._env(env),
            check=False,
        )

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Starts ``clusterflow ARGS``; killed by the fixture if still running at the end."""
        proc = subprocess.Popen(
            [*CLI, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=self.workdir,
            env=self._env(env),
        )
        self.procs.append(proc)
        return proc

    def script(self, name: str, text: str) -> Path:
        path = self.workdir / name
        path.write_text(text)
        return path

    def ids(self) -> list[str]:
        root = self.home / "clusters"
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def only_id(self) -> str:
        ids = self.ids()
        assert len(ids) == 1, f"expected one cluster, found {ids}"
        return ids[0]

    def path(self, cluster_id: str) -> Path:
        return self.home / "clusters" / cluster_id

    def state(self, cluster_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.path(cluster_id) / "state.json").read_text())
        return data

    def output(self, cluster_id: str) -> str:
        path = self.path(cluster_id) / "output.log"
        return path.read_text() if path.exists() else ""

    def prefix(self, cluster_id: str) -> str:
        """The shortest prefix of ``cluster_id`` (at least 4 characters) that is unique."""
        others = [i for i in self.ids() if i != cluster_id]
        for n in range(4, len(cluster_id)):
            if not any(o.startswith(cluster_id[:n]) for o in others):
                return cluster_id[:n]
        return cluster_id

    def start_detached(self, *args: str, env: dict[str, str] | None = None) -> str:
        """``start --detach ARGS``; returns the id it printed."""
        done = self.run("start", "--detach", *args, env=env)
        assert done.returncode == 0, done.stderr
        cluster_id = done.stdout.strip()
        assert cluster_id in self.ids(), done.stdout
        return cluster_id

    def wait_output(self, cluster_id: str, *lines: str, timeout: float = 60.0) -> None:
        """Waits until every one of ``lines`` is a line of the cluster's output.log."""

        def have_all() -> bool:
            have = self.output(cluster_id).splitlines()
            return all(line in have for line in lines)

        wait_until(have_all, timeout, f"lines {lines} in the output of {cluster_id}")

    # Helpers that need no instance, reachable through the fixture (test modules do
    # not import conftest: tests/conftest.py would shadow the name).
    wait_until = staticmethod(wait_until)
    LineReader = LineReader

    @staticmethod
    def live(cluster_id: str) -> list[psutil.Process]:
        """The cluster's processes, found by the id in their environment (zombies aside)."""
        return cluster_processes(cluster_id)

    @staticmethod
    def alive(pids: list[int]) -> list[int]:
        """Which of ``pids`` still run (a zombie does not)."""
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        return alive

    @staticmethod
    def recorded_pids(state: dict[str, Any]) -> list[int]:
        """The manager's and every supervisor's pid, as state.json records them."""
        pids = [t["pid"] for t in state.get("tasks") or [] if t.get("pid")]
        manager = (state.get("manager") or {}).get("pid")
        return [*pids, manager] if manager else pids

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        return {**os.environ, **(extra or {})}


@pytest.fixture
def reserve() -> Iterator[Callable[[], str]]:
    """``reserve()`` gives a loopback address whose port this test holds until it ends.

    The socket is bound with SO_REUSEADDR and never listens, as a supervisor reserves a
    task's port (docs/architecture.md section 3): it receives no connections, nothing else
    can take the port meanwhile, and a server (ZeroMQ, torch's TCPStore) binds it
    beside the held socket. No port is bound, released and bound again.
    """
    held: list[socket.socket] = []

    def make() -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        held.append(sock)
        return f"127.0.0.1:{sock.getsockname()[1]}"

    yield make
    for sock in held:
        sock.close()


@pytest.fixture
def ps_server() -> Iterator[tuple[Server, Credentials]]:
    """A ps task served in this process on loopback, with the credentials to reach it
    (imported here, not at the top: most integration tests never start a ps)."""
    from clusterflow.ps.service import PSService
    from clusterflow.rpc import Credentials
    from clusterflow.server import create_local_server

    credentials = Credentials.generate()
    server = create_local_server(credentials=credentials)
    PSService(server)
    yield server, credentials
    server.stop()


@pytest.fixture
def cf(tmp_path: Path, home: Path, bare_env: pytest.MonkeyPatch) -> Iterator[Clusterflow]:
    """A ``clusterflow`` runner in a fresh home (``home``), no surrounding cluster's
    variables (``bare_env``, tests/conftest.py); every cluster it started is stopped and
    checked gone at the end, even when the test failed."""
    work = tmp_path / "work"
    work.mkdir()
    clusterflow = Clusterflow(home, work)
    yield clusterflow

    # Every step runs for every cluster even when an earlier one failed or timed out: a
    # cluster this test left running would eat the CPUs of every test after it.
    problems: list[str] = []
    for proc in clusterflow.procs:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            problems.append(f"CLI process {proc.pid} did not end after SIGKILL")
    left: dict[str, list[str]] = {}
    for cluster_id in clusterflow.ids():
        state = clusterflow.path(cluster_id) / "state.json"
        try:
            if not state.exists() or json.loads(state.read_text()).get("status") not in TERMINAL:
                # (`stop` of a finished cluster only says so: not worth a process.)
                clusterflow.run("stop", cluster_id, "--grace", "2", timeout=90)
        except (subprocess.TimeoutExpired, ValueError) as err:
            problems.append(f"`clusterflow stop {cluster_id}` failed: {err!r}")
        procs = cluster_processes(cluster_id)
        if procs:
            with_names = []
            for proc in procs:
                try:
                    with_names.append(f"{proc.pid} {' '.join(proc.cmdline())}")
                except psutil.Error:
                    with_names.append(str(proc.pid))
            left[cluster_id] = with_names
            kill_processes(procs, 0.5)
    still = {c: [p.pid for p in cluster_processes(c)] for c in clusterflow.ids()}
    assert not problems, f"cleanup problems: {problems}"
    assert not left, f"processes left after `clusterflow stop`: {left}"
    assert not any(still.values()), f"processes that survived SIGKILL: {still}"
