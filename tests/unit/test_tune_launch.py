"""A trial's cluster as the study's loop sees it: how its end reads, on each backend."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clusterflow.backends.ray_placement import PlacementError
from clusterflow.manager import ray_host, registry
from clusterflow.manager.config import RunConfig
from clusterflow.tune.launch import LocalTrial, RayTrial

pytestmark = pytest.mark.usefixtures("home")


def test_a_ray_trial_that_cannot_be_placed_ends_failed_with_starts_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise PlacementError("job worker needs GPU=1: no node has it")

    monkeypatch.setattr(ray_host, "run", refuse)
    cluster = registry.create("s-t0-abcd")
    config = RunConfig.merge({"command": ("true",), "backend": "ray"})
    trial = RayTrial.start(cluster, config)
    state = trial.ended()
    assert state is not None and state.status == "failed" and state.exit_code == 2
    assert state.summary == "job worker needs GPU=1: no node has it"
    assert cluster.read_state().summary == state.summary  # `ps -a` shows why
    trial.stop(1.0)  # nothing to stop: no Ray call


def test_a_local_manager_that_exits_without_its_end_is_a_failed_trial() -> None:
    cluster = registry.create("s-t1-abcd")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    trial = LocalTrial(cluster, proc)
    proc.wait()
    state = trial.ended()
    assert state is not None and state.status == "failed"
    assert state.summary == "the manager exited with code 3"
