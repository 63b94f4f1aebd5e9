"""``--warm-restarts``: a whole restart hands every task to a warm standby.

Issue 28 (a whole restart in at most 2 s): a cold restart starts a Python and imports
torch in every task at once, then waits for a fresh store's own import. Under
``--warm-restarts`` the manager keeps a standby per task (a zygote with torch imported)
and the next attempt's store up, so the restarted tasks skip both. The all-reduce group
of the restarted attempt forms on that store and the run ends as a cold restart's would.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import TYPE_CHECKING, Any

import psutil
import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

PY = sys.executable

JOB = """
import os, threading, torch
from clusterflow.strategies import MultiWorkerMirroredStrategy

strategy = MultiWorkerMirroredStrategy()
total = strategy.reduce("sum", torch.ones(1)).item()
attempt = os.environ["CLUSTERFLOW_ATTEMPT"]
print(f"attempt {attempt} sum {total:g}", flush=True)
if attempt == "0":
    threading.Event().wait()  # until the test kills worker:0's job
"""


def _fresh_zygote(process: psutil.Process) -> bool:
    try:
        return "clusterflow.backends.zygote" in process.cmdline()
    except psutil.Error:
        return False


def _events(cf: Clusterflow, cluster_id: str) -> list[dict[str, Any]]:
    lines = (cf.path(cluster_id) / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(240)
def test_a_whole_restart_hands_every_task_to_a_warm_standby_and_the_group_forms_again(
    cf: Clusterflow,
) -> None:
    script = cf.script("job.py", JOB)
    cluster = cf.start_detached(
        "--workers", "2", "--max-restarts", "1", "--warm-restarts", "--", PY, str(script)
    )  # fmt: skip
    cf.wait_output(cluster, "[worker:0] attempt 0 sum 2", "[worker:1] attempt 0 sum 2")

    def standbys_warm() -> bool:
        standby = cf.state(cluster).get("standby") or {}
        return bool(standby.get("kept") == 2 and standby.get("ready_count") == 2)

    cf.wait_until(standbys_warm, 180, "a warm standby per task")
    # Each standby was forked from the warm fork server, so its zygote is a fork of it
    # that warmed up there, not a Python of its own importing torch again.
    fresh = [" ".join(p.cmdline()) for p in cf.live(cluster) if _fresh_zygote(p)]
    assert not fresh, fresh
    assert "did not warm up" not in cf.output(cluster)
    worker = next(t for t in cf.state(cluster)["tasks"] if t["task"] == "worker:0")
    job = psutil.Process(worker["pid"]).children()[0]
    job.send_signal(signal.SIGKILL)

    cf.wait_until(
        lambda: cf.state(cluster).get("status") in ("succeeded", "failed"), 180, "the run's end"
    )
    state = cf.state(cluster)
    assert state["status"] == "succeeded", cf.output(cluster)[-3000:]
    assert state["restarts"] == 1
    output = cf.output(cluster).splitlines()
    assert "[worker:0] attempt 1 sum 2" in output and "[worker:1] attempt 1 sum 2" in output
    events = _events(cf, cluster)
    restarted = next(i for i, e in enumerate(events) if e["event"] == "cluster_restarted")
    took = sorted(e["task"] for e in events[restarted:] if e["event"] == "standby_took_over")
    assert took == ["worker:0", "worker:1"], events[restarted:]
    # Nothing outlives the run: no standby, no spare store, the manager gone.
    cf.wait_until(lambda: not cf.live(cluster), 60, "every process of the cluster to end")
