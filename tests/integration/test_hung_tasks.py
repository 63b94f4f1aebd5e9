"""A hung task is found, killed and recovered from, end to end under ``clusterflow start``
(docs/failure-semantics.md, "Detecting failures" and "Recovering").

Two ways a task hangs: its supervisor falls silent (the whole task is stopped: the
manager's heartbeat deadline, here 8 s from the cluster file, 30 s by default), or its
job stops advancing while the supervisor heartbeats on (``--stall-timeout``). Either
way the manager SIGKILLs what is left of it and, the job being no parameter-server
worker, restarts every task. The respawn of a
hung parameter-server worker is proven with its fencing, in
``test_hostile_fencing.py::test_the_manager_fences_a_hung_worker_before_its_replacement_starts``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from clusterflow.manager.registry import ClusterDir

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

JOB = """
import itertools, os, sys, time
from clusterflow.server.manager_link import ManagerLink

out = sys.argv[1]
attempt = int(os.environ["CLUSTERFLOW_ATTEMPT"])
if attempt > 0:
    open(os.path.join(out, f"attempt-{attempt}"), "w").close()
    while not os.path.exists(os.path.join(out, "finish")):  # the test looks meanwhile
        time.sleep(0.02)
    sys.exit(0)
link = ManagerLink.from_env()
for step in itertools.count():  # it trains, as far as the manager can tell
    link.report(step=step, loss=None, samples_per_s=None)
    if step == 0:  # the manager has its first step: it may hang from here on
        with open(os.path.join(out, "pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(out, "pid.tmp"), os.path.join(out, "pid"))
    time.sleep(0.1)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hang", ["task", "job"])
def test_a_hung_task_is_killed_and_the_cluster_restarted(
    cf: Clusterflow, tmp_path: Path, hang: str
) -> None:
    """``task``: the whole task (its supervisor's process group) is SIGSTOPped; pins
    the heartbeat rule of ``policy._death`` (``heartbeat_age_s > heartbeat_timeout_s``).
    ``job``: only the job's process, under ``--stall-timeout 3``; pins the stall rule
    (``step_age_s > stall``). Both pin ``Recovery._kill``'s SIGKILL: the stopped
    processes are gone while the restarted attempt runs, not left stopped beside it.
    Without the rule the run never ends; without the SIGKILL the stopped processes
    live on into the restarted attempt."""
    out = tmp_path / "out"
    out.mkdir()
    script = cf.script("job.py", JOB)
    stall = ["--stall-timeout", "3"] if hang == "job" else []
    if hang == "task":  # the cluster file's heartbeat deadline, shorter than the default 30 s
        stall = ["-c", str(cf.script("cluster.yaml", "heartbeat_timeout_s: 8\n"))]
    proc = cf.popen(
        "start", "--workers", "1", "--max-restarts", "1", *stall,
        "--", sys.executable, str(script), str(out),
    )  # fmt: skip
    job = int(cf.wait_until(lambda: _read(out / "pid"), 90, "the job's first attempt"))
    cluster_id = cf.only_id()
    supervisor = next(t["pid"] for t in cf.state(cluster_id)["tasks"] if t["task"] == "worker:0")
    if hang == "task":
        os.killpg(supervisor, signal.SIGSTOP)
    else:
        os.kill(job, signal.SIGSTOP)

    cf.wait_until((out / "attempt-1").exists, 150, "the restarted attempt")
    # While the restarted attempt runs (the manager's sweep at the end would hide it).
    assert cf.alive([supervisor, job]) == []
    (out / "finish").write_text("")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    events = ClusterDir(cf.path(cluster_id)).read_events()
    restarts = [e for e in events if e["event"] == "cluster_restarted"]
    assert len(restarts) == 1, restarts
    why = "missed heartbeats" if hang == "task" else "made no step"
    assert restarts[0]["task"] == "worker:0" and why in restarts[0]["reason"], restarts
    assert f"clusterflow: task worker:0 {why}" in stdout, stdout[-3000:]


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None
