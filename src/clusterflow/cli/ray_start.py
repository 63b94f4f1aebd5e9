"""``clusterflow start --backend ray``: the manager starts inside the Ray cluster.

In the foreground the CLI then follows the cluster's output as ``attach`` does and ends
with its exit code; Ctrl-C (or SIGTERM, or a closed terminal) asks the manager to stop
the cluster in order, and a second one leaves at once (exit 130; the manager goes on
stopping it). With ``--detach`` it prints the cluster id once the cluster runs.

Until the manager runs, Ctrl-C and SIGTERM end the command at once too (joining Ray and
placing the cluster both wait where signals are taken, ``ray_driver``): the cluster is
then recorded as failed, so no folder is left ``created`` behind.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from types import FrameType

import click

from clusterflow.cli import follow, interrupts
from clusterflow.errors import ClusterflowError
from clusterflow.manager import ray_host, registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.registry import ClusterDir

log = logging.getLogger(__name__)

USAGE_EXIT = 2
"""What ``start`` exits with when the cluster cannot be placed (as for any bad input)."""
INTERRUPTED_EXIT = 130
"""What a start interrupted before its manager ran records (as Ctrl-C exits)."""


def run(cluster: ClusterDir, config: RunConfig, *, detach: bool) -> int:
    """Starts the cluster on Ray; returns the exit code for ``clusterflow start``."""
    try:
        handle = ray_host.run(cluster, config, detach=detach)
    except ClusterflowError as exc:
        # Never started: recorded as failed, so `ps -a` shows why, not a cluster "created".
        ray_host.never_started(cluster, str(exc), exit_code=USAGE_EXIT)
        raise
    except BaseException:  # Ctrl-C or SIGTERM while it joined Ray or placed the cluster
        summary = "never started: interrupted while it joined Ray or placed the cluster"
        ray_host.never_started(cluster, summary, exit_code=INTERRUPTED_EXIT)
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
        if stopping:  # the second: leave now; the manager has the stop request
            interrupts.raise_for(signum)
        stopping.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    asked = False

    def _done() -> bool:
        nonlocal asked
        if stopping and not asked:
            asked = True
            try:
                handle.stop(config.grace_s)
            except Exception as exc:  # a manager that cannot take it: the refresh says
                log.warning("the manager of %s did not take the stop: %s", cluster.id, exc)
        state = handle.refresh()
        return state is None or state.status in registry.TERMINAL

    follow.print_file(cluster.output_file, _done)
    state = cluster.read_state()
    if state.status == "failed" and state.summary:
        click.echo(f"error: cluster {cluster.id} failed: {state.summary}", err=True)
    sys.stdout.flush()
    return 1 if state.exit_code is None else state.exit_code
