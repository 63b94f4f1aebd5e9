"""A cluster manager (``Controller``) in a test's folder, over a backend of the test's.

The unit tests that drive the manager's recovery and resizing by hand (its loop never
runs, or runs with its polls stretched) build it the same way: a cluster folder with
its logs, an RPC server of its own (made, not started: a test that calls the manager
over RPC starts it), output to the cluster's log only, and a backend whose supervisors
exist only in the manager's table. This module is that construction, once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from clusterflow.manager.config import RunConfig
from clusterflow.manager.controller import Controller
from clusterflow.manager.output import OutputRouter
from clusterflow.manager.registry import ClusterDir
from clusterflow.rpc import Credentials, RpcServer


def fake_backend(launch: Callable[[Any], Any], **more: Any) -> Any:
    """A local backend whose ``launch(TaskLaunch)`` is the test's; ``more`` adds what a
    path needs besides (``reserve`` and ``release`` for a grow)."""
    return SimpleNamespace(
        name="local",
        job_env=lambda task: {},
        launch=launch,
        adopt=lambda process, task: None,
        **more,
    )


def fake_manager(
    tmp_path: Path, config: RunConfig, backend: Any, credentials: Credentials, **kwargs: Any
) -> Controller:
    """A ``Controller`` of ``config`` in ``tmp_path / "cluster"`` over ``backend``;
    ``kwargs`` go to the controller (``store=`` for a fake torch store). The caller
    closes ``standby`` and ``output`` (and stops the RPC server if it started it)."""
    folder = tmp_path / "cluster"
    (folder / "logs").mkdir(parents=True)
    return Controller(
        ClusterDir(folder),
        config,
        backend,
        rpc=RpcServer(credentials, name="manager", tensors=False),
        output=OutputRouter(folder / "output.log", echo=False),
        **kwargs,
    )
