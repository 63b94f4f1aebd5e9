"""Per-node clusterflow agents on a real Ray cluster (``backends/ray_agent.py``).

Two Ray nodes, one per emulated host (``clusterflow.testing.ray_nodes``, as in
``test_ray.py``), shared by the module; its finalizer kills every process on the hosts
and removes them, even when a test failed. With agents started, a launch's tasks run
under the node's agent (no Ray worker started for them), a second launch reuses the
same agents, a killed agent is replaced by the next launch, results equal the local
backend's, and ``ray-agents stop`` leaves no agent behind. Through the head agent's port
(``backends/agent_port.py``) a launch, ``describe`` and ``stop`` run in a CLI that cannot
import Ray, and a stale port falls back to joining Ray, which records it anew.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterflow.testing import available
from conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

if not available():
    pytest.skip("needs root and iproute2 for the emulated hosts", allow_module_level=True)

from clusterflow.testing.ray_nodes import RayNodes  # noqa: E402 (after the skip)

REPO = Path(__file__).resolve().parents[2]
JOB = [sys.executable, str(Path(__file__).with_name("ray_agent_job.py")), "--epochs", "1"]
ADDRESS = "10.77.0.1:6379"
CLI = [sys.executable, "-m", "clusterflow.cli.main"]
NO_RAY_CLI = [
    sys.executable,
    "-c",
    "import sys; sys.modules['ray'] = None; from clusterflow.cli.main import main; main()",
]
"""The CLI in a process where ``import ray`` fails (any Ray module): what runs there
imported no Ray."""


@pytest.fixture(scope="module")
def nodes() -> Iterator[RayNodes]:
    with RayNodes(2, prefix="rayag") as ray_nodes:
        assert ray_nodes.address == ADDRESS
        ray_nodes.start_head("--num-cpus=2")
        ray_nodes.start_node(1, "--num-cpus=2")
        wait_until(lambda: len(ray_nodes.probe()["nodes"]) == 2, 60, "two Ray nodes")
        yield ray_nodes


@pytest.fixture(scope="module")
def local_results(nodes: RayNodes, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The job's result lines on the local backend, run once for the module: each test
    compares its Ray launches with them, digit for digit."""
    env = nodes.env(CLUSTERFLOW_HOME=str(tmp_path_factory.mktemp("local-home")))
    local = nodes.run(
        [*CLI, "start", "--workers", "2", "--", *JOB],
        env=env,
        timeout=240,
        cwd=REPO,
        capture_output=True,
    )
    assert local.returncode == 0, local.stderr
    results = _results(local.stdout)
    assert len(results) == 2, local.stdout  # its epoch and the final line
    return results


@pytest.fixture
def cf(nodes: RayNodes, tmp_path: Path) -> Iterator[Any]:
    """``clusterflow ARGS`` on the head's host; afterwards the agents are stopped (with
    ``--force``: a failed test may leave them hosting), whatever the test did."""
    env = nodes.env(CLUSTERFLOW_HOME=str(tmp_path / "home"))

    def run(
        *args: str, timeout: float = 240, no_ray: bool = False
    ) -> subprocess.CompletedProcess[str]:
        cli = NO_RAY_CLI if no_ray else CLI
        return nodes.run([*cli, *args], env=env, timeout=timeout, cwd=REPO, capture_output=True)

    run.home = tmp_path / "home"  # type: ignore[attr-defined]
    yield run
    run("ray-agents", "stop", "--force", "--address", ADDRESS)


def _agents(cf: Any) -> dict[str, int]:
    """Node id -> pid of every live agent (``ray-agents status``)."""
    out = cf("ray-agents", "status", "--address", ADDRESS)
    assert out.returncode == 0, out.stderr
    return {m[0]: int(m[1]) for m in re.findall(r"agent on node (\w+) \(pid (\d+)\)", out.stdout)}


def _on_ray(cf: Any, *, no_ray: bool = False) -> subprocess.CompletedProcess[str]:
    # Each worker asks for all of a node's CPUs: placed only if the agents hold none.
    ray = ["--backend", "ray", "--address", ADDRESS, "--resources", "worker:CPU=2"]
    out = cf("start", *ray, "--workers", "2", "--", *JOB, no_ray=no_ray)
    assert out.returncode == 0, out.stderr + out.stdout
    return out


def _hosts(out: str) -> set[int]:
    return {int(pid) for pid in re.findall(r"hosted_by=(\d+)", out)}


def _warm(out: str) -> list[str]:
    """Each rank's ``warm=`` (1: forked from its agent's server, torch imported)."""
    return re.findall(r"hosted_by=\d+ rank=\d+ warm=(\d)", out)


def _results(out: str) -> list[str]:
    return [line for line in out.splitlines() if "test_accuracy" in line]


def test_launches_run_under_the_nodes_agents_and_a_killed_one_is_replaced(
    nodes: RayNodes, cf: Any, local_results: list[str]
) -> None:
    started = cf("ray-agents", "start", "--address", ADDRESS)
    assert started.returncode == 0, started.stderr
    agents = _agents(cf)
    assert len(agents) == 2, started.stdout  # one per node

    first = _on_ray(cf)
    # Each task's supervisor is a child of its node's agent: no Ray worker was started
    # for it. Two workers, spread over the two nodes: both agents host one.
    assert _hosts(first.stdout) == set(agents.values()), first.stdout
    # Each forked from its node's warm fork server (the agent's): the job found torch
    # imported, as a local cluster's do (no interpreter start, no import per launch).
    assert _warm(first.stdout) == ["1", "1"], first.stdout
    # The manager ran in the head's agent too (no Ray worker started for it either).
    (cluster,) = (cf.home / "clusters").iterdir()
    described = cf("describe", cluster.name, "--json")
    manager = json.loads(described.stdout)["manager"]
    assert manager["pid"] == agents[manager["node_id"]], (manager, agents)
    second = _on_ray(cf)
    assert _hosts(second.stdout) == set(agents.values()), second.stdout
    assert _agents(cf) == agents  # the same processes, reused

    assert _results(first.stdout) == local_results  # digit for digit
    assert _results(second.stdout) == local_results

    # The other node's agent dies (its process killed, as a crash would): the next
    # launch's task on that node finds it dead and replaces it.
    node, pid = next((n, p) for n, p in agents.items() if n != manager["node_id"])
    os.kill(pid, signal.SIGKILL)
    third = _on_ray(cf)
    now = _agents(cf)
    assert set(now) == set(agents) and now[node] != pid, (agents, now)
    assert _hosts(third.stdout) == set(now.values()), third.stdout
    assert _results(third.stdout) == local_results

    stopped = cf("ray-agents", "stop", "--address", ADDRESS)
    assert stopped.returncode == 0, stopped.stderr
    assert not [a for a in nodes.probe()["actors"] if a.startswith("clusterflow")]
    shown = cf("ray-agents", "status", "--address", ADDRESS).stdout
    assert "agents disabled" in shown, shown
    assert f"no agent port recorded in {_record(cf)}" in shown, shown  # stop removed it


def _record(cf: Any) -> Path:
    """The head agent's port as ``ray-agents start`` recorded it for ``ADDRESS``."""
    return Path(cf.home) / "ray-agents" / f"{ADDRESS.replace(':', '_')}.json"


def test_a_launch_through_the_head_agents_port_imports_no_ray(
    nodes: RayNodes, cf: Any, local_results: list[str]
) -> None:
    started = cf("ray-agents", "start", "--address", ADDRESS)
    assert started.returncode == 0, started.stderr
    record = _record(cf)
    assert record.stat().st_mode & 0o777 == 0o600  # it holds the port's secret
    agents = _agents(cf)
    shown = cf("ray-agents", "status", "--address", ADDRESS).stdout
    port = json.loads(record.read_text())["address"]
    assert f"agent port {port} answers (recorded in {record})" in shown, shown

    # The CLI cannot import Ray here: the launch, its output and its exit went through
    # the head agent's port; the tasks still ran under the nodes' agents.
    first = _on_ray(cf, no_ray=True)
    assert _hosts(first.stdout) == set(agents.values()), first.stdout
    assert _results(first.stdout) == local_results  # digit for digit
    clusters = sorted((cf.home / "clusters").iterdir(), key=lambda p: p.stat().st_mtime)
    described = cf("describe", clusters[0].name, "--json", no_ray=True)
    assert described.returncode == 0, described.stderr
    manager = json.loads(described.stdout)["manager"]
    assert manager["pid"] == agents[manager["node_id"]], (manager, agents)
    failing = cf("start", "--backend", "ray", "--address", ADDRESS, "--", "false", no_ray=True)
    assert failing.returncode == 1, failing.stderr  # the job's exit code, through the port

    # A stale record (nothing listens at its address any more): one line names it and
    # the launch joins Ray instead (here Ray cannot be imported: it says so, exit 2).
    good = json.loads(record.read_text())
    record.write_text(json.dumps({**good, "address": f"{good['address'].split(':')[0]}:1"}))
    stale = cf("start", "--backend", "ray", "--address", ADDRESS, "--", "true", no_ray=True)
    assert stale.returncode == 2, stale.stderr
    lines = stale.stderr.strip().splitlines()
    assert f"{good['address'].split(':')[0]}:1: nothing listens there" in lines[0], lines
    assert str(record) in lines[0] and "joining Ray instead" in lines[0], lines
    assert lines[-1].startswith("error: --backend ray needs Ray"), lines
    shown = cf("ray-agents", "status", "--address", ADDRESS).stdout
    assert f"agent port recorded in {record} does not answer" in shown, shown
    # With Ray, the fallback launches and records the head agent's port anew.
    again = _on_ray(cf)
    assert _results(again.stdout) == local_results
    assert json.loads(record.read_text())["address"] == good["address"]

    # Detached and stopped, both through the port.
    job = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
    ray = ["--backend", "ray", "--address", ADDRESS]
    detached = cf("start", *ray, "--detach", "--", *job, no_ray=True)
    assert detached.returncode == 0, detached.stderr
    cluster_id = detached.stdout.strip().splitlines()[-1]
    stopped = cf("stop", cluster_id, "--grace", "5", no_ray=True)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"{cluster_id}: stopped", stopped.stdout
    state = json.loads(cf("describe", cluster_id, "--json", no_ray=True).stdout)
    assert state["status"] == "stopped", state


HOLD = """
import pathlib, sys, time
data = b"\\1" * (400 << 20)  # touched, so resident: the job's own pages
print("holding", flush=True)
flag = pathlib.Path(sys.argv[1])
while not flag.exists():  # held until the test saw the agent measure it
    time.sleep(0.05)
"""


def test_a_forked_tasks_memory_is_its_own_pages_not_its_warm_servers(
    nodes: RayNodes, cf: Any, tmp_path: Path
) -> None:
    started = cf("ray-agents", "start", "--address", ADDRESS)
    assert started.returncode == 0, started.stderr
    flag = tmp_path / "measured"
    ray = ["--backend", "ray", "--address", ADDRESS, "--workers", "1", "--detach"]
    out = cf("start", *ray, "--", sys.executable, "-c", HOLD, str(flag))
    assert out.returncode == 0, out.stderr
    cluster_id = out.stdout.strip()

    def task() -> dict[str, Any]:
        described = cf("describe", cluster_id, "--json")
        assert described.returncode == 0, described.stderr
        tasks = json.loads(described.stdout)["tasks"]
        return dict(tasks[0]) if tasks else {}

    try:
        # More than the tree's RSS before the job allocates (about 310 MiB: each forked
        # process maps the server's heap), so only a sample taken after it counts.
        wait_until(lambda: (task().get("memory_peak") or 0) > 400 << 20, 120, "the measure")
    finally:
        flag.touch()
    # Forked warm, the supervisor and its job share torch's import with the agent's
    # server (its heap, resident in each): counted per process, as RSS would, the tree
    # would read about 300 MiB more; its own pages are the 400 MiB and a little.
    peak = task()["memory_peak"]
    assert 400 << 20 < peak < 480 << 20, peak / 2**20
    wait_until(lambda: task().get("exit_code") == 0, 120, "the job's end")


STORE_PROBE = """
import os, psutil, torch.distributed as dist
dist.init_process_group("gloo")  # the first rank's connection starts the store's helper
port = int(os.environ["MASTER_PORT"])

def listens(pid):  # on MASTER_PORT, in its own network namespace (this rank's may differ)
    fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            f = line.split()  # local address, state (0A: listening), inode
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":
                if f"socket:[{f[9]}]" in fds:
                    return True
    return False

store = next(  # this cluster's: the helper that listens on its MASTER_PORT
    p for p in psutil.process_iter(["cmdline"])
    if (p.info["cmdline"] or [])[1:3] == ["-m", "clusterflow.manager.store"] and listens(p.pid)
)
print("store parent", " ".join(store.parent().cmdline()[1:3]), flush=True)
dist.destroy_process_group()
"""


def test_a_manager_in_the_head_agent_forks_its_torch_store_from_the_agents_server(
    nodes: RayNodes, cf: Any
) -> None:
    started = cf("ray-agents", "start", "--address", ADDRESS)
    assert started.returncode == 0, started.stderr
    ray = ["--backend", "ray", "--address", ADDRESS, "--workers", "1"]

    out = cf("start", *ray, "--", sys.executable, "-c", STORE_PROBE)

    # Not a fresh Python that imports torch while every rank's init_process_group waits.
    assert out.returncode == 0, out.stderr + out.stdout
    assert "[worker:0] store parent -m clusterflow.backends.forkserver" in out.stdout, out.stdout
