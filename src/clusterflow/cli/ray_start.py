"""``clusterflow start --backend ray``: the manager starts inside the Ray cluster.

In the foreground the CLI then follows the cluster's output as ``attach`` does and ends
with its exit code; Ctrl-C (or SIGTERM, or a closed terminal) asks the manager to stop
the cluster in order. With ``--detach`` it prints the cluster id once the cluster runs.
"""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType

import click

from clusterflow.cli import follow
from clusterflow.errors import ClusterflowError
from clusterflow.manager import ray_host, registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.state import ClusterState

USAGE_EXIT = 2
"""What ``start`` exits with when the cluster cannot be placed (as for any bad input)."""


def run(cluster: ClusterDir, config: RunConfig, *, detach: bool) -> int:
    """Starts the cluster on Ray; returns the exit code for ``clusterflow start``."""
    try:
        handle = ray_host.run(cluster, config, detach=detach)
    except ClusterflowError as exc:
        # Never started: recorded as failed, so `ps -a` shows why, not a cluster "created".
        now = time.time()
        never = ClusterState(
            id=cluster.id, status="failed", backend="ray", command=config.command, created=now
        )
        cluster.write_state(never.finished(exit_code=USAGE_EXIT, summary=str(exc), ended=now))
        raise
    if detach:
        deadline = time.monotonic() + config.register_timeout_s
        while time.monotonic() < deadline:
            state = handle.refresh()
            if state is None or state.status in ("running", *registry.TERMINAL):
                break
            time.sleep(0.1)
        click.echo(cluster.id)
        return 0
    stopping: list[int] = []

    def _interrupt(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    asked = False

    def _done() -> bool:
        nonlocal asked
        if stopping and not asked:
            asked = True
            handle.stop(config.grace_s)
        state = handle.refresh()
        return state is None or state.status in registry.TERMINAL

    follow.print_file(cluster.output_file, _done)
    state = cluster.read_state()
    if state.status == "failed" and state.summary:
        click.echo(f"error: cluster {cluster.id} failed: {state.summary}", err=True)
    sys.stdout.flush()
    return 1 if state.exit_code is None else state.exit_code
