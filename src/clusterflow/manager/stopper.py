"""``clusterflow stop``: ask the manager to stop its cluster; force it if the manager is gone.

A live manager stops its tasks in order (SIGTERM, then SIGKILL after the grace period)
and records the outcome. A stale cluster (its manager died) is stopped here instead:
its processes are found by the ``CLUSTERFLOW_CLUSTER_ID`` in their environment (set
for every supervisor and inherited by every job), so a reused pid is never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import replace

import psutil

from clusterflow.cluster.contract import ENV_CLUSTER_ID
from clusterflow.manager.registry import TERMINAL, ClusterDir, effective_status, process_alive
from clusterflow.manager.state import ManagerProcess
from clusterflow.rpc import Credentials, RpcClient, RpcError
from clusterflow.server.manager_messages import StopRequest

log = logging.getLogger(__name__)


def cluster_processes(cluster_id: str) -> list[psutil.Process]:
    """Every live process of this user that belongs to the cluster (this one excepted)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(ENV_CLUSTER_ID) == cluster_id:
                found.append(proc)
    return found


def kill_processes(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM, then SIGKILL to whatever is still there after ``grace_s``."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


def stop_cluster(cluster: ClusterDir, grace_s: float) -> str:
    """Stops the cluster; returns what happened, in words, for the CLI to print."""
    state = cluster.read_state()
    status = effective_status(state)
    if status in TERMINAL:
        return f"not running ({status})"
    manager = state.manager or ManagerProcess()
    pid, created = manager.pid, manager.create_time
    if status != "stale" and manager.address:
        try:
            credentials = Credentials.from_file(cluster.secret_file)
            with RpcClient(manager.address, credentials, deadline=5.0) as client:
                client.call(StopRequest.METHOD, StopRequest(grace_s=grace_s).to_wire())
        except RpcError as exc:
            log.warning("manager of %s did not take the stop request: %s", cluster.id, exc)
        deadline = time.monotonic() + grace_s + 15.0
        while time.monotonic() < deadline and process_alive(pid, created):
            time.sleep(0.1)
        if not process_alive(pid, created):
            return "stopped"
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()  # type: ignore[arg-type]  # alive: it has a pid
    kill_processes(cluster_processes(cluster.id), grace_s)
    stopped = replace(
        state,
        status="stopped",
        summary="stopped by `clusterflow stop` (the manager was gone or hung)",
        ended=time.time(),
        # What a manager that takes the stop request exits with.
        exit_code=130 if state.exit_code is None else state.exit_code,
        tasks=tuple(
            replace(t, status="stopped") if t.exit_code is None else t for t in state.tasks
        ),
    )
    cluster.write_state(stopped)
    cluster.append_event("stopped", forced=True)
    return "stopped (forced: the manager was gone)"
