"""One trial's cluster, started, watched and stopped as ``clusterflow start --detach``
and ``clusterflow stop`` do it on the trial's backend.

* local: ``python -m clusterflow.manager FOLDER`` in a session of its own, stopped
  through the manager (``manager.stopper``);
* Ray: the manager as a detached actor in the Ray cluster, the whole cluster placed as
  one placement group (``manager.ray_host.run``, what ``start --backend ray`` calls), and
  the trial's folder a mirror that each look refreshes; stopped by ``ray_host.stop``,
  which ends the manager, its actors and its placement group.

Either way the trial's cluster is like any other: ``clusterflow ps`` lists it, ``logs``,
``describe`` and ``stop`` work on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from clusterflow.cluster.contract import ENV_CLUSTER_ID
from clusterflow.errors import ClusterflowError
from clusterflow.manager import registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.registry import TERMINAL, ClusterDir
from clusterflow.manager.state import ClusterState
from clusterflow.manager.stopper import stop_cluster

log = logging.getLogger(__name__)

RAY_LOOK_S = 0.5
"""Least time between two refreshes of a Ray trial's mirror (each is a call to its
manager actor; the trial's reports are read from their file meanwhile)."""
PLACEMENT_EXIT = 2
"""A trial's cluster Ray cannot place ends as ``start`` would: failed, exit code 2."""


class TrialCluster(Protocol):
    """A running trial's cluster, as the study's loop sees it."""

    cluster: ClusterDir

    def ended(self) -> ClusterState | None:
        """Its final state once it ended (or its manager is gone); None while it runs."""
        ...

    def stop(self, grace_s: float) -> None:
        """Stops it (its tasks first, in order) and waits until its manager is gone."""
        ...


def launch(
    cluster: ClusterDir, config: RunConfig, manager_env: Mapping[str, str] | None = None
) -> TrialCluster:
    """Starts the trial's cluster on ``config.backend``; its settings and secret are in
    ``cluster``'s folder already. ``manager_env``: variables of a local manager's own
    environment (the GPUs it may use, as a machine's manager sees its machine's)."""
    if config.backend == "ray":
        return RayTrial.start(cluster, config)
    return LocalTrial.start(cluster, manager_env or {})


def stop(cluster: ClusterDir, grace_s: float) -> None:
    """Stops a trial's cluster by its folder alone (an orphan of a tuner that died)."""
    with contextlib.suppress(ClusterflowError):
        if cluster.read_config().get("backend") == "ray":
            from clusterflow.manager import ray_host

            ray_host.stop(cluster, grace_s)
            return
    stop_cluster(cluster, grace_s)


class LocalTrial:
    """A trial's cluster whose manager is a local process, a child of the tuner."""

    def __init__(self, cluster: ClusterDir, proc: subprocess.Popen[bytes]) -> None:
        self.cluster = cluster
        self.proc = proc

    @classmethod
    def start(cls, cluster: ClusterDir, manager_env: Mapping[str, str]) -> LocalTrial:
        with (cluster.path / "manager.log").open("ab") as manager_log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "clusterflow.manager", str(cluster.path)],
                # Tagged like its tasks, so `stop` and cleanup find every process of it.
                env={**os.environ, **manager_env, ENV_CLUSTER_ID: cluster.id},
                stdin=subprocess.DEVNULL,
                stdout=manager_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(cluster, proc)

    def ended(self) -> ClusterState | None:
        state = self.cluster.read_state()
        if registry.effective_status(state) not in TERMINAL:
            if self.proc.poll() is None:
                return None
            state = self.cluster.read_state()  # it may have written its end as it exited
            if registry.effective_status(state) not in TERMINAL:
                summary = f"the manager exited with code {self.proc.returncode}"
                return replace(state, status="failed", summary=summary)
        self.proc.wait()
        return state

    def stop(self, grace_s: float) -> None:
        stop_cluster(self.cluster, grace_s)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)


class RayTrial:
    """A trial's cluster whose manager is an actor in a Ray cluster."""

    def __init__(self, cluster: ClusterDir, handle: Any, failure: ClusterState | None) -> None:
        self.cluster = cluster
        self.handle = handle
        self._final = failure
        self._looked = 0.0

    @classmethod
    def start(cls, cluster: ClusterDir, config: RunConfig) -> RayTrial:
        """Places the whole cluster; one that cannot be placed is a failed trial with
        ``start``'s one line, as ``start --backend ray`` records it."""
        from clusterflow.manager import ray_host

        try:
            handle = ray_host.run(cluster, config, detach=True)
        except ClusterflowError as exc:
            now = time.time()
            never = ClusterState(
                id=cluster.id, status="failed", backend="ray", command=config.command, created=now
            )
            final = never.finished(exit_code=PLACEMENT_EXIT, summary=str(exc), ended=now)
            cluster.write_state(final)
            return cls(cluster, None, final)
        return cls(cluster, handle, None)

    def ended(self) -> ClusterState | None:
        if self._final is not None:
            return self._final
        if time.monotonic() - self._looked < RAY_LOOK_S:
            return None
        self._looked = time.monotonic()
        state: ClusterState | None = self.handle.refresh()  # its state and new output
        if state is None:
            state = self.cluster.read_state()
            if state.status not in TERMINAL:
                state = replace(state, status="failed", summary="the manager actor is gone")
        if state.status not in TERMINAL:
            return None
        self._final = state
        return state

    def stop(self, grace_s: float) -> None:
        if self._final is not None:
            return
        import ray

        from clusterflow.manager import ray_host

        try:
            outcome = ray_host.stop(self.cluster, grace_s)
        except ray.exceptions.RayError as exc:  # it ended meanwhile, or its node died
            outcome = f"not stopped in order ({type(exc).__name__}); ended"
            self.handle.end()
        log.info("trial cluster %s: %s", self.cluster.id, outcome)
        self._final = self.cluster.read_state()
