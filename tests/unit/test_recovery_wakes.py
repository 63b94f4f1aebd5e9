"""A recovery starts from the event that calls for it, not from the manager's next look.

Issue 28 (launches and recoveries with nothing left to wait for): the manager's loop
looks at its tasks every ``POLL_S``; these tests take that look away (a poll of an hour)
and check that what a respawn or a restart waits for still wakes it: a supervisor's exit
after its report, a supervisor's exit seen by ``LocalProcess.wait``. And a restart of a
job that used the hosted torch store starts the next store at once, instead of when the
first restarted rank connects (docs/benchmarks.md, "Recovery by phase").
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_manager import fake_backend, fake_manager

from clusterflow.backends.local import LocalProcess
from clusterflow.cluster import TaskId
from clusterflow.manager import controller as controller_module
from clusterflow.manager.config import RunConfig
from clusterflow.manager.controller import Controller
from clusterflow.manager.policy import Decision, Verdict
from clusterflow.manager.store_host import StoreHost
from clusterflow.rpc import Credentials, RpcClient
from clusterflow.server.manager_messages import ExitedRequest
from clusterflow.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


class _Supervisor:
    """A supervisor that reported its job's exit and ends only when the test says so."""

    pid = 4242
    output = None
    memory_kill = False

    def __init__(self, task: TaskId, code: int) -> None:
        self.task = task
        self._code = code
        self.ended = threading.Event()

    def poll(self) -> int | None:
        return self._code if self.ended.is_set() else None

    def wait(self, timeout: float) -> int | None:
        self.ended.wait(timeout)
        return self.poll()

    def signal(self, signum: int) -> None:
        self.ended.set()


CREDENTIALS = Credentials.generate()


def _controller(tmp_path: Path, config: RunConfig, **kwargs: Any) -> Controller:
    backend = fake_backend(lambda launch: _Supervisor(launch.task, 0))
    return fake_manager(tmp_path, config, backend, CREDENTIALS, **kwargs)


@pytest.fixture
def no_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's look at its tasks comes once an hour: only a wake-up moves it."""
    monkeypatch.setattr(controller_module, "POLL_S", 3600.0)


def test_an_exit_reported_before_the_supervisor_ends_is_acted_on_when_it_ends(
    tmp_path: Path, no_polls: None
) -> None:
    """The supervisor reports its job's exit, then exits itself: the loop reads the
    code from the process, so its report wakes the loop too early to see it. The loop is
    woken again the moment the supervisor has ended, not at its next look."""
    controller = _controller(tmp_path, RunConfig(command=("true",), max_restarts=0))
    task = controller.tasks[TaskId.parse("worker:0")]
    supervisor = _Supervisor(task.id, 1)
    task.process = supervisor  # type: ignore[assignment]
    verdicts: list[Verdict] = []
    loop = threading.Thread(target=lambda: verdicts.append(controller._loop()), daemon=True)
    controller._rpc.start()
    try:
        loop.start()
        with RpcClient(controller._rpc.address, CREDENTIALS, deadline=10) as c:
            report = ExitedRequest(task="worker:0", code=1)
            c.call(report.METHOD, report.to_wire())
        # The report's own wake-up found the supervisor still alive: the loop sleeps on.
        wait_for(lambda: not controller._wake.is_set(), "the loop to take the wake-up", 30)
        assert loop.is_alive() and task.exit_code is None
        supervisor.ended.set()  # the supervisor exits with its job's code
        loop.join(30)
        assert not loop.is_alive(), "the loop waited for its next look"
        assert verdicts[0].decision == Decision.FAIL and task.exit_code == 1
    finally:
        controller.request_stop()
        controller._wake.set()
        controller._rpc.stop()
        controller.standby.close()
        controller.output.close()


class _Store:
    """A stand-in for one attempt's ``StoreHost``; ``started``: a rank connected."""

    def __init__(self, eager: bool, made: list[bool]) -> None:
        made.append(eager)
        self.port = 29500 + len(made)
        self.started = eager

    def close(self) -> None:
        pass


@pytest.mark.parametrize("used", [True, False], ids=["store_used", "store_unused"])
def test_a_restart_starts_the_next_store_at_once_when_the_last_attempt_used_one(
    tmp_path: Path, used: bool
) -> None:
    made: list[bool] = []
    controller = _controller(
        tmp_path, RunConfig(command=("true",)), store=lambda eager: _Store(eager, made)
    )
    try:
        controller._store = controller._new_store(False)  # as run() makes the first
        controller._store.started = used  # type: ignore[misc]
        for task in controller.tasks.values():
            controller._launch(task, None)
        controller._relaunch_all("a test's restart")
        assert made == [False, used]
        controller._relaunch_all("a test's second restart")
        assert made == [False, used, used]  # an eager store was used by definition
    finally:
        controller.standby.close()
        controller.output.close()


def test_an_eager_store_starts_its_process_with_no_rank_connected(tmp_path: Path) -> None:
    eager = StoreHost({}, eager=True)
    lazy = StoreHost({})
    try:
        wait_for(lambda: eager.started, "the eager store's process", 30)
        assert not lazy.started  # nobody connected: a job that never uses it pays nothing
    finally:
        eager.close()
        lazy.close()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    popen = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        yield popen
    finally:
        popen.kill()
        popen.wait()


def test_local_wait_returns_the_exit_code_once_the_supervisor_ends(
    sleeper: subprocess.Popen[bytes],
) -> None:
    process = LocalProcess(TaskId.parse("worker:0"), sleeper)
    assert process.wait(0.05) is None  # still running: the wait runs out
    process.signal(signal.SIGKILL)
    assert process.wait(30.0) == -signal.SIGKILL
    assert process.wait(0.0) == -signal.SIGKILL  # reaped: the code again, at once
    assert process.poll() == -signal.SIGKILL


def test_local_wait_while_another_thread_waits_too(sleeper: subprocess.Popen[bytes]) -> None:
    """The manager's loop looks (``poll``) while a waiter waits: both see the code."""
    process = LocalProcess(TaskId.parse("worker:0"), sleeper)
    codes: list[int | None] = []
    waiter = threading.Thread(target=lambda: codes.append(process.wait(30.0)), daemon=True)
    waiter.start()
    assert sleeper.stdin is not None
    sleeper.stdin.close()  # EOF: it exits 0
    assert process.wait(30.0) == 0
    waiter.join(30)
    assert codes == [0]


@pytest.mark.parametrize("warm", [True, False], ids=["warm_restarts", "cold"])
def test_warm_restarts_keep_a_standby_per_task_and_the_next_store_and_a_restart_takes_them(
    tmp_path: Path, warm: bool
) -> None:
    """Under ``--warm-restarts``, once the spec is assembled: a standby per task and the
    next attempt's store (started at once); a whole restart hands every task to a
    standby (no new supervisor launched) and runs on that store. Without it: neither."""
    made: list[bool] = []
    config = RunConfig(command=("true",), workers=2, max_restarts=2, warm_restarts=warm)
    controller = _controller(tmp_path, config, store=lambda eager: _Store(eager, made))
    launched: list[_Supervisor] = []

    def launch(launch: Any) -> _Supervisor:
        launched.append(_Supervisor(launch.task, 0))
        return launched[-1]

    controller.backend.launch = launch  # type: ignore[method-assign]
    try:
        controller._store = controller._new_store(False)
        for task in controller.tasks.values():
            controller._launch(task, None)
        controller._keep_standby()
        assert controller.standby.count() == 0  # the cluster's start: nothing kept yet
        for index, task in enumerate(controller.tasks.values()):
            controller.rendezvous.register(task.id, f"127.0.0.1:{index + 1}", respawned=False)
        controller._store.started = True  # type: ignore[misc]  # its ranks connected
        controller._keep_standby()
        standbys = launched[2:]
        assert len(standbys) == (2 if warm else 0) and controller.standby.count() == len(standbys)
        assert made == ([False, True] if warm else [False])
        spare = controller._spare_store
        controller._relaunch_all("a test's restart")
        tasks = [controller.tasks[TaskId.parse(f"worker:{i}")].process for i in range(2)]
        if warm:
            assert tasks == standbys and len(launched) == 4  # the standbys, oldest first
            assert controller._store is spare and made == [False, True]
        else:
            assert tasks == launched[2:] and len(launched) == 4  # two cold supervisors
            assert made == [False, True]  # the used store's successor, started at once
    finally:
        controller.standby.close()
        controller.output.close()


def test_warm_restarts_keep_nothing_where_ray_places_the_tasks() -> None:
    """A restart on Ray is placed anew: a standby would run outside that placement."""
    from clusterflow.manager.recovery import Recovery

    for backend, warm in (("local", True), ("ray", False)):
        config = RunConfig(command=("true",), workers=2, warm_restarts=True, backend=backend)
        assert Recovery._warm_restarts(SimpleNamespace(config=config)) is warm  # type: ignore[arg-type]
