"""One handle per backend on a cluster's life: start it, read it, see whether it ended,
stop it.

The CLI (``start --detach``, ``stop``, ``ps``, ``describe``, ``logs``), ``tune`` (a
trial's cluster) and the dashboard (its state, its stop button) call these and never
test a backend's name; the backend's description (``backends/kinds.py``) says where its
manager runs, and that picks the handle:

* ``local`` (and the emulated ``hosts``): the manager is a process on this machine,
  started as ``python -m clusterflow.manager FOLDER`` in a session of its own; the
  cluster's folder is its own; ``manager/stopper.py`` stops it through it.
* ``ray``: the manager is a detached actor (``manager/ray_host.py``); the folder here
  is a mirror that reading refreshes; stopping ends the manager, its actors and its
  placement group.

Reading never changes a cluster (a Ray mirror is brought up to date, nothing more).
Only starting a cluster on the emulated ``hosts`` (the test harness's) needs
``clusterflow.testing``; reading and stopping one do not, so the product never imports
the harness for a cluster it did not start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from clusterflow.backends import kinds
from clusterflow.backends.api import Backend
from clusterflow.backends.kinds import BackendKind
from clusterflow.cluster.contract import ENV_CLUSTER_ID
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.manager import registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.registry import TERMINAL, ClusterDir
from clusterflow.manager.state import ClusterState

log = logging.getLogger(__name__)

RAY_LOOK_S = 0.5
"""Least time between two refreshes of a Ray cluster's mirror by ``ended`` (each is a
call to its manager actor)."""
PLACEMENT_EXIT = 2
"""A cluster Ray cannot place ends as ``start`` would: failed, exit code 2."""
MANAGER_EXIT_S = 30.0
"""How long a local manager that wrote its end may take to exit (its server stopped,
its threads joined: seconds at most) before ``ended`` kills its session."""


class ClusterHandle(Protocol):
    """A cluster, as whoever started or found it sees it."""

    cluster: ClusterDir

    def read(self) -> ClusterState:
        """Its state (a Ray mirror refreshed first; ``unreachable`` when its Ray is)."""
        ...

    def ended(self) -> ClusterState | None:
        """Its final state once it ended (or its manager is gone); None while it runs."""
        ...

    def stop(self, grace_s: float) -> str:
        """Stops it (its tasks first, in order); what happened, in a few words."""
        ...


class LocalHandle:
    """A cluster whose manager is a process on this machine (``proc`` when this process
    started it)."""

    def __init__(self, cluster: ClusterDir, proc: subprocess.Popen[bytes] | None = None) -> None:
        self.cluster = cluster
        self.proc = proc

    @classmethod
    def start(
        cls, cluster: ClusterDir, manager_env: Mapping[str, str] | None = None
    ) -> LocalHandle:
        """Starts the manager of ``cluster`` (its settings and secret are in its folder)
        in a session of its own, logging to ``manager.log``; returns at once."""
        with (cluster.path / "manager.log").open("ab") as manager_log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "clusterflow.manager", str(cluster.path)],
                # Tagged like its tasks, so `stop` and cleanup find every process of it.
                env={**os.environ, **(manager_env or {}), ENV_CLUSTER_ID: cluster.id},
                stdin=subprocess.DEVNULL,
                stdout=manager_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(cluster, proc)

    def read(self) -> ClusterState:
        return self.cluster.read_state()

    def ended(self) -> ClusterState | None:
        state = self.cluster.read_state()
        status = registry.effective_status(state)
        if self.proc is None:  # found, not started here: a gone manager ends it too
            return state if status in (*TERMINAL, "stale") else None
        if status not in TERMINAL:
            if self.proc.poll() is None:
                return None
            state = self.cluster.read_state()  # it may have written its end as it exited
            if registry.effective_status(state) not in TERMINAL:
                summary = f"the manager exited with code {self.proc.returncode}"
                return replace(state, status="failed", summary=summary)
        try:
            self.proc.wait(MANAGER_EXIT_S)
        except subprocess.TimeoutExpired:
            # Its cluster has ended; a manager wedged in its own teardown must not hold
            # whoever waits for the end (a study's next trial) forever.
            log.warning(
                "cluster %s: its manager (pid %d) wrote its end but did not exit within "
                "%gs; killing it",
                self.cluster.id,
                self.proc.pid,
                MANAGER_EXIT_S,
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its session (start_new_session)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10.0)
        return state

    def stop(self, grace_s: float) -> str:
        from clusterflow.manager import stopper

        outcome = stopper.stop_cluster(self.cluster, grace_s)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.wait(timeout=30)
        return outcome


class RayHandle:
    """A cluster whose manager is an actor in a Ray cluster (``manager/ray_host.py``)."""

    def __init__(self, cluster: ClusterDir, manager: Any = None, final: ClusterState | None = None):
        self.cluster = cluster
        self.manager = manager
        """``ray_host.ManagerHandle`` when this process started it; else found on demand."""
        self._final = final
        self._looked = 0.0

    @classmethod
    def start(cls, cluster: ClusterDir, config: RunConfig) -> RayHandle:
        """Places the whole cluster with its manager, detached. One that cannot be placed
        is a failed cluster with ``start``'s one line, recorded in its folder."""
        from clusterflow.manager import ray_host

        try:
            manager = ray_host.run(cluster, config, detach=True)
        except ClusterflowError as exc:
            now = time.time()
            never = ClusterState(
                id=cluster.id,
                status="failed",
                backend=config.backend,
                command=config.command,
                created=now,
            )
            final = never.finished(exit_code=PLACEMENT_EXIT, summary=str(exc), ended=now)
            cluster.write_state(final)
            return cls(cluster, None, final)
        return cls(cluster, manager)

    def read(self) -> ClusterState:
        from clusterflow.manager import ray_host

        return ray_host.read(self.cluster)

    def ended(self) -> ClusterState | None:
        if self._final is not None:
            return self._final
        if time.monotonic() - self._looked < RAY_LOOK_S:
            return None
        self._looked = time.monotonic()
        state: ClusterState | None
        if self.manager is not None:
            state = self.manager.refresh()  # its state and new output
            if state is None:
                state = self.cluster.read_state()
                if state.status not in TERMINAL:
                    state = replace(state, status="failed", summary="the manager actor is gone")
        else:
            state = self.read()
        if registry.effective_status(state) not in TERMINAL:
            return None
        self._final = state
        return state

    def stop(self, grace_s: float) -> str:
        if self._final is not None:
            return f"not running ({self._final.status})"
        from clusterflow.manager import ray_host
        from clusterflow.manager.ray_links import ManagerGone

        try:
            outcome = ray_host.stop(self.cluster, grace_s)
        except ManagerGone as exc:  # it ended meanwhile, or its node died
            outcome = f"not stopped in order ({type(exc).__name__}); ended"
            if self.manager is not None:
                self.manager.end()
        self._final = self.cluster.read_state()
        return outcome


def _handle_class(kind: BackendKind) -> type[LocalHandle] | type[RayHandle]:
    """Where the backend's manager runs decides the handle (``BackendKind``)."""
    return RayHandle if kind.manager_in_ray else LocalHandle


def backend_of(cluster: ClusterDir) -> str:
    """The backend a cluster was started on (``local`` for a folder without settings)."""
    with contextlib.suppress(ConfigError):
        return str(cluster.read_config().get("backend") or kinds.LOCAL.name)
    return kinds.LOCAL.name


def attach(cluster: ClusterDir) -> ClusterHandle:
    """The handle of a cluster found by its folder (``registry.find``).

    Raises:
        ConfigError: the cluster names a backend this version does not know.
    """
    backend = backend_of(cluster)
    kind = kinds.find(backend)
    if kind is None:
        raise ConfigError(f"cluster {cluster.id} runs on backend {backend!r}, unknown here")
    return _handle_class(kind)(cluster)


def start(
    cluster: ClusterDir, config: RunConfig, manager_env: Mapping[str, str] | None = None
) -> ClusterHandle:
    """Starts a cluster whose settings and secret are in ``cluster``'s folder, detached,
    on ``config.backend``. ``manager_env``: variables of a local manager's own
    environment (the GPUs it may use, as a machine's manager sees its machine's)."""
    if kinds.named(config.backend).manager_in_ray:
        return RayHandle.start(cluster, config)
    return LocalHandle.start(cluster, manager_env)


def task_backend(config: RunConfig) -> tuple[RunConfig, Backend]:
    """What a manager on this machine runs ``config``'s cluster with: the config (a
    backend may set the manager's address) and the ``Backend`` that launches its tasks
    (``BackendKind.launcher``; ``hosts`` registers its own from the test harness).

    Raises:
        ConfigError: the backend's manager does not run here, or cannot start it
            (``hosts`` without its placement file).
    """
    return kinds.named(config.backend).launcher().backend(config)


def read(cluster: ClusterDir) -> ClusterState:
    """A cluster's state, by its handle (``ClusterHandle.read``)."""
    return attach(cluster).read()


def stop(cluster: ClusterDir, grace_s: float) -> str:
    """Stops a cluster by its folder alone, by its handle (``ClusterHandle.stop``)."""
    outcome = attach(cluster).stop(grace_s)
    log.info("cluster %s: %s", cluster.id, outcome)
    return outcome
