"""Local tasks forked from the warm fork server (backends/forkserver.py, issue 28).

Each supervisor is forked from one Python that imported torch once; it forks its job's
zygote, which runs the job in-process. These pin what that path must keep: the job is
the supervisor's own child and finds torch imported; exit codes and fatal signals are
reported as before; the job dies when its supervisor or its manager dies; a command
that cannot run in-process still runs; and without the server (killed, or turned off)
tasks start as before.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from clusterflow.backends import forkserver
from clusterflow.backends.api import TaskLaunch
from clusterflow.backends.forked import fork_job
from clusterflow.backends.local import LocalBackend
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import ENV_CLUSTER_ID, ENV_WARM_FORK
from clusterflow.testing.waiting import wait_for

if TYPE_CHECKING:
    from conftest import Clusterflow

PY = sys.executable
pytestmark = pytest.mark.integration

PROBE = """
import gc, json, os, sys
warm = "torch" in sys.modules  # before this script imports anything of its own
later = [m for m in sys.argv[2:] if m in sys.modules]
record = {
    "rank": os.environ["RANK"], "warm": warm, "later": later, "gc": gc.isenabled(),
    "frozen": gc.get_freeze_count(), "pid": os.getpid(), "ppid": os.getppid(),
    "pgid": os.getpgid(0), "stdin": sys.stdin.read(), "cwd": os.getcwd(),
    "listen_fd": os.environ.get("CLUSTERFLOW_LISTEN_FD"),
    "fd_open": os.path.exists(f"/proc/self/fd/{os.environ.get('CLUSTERFLOW_LISTEN_FD')}"),
    "argv": sys.argv[1:2],
}
for who, pid in (("cmdline", "self"), ("parent_cmdline", os.getppid())):  # as ps shows
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        record[who] = [a.decode() for a in f.read().rstrip(b"\\0").split(b"\\0")]
print("probe " + json.dumps(record), flush=True)
sys.exit(int(os.environ["RANK"]) + 3)  # worker:0 exits 3, worker:1 exits 4
"""

GATED = """
import os, sys, time
print("job", os.environ["RANK"], os.getpid(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""

SUICIDE = """
import os, signal
os.kill(os.getpid(), signal.SIGSEGV)
"""


def _probes(stdout: str) -> dict[str, dict[str, object]]:
    records = [
        json.loads(line.split("probe ", 1)[1]) for line in stdout.splitlines() if "probe " in line
    ]
    return {str(r["rank"]): r for r in records}


@pytest.mark.timeout(120)
def test_a_job_is_its_supervisors_child_with_torch_already_imported(cf: Clusterflow) -> None:
    script = cf.script("probe.py", PROBE)

    later = forkserver.PRELOAD_LATER
    done = cf.run("start", "--workers", "2", "--grace", "5", "--", PY, str(script), "a b", *later)

    probes = _probes(done.stdout)
    assert set(probes) == {"0", "1"}, done.stdout + done.stderr
    state = cf.state(cf.only_id())
    supervisors = {t["task"]: t["pid"] for t in state["tasks"]}
    for rank, probe in probes.items():
        assert probe["warm"] is True, probe  # the import was paid once, in the server
        # Collected here, but never the server's imports (frozen before the fork).
        assert probe["gc"] is True and probe["frozen"] > 10_000, probe
        # A cluster that never restarts has the server import nothing more: not even
        # while it launched (the second supervisor's request waited for that import).
        assert probe["later"] == [], probe
        assert probe["ppid"] == supervisors[f"worker:{rank}"], (probe, supervisors)
        assert probe["pgid"] == probe["ppid"]  # in its supervisor's group, as before
        assert probe["stdin"] == "" and probe["cwd"] == str(cf.workdir)
        assert probe["fd_open"] is True and probe["argv"] == ["a b"]
        # ps shows each process's own command, not the server's it was forked from.
        assert probe["cmdline"] == [PY, str(script), "a b", *later], probe
        assert probe["parent_cmdline"] == [PY, "-m", "clusterflow.backends.supervisor"], probe
    # Exit codes as before: the first failure is the run's.
    assert done.returncode in (3, 4), done.stderr
    tasks = {t["task"]: t for t in state["tasks"]}
    assert {tasks["worker:0"]["exit_code"], tasks["worker:1"]["exit_code"]} & {3, 4}
    assert not cf.live(cf.only_id())


@pytest.mark.timeout(120)
def test_a_fatal_signal_of_a_forked_job_is_reported_as_that_signal(cf: Clusterflow) -> None:
    script = cf.script("suicide.py", SUICIDE)

    done = cf.run("start", "--", PY, str(script))

    state = cf.state(cf.only_id())
    (task,) = state["tasks"]
    assert task["exit_code"] == -signal.SIGSEGV, (state, done.stderr)
    assert state["status"] == "failed"


@pytest.mark.timeout(120)
def test_a_command_that_cannot_run_in_process_still_runs(cf: Clusterflow) -> None:
    done = cf.run("start", "--", "sh", "-c", 'echo "shell $RANK $CLUSTERFLOW_TASK"')

    assert done.returncode == 0, done.stderr
    assert "[worker:0] shell 0 worker:0" in done.stdout.splitlines()


def _job_of(cf: Clusterflow, cluster_id: str, task: str) -> tuple[int, int]:
    """(supervisor pid, job pid) of ``task``, once its job printed its line."""
    line = next(
        line for line in cf.output(cluster_id).splitlines() if line.startswith(f"[{task}] job ")
    )
    supervisor = next(t["pid"] for t in cf.state(cluster_id)["tasks"] if t["task"] == task)
    return supervisor, int(line.split()[-1])


@pytest.mark.timeout(120)
def test_the_job_dies_when_its_supervisor_is_killed_even_with_no_manager_left(
    cf: Clusterflow,
) -> None:
    script = cf.script("gated.py", GATED)
    never = str(cf.workdir / "never")
    cluster_id = cf.start_detached("--workers", "2", "--", PY, str(script), never)
    cf.wait_until(lambda: "[worker:1] job 1 " in cf.output(cluster_id), 90, "worker:1's job")
    supervisor, job = _job_of(cf, cluster_id, "worker:1")
    assert psutil.Process(job).ppid() == supervisor
    # No manager to end the supervisor's process group: only the job's own tie to its
    # supervisor (PR_SET_PDEATHSIG) can end it now (the manager timeout is 15 s, and
    # worker:1's supervisor, which would act on it, is the one killed).
    manager = cf.state(cluster_id)["manager"]["pid"]
    os.kill(manager, signal.SIGKILL)
    cf.wait_until(lambda: not cf.alive([manager]), 30, "the manager to die")

    os.kill(supervisor, signal.SIGKILL)

    cf.wait_until(lambda: not cf.alive([job]), 30, "the job to die with its supervisor")
    assert cf.run("stop", cluster_id, "--grace", "5").returncode == 0


@pytest.mark.timeout(120)
def test_the_jobs_and_the_server_end_when_the_manager_dies(cf: Clusterflow) -> None:
    script = cf.script("gated.py", GATED)
    never = str(cf.workdir / "never")
    cluster_id = cf.start_detached(
        "--workers", "2", "--", PY, str(script), never, env={"CLUSTERFLOW_MANAGER_TIMEOUT": "1"}
    )
    cf.wait_until(lambda: "[worker:1] job 1 " in cf.output(cluster_id), 90, "worker:1's job")
    cf.wait_until(lambda: "[worker:0] job 0 " in cf.output(cluster_id), 90, "worker:0's job")
    jobs = [_job_of(cf, cluster_id, f"worker:{i}")[1] for i in range(2)]
    manager = cf.state(cluster_id)["manager"]["pid"]
    # Forked processes keep the server's command line: the server is the manager's child.
    servers = [p for p in cf.live(cluster_id) if p.ppid() == manager]
    assert len(servers) == 1 and "forkserver" in " ".join(servers[0].cmdline()), servers

    os.kill(manager, signal.SIGKILL)

    cf.wait_until(lambda: not cf.alive(jobs), 60, "the jobs to end without their manager")
    cf.wait_until(lambda: not cf.live(cluster_id), 60, "every process of the cluster to end")


@pytest.mark.timeout(120)
def test_without_the_server_tasks_start_as_before(cf: Clusterflow) -> None:
    script = cf.script("probe.py", PROBE)

    done = cf.run("start", "--", PY, str(script), env={ENV_WARM_FORK: "0"})

    probes = _probes(done.stdout)
    assert probes["0"]["warm"] is False, done.stdout + done.stderr  # its own interpreter
    assert done.returncode == 3


@pytest.mark.timeout(120)
def test_a_server_killed_before_the_launch_leaves_the_launch_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV_WARM_FORK, raising=False)
    monkeypatch.setenv(ENV_CLUSTER_ID, "f0f0f0f0f0")
    address = forkserver.ensure()
    assert address is not None
    server = int(address.rsplit(":", 1)[1])
    try:
        os.kill(server, signal.SIGKILL)
        psutil.Process(server).wait(30)
        caplog.set_level(logging.WARNING)
        # A supervisor with no manager to find: it says so and exits 2, started cold.
        process = LocalBackend().launch(
            TaskLaunch(task=TaskId.parse("worker:0"), env={"PATH": os.environ["PATH"]})
        )
        assert process.wait(60) == 2
        assert process.output is not None
        assert b"supervisor started without" in process.output.read()
        warnings = [r.getMessage() for r in caplog.records if "warm fork server" in r.getMessage()]
        assert len(warnings) == 1, caplog.records
    finally:
        forkserver.stop()


ATTEMPTS = """
import os, sys, time
warm = "torch" in sys.modules
print("job", os.environ["RANK"], "attempt", os.environ["CLUSTERFLOW_ATTEMPT"], warm, flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


@pytest.mark.timeout(180)
def test_a_server_killed_under_running_tasks_takes_them_down_and_the_restart_starts_cold(
    cf: Clusterflow,
) -> None:
    script = cf.script("attempts.py", ATTEMPTS)
    gate = cf.workdir / "gate"
    cluster_id = cf.start_detached(
        "--workers", "2", "--max-restarts", "1", "--", PY, str(script), str(gate)
    )
    cf.wait_output(
        cluster_id, "[worker:0] job 0 attempt 0 True", "[worker:1] job 1 attempt 0 True", timeout=90
    )
    manager = cf.state(cluster_id)["manager"]["pid"]
    (server,) = [p for p in cf.live(cluster_id) if p.ppid() == manager]
    supervisors = [t["pid"] for t in cf.state(cluster_id)["tasks"]]

    server.kill()

    cf.wait_until(lambda: not cf.alive(supervisors), 30, "the supervisors to die with it")
    # Restarted as before: each job its own Python, torch not imported ahead of it.
    cf.wait_output(
        cluster_id,
        "[worker:0] job 0 attempt 1 False",
        "[worker:1] job 1 attempt 1 False",
        timeout=120,
    )
    gate.touch()
    cf.wait_until(
        lambda: cf.state(cluster_id).get("status") in ("succeeded", "failed"), 90, "the end"
    )
    assert cf.state(cluster_id)["status"] == "succeeded", cf.output(cluster_id)[-2000:]
    cf.wait_until(lambda: not cf.alive([manager]), 60, "the manager to exit")
    log = (cf.path(cluster_id) / "manager.log").read_text()
    assert log.count("the warm fork server exited") == 1, log[-3000:]


@pytest.mark.timeout(120)
def test_a_dead_foreground_managers_forked_tasks_carry_its_cluster_id(cf: Clusterflow) -> None:
    script = cf.script("gated.py", GATED)
    start = cf.popen("start", "--workers", "2", "--", PY, str(script), str(cf.workdir / "never"))

    def both_running() -> bool:
        ids = cf.ids()
        output = cf.output(ids[0]) if ids else ""
        return "[worker:0] job 0 " in output and "[worker:1] job 1 " in output

    cf.wait_until(both_running, 90, "both jobs")
    cluster_id = cf.only_id()
    jobs = [_job_of(cf, cluster_id, f"worker:{i}")[1] for i in range(2)]

    start.kill()  # the CLI is the manager: what `clusterflow stop` must find now
    start.wait(30)

    # The id is in the server's environment from the CLI's first instant on, before the
    # cluster was made, so its forks show it in /proc/PID/environ.
    found = {p.pid for p in cf.live(cluster_id)}
    assert set(jobs) <= found, (jobs, found)
    stopped = cf.run("stop", cluster_id, "--grace", "5")
    assert stopped.returncode == 0, stopped.stderr
    assert not cf.alive(jobs)


DDP_GATED = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
print("joined", dist.get_rank(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_the_torch_store_is_forked_from_the_server_too(cf: Clusterflow) -> None:
    script = cf.script("ddp.py", DDP_GATED)
    gate = cf.workdir / "gate"
    cluster_id = cf.start_detached("--workers", "2", "--", PY, str(script), str(gate))
    cf.wait_output(cluster_id, "[worker:0] joined 0", "[worker:1] joined 1", timeout=120)
    manager = cf.state(cluster_id)["manager"]["pid"]
    (server,) = [p for p in cf.live(cluster_id) if p.ppid() == manager]
    supervisors = {t["pid"] for t in cf.state(cluster_id)["tasks"]}

    others = [p.pid for p in server.children() if p.pid not in supervisors]

    # The store's helper: a fork, so the ranks waited for no `import torch` of its own.
    assert len(others) == 1, (others, supervisors)
    gate.touch()
    cf.wait_until(
        lambda: cf.state(cluster_id).get("status") in ("succeeded", "failed"), 90, "the end"
    )
    assert cf.state(cluster_id)["status"] == "succeeded", cf.output(cluster_id)[-2000:]
    cf.wait_until(lambda: not cf.alive([manager]), 60, "the manager to exit")


@pytest.mark.timeout(120)
def test_a_start_run_from_inside_a_task_makes_a_cluster_of_its_own(cf: Clusterflow) -> None:
    outer = "0123456789"  # the cluster id a task's environment carries

    done = cf.run("start", "--", PY, "-c", "print('inner')", env={ENV_CLUSTER_ID: outer})

    assert done.returncode == 0, done.stderr
    assert "[worker:0] inner" in done.stdout.splitlines()
    assert cf.only_id() != outer


LATER_PROBE = "import json, sys; print(json.dumps([m for m in sys.argv[1:] if m in sys.modules]))"


@pytest.fixture
def server() -> Iterator[str]:
    """A warm server of this test's own process (as `clusterflow start` has one)."""
    address = forkserver.ensure()
    assert address is not None
    try:
        yield address
    finally:
        forkserver.stop()


def _imported_later(server: str, env: dict[str, str] | None = None) -> list[str]:
    """Which of ``PRELOAD_LATER`` a job forked now by ``server`` finds imported (it
    waits for an import the server is in the middle of)."""
    read, write = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    env = dict(os.environ) if env is None else env
    try:
        argv = [PY, "-c", LATER_PROBE, *forkserver.PRELOAD_LATER]
        job = fork_job(server, argv, env, os.getcwd(), stdio=(null, write, write))
    finally:
        os.close(null)
        os.close(write)
    with os.fdopen(read) as out:
        text = out.read()
    assert job.wait(60) == 0, text
    return list(json.loads(text))


def _wait_all_imported(server: str, env: dict[str, str] | None = None) -> None:
    """Until a job forked by ``server`` finds all of ``PRELOAD_LATER`` imported."""
    later = list(forkserver.PRELOAD_LATER)
    wait_for(lambda: _imported_later(server, env) == later, "preloaded modules", 200)


@pytest.mark.timeout(240)
def test_the_server_imports_more_only_once_asked_and_then_all_of_it(server: str) -> None:
    # Between these the server idles: before it is asked, it imports nothing more.
    assert _imported_later(server) == []
    assert _imported_later(server) == []

    forkserver.preload_later()

    # Then one module at a time, between requests: a job forked later finds them all.
    _wait_all_imported(server)


@pytest.mark.timeout(240)
def test_a_cluster_that_may_restart_has_its_server_import_what_a_restart_needs(
    cf: Clusterflow,
) -> None:
    script = cf.script("gated.py", GATED)
    gate = cf.workdir / "gate"
    cluster_id = cf.start_detached("--max-restarts", "1", "--", PY, str(script), str(gate))
    cf.wait_until(lambda: "[worker:0] job 0 " in cf.output(cluster_id), 120, "the job")
    manager = cf.state(cluster_id)["manager"]["pid"]
    (server,) = [p for p in cf.live(cluster_id) if p.ppid() == manager]
    address = f"{server.cmdline()[3]}:{server.pid}"  # python -m MODULE NAME STARTER ROOM

    # Asked by the manager once the cluster ran: its jobs' next forks find them all.
    _wait_all_imported(address, server.environ())

    gate.touch()
    cf.wait_until(lambda: cf.state(cluster_id).get("status") == "succeeded", 90, "the end")
    cf.wait_until(lambda: not cf.alive([manager]), 60, "the manager to exit")
