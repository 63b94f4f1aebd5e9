"""A cluster's handle (``manager/handle.py``): one per backend, found by the cluster's
folder, so no caller tests a backend's name; how a cluster's end reads on each."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from clusterflow.backends.ray_placement import PlacementError
from clusterflow.errors import ConfigError
from clusterflow.manager import handle, ray_host, registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.handle import LocalHandle, RayHandle
from clusterflow.manager.state import ClusterState

pytestmark = pytest.mark.usefixtures("home")


def test_a_ray_trial_that_cannot_be_placed_ends_failed_with_starts_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise PlacementError("job worker needs GPU=1: no node has it")

    monkeypatch.setattr(ray_host, "run", refuse)
    cluster = registry.create("s-t0-abcd")
    config = RunConfig.merge({"command": ("true",), "backend": "ray"})
    trial = RayHandle.start(cluster, config)
    state = trial.ended()
    assert state is not None and state.status == "failed" and state.exit_code == 2
    assert state.summary == "job worker needs GPU=1: no node has it"
    assert cluster.read_state().summary == state.summary  # `ps -a` shows why
    assert trial.stop(1.0) == "not running (failed)"  # nothing to stop: no Ray call


def test_a_local_manager_that_exits_without_its_end_is_a_failed_trial() -> None:
    cluster = registry.create("s-t1-abcd")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    trial = LocalHandle(cluster, proc)
    proc.wait()
    state = trial.ended()
    assert state is not None and state.status == "failed"
    assert state.summary == "the manager exited with code 3"


def _cluster(name: str, backend: str) -> registry.ClusterDir:
    cluster = registry.create(name)
    registry.write_json_atomic(cluster.config_file, {"command": ["true"], "backend": backend})
    return cluster


def test_each_backend_gets_its_handle_from_the_folder_alone() -> None:
    assert type(handle.attach(_cluster("h-local-abcd", "local"))) is LocalHandle
    assert type(handle.attach(_cluster("h-ray-abcd", "ray"))) is RayHandle
    bare = registry.create("h-bare-abcd")  # no settings written: a local cluster
    assert type(handle.attach(bare)) is LocalHandle


def test_a_cluster_on_emulated_hosts_is_read_as_a_local_one_without_the_harness() -> None:
    """Reading or stopping a cluster never imports the test harness (only starting one
    on ``hosts`` does): its manager is a local process."""
    probe = (
        "import sys; from clusterflow.manager import handle;"
        "assert 'clusterflow.testing.hosts_backend' not in sys.modules;"
        "from clusterflow.manager import registry;"
        "c = registry.create('h-hosts-abcd');"
        "registry.write_json_atomic(c.config_file, {'command': ['true'], 'backend': 'hosts'});"
        "print(type(handle.attach(c)).__name__,"
        " 'clusterflow.testing.hosts_backend' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LocalHandle", "False"]


def test_a_backend_nothing_registered_is_one_line() -> None:
    cluster = _cluster("h-odd-abcd", "slurm")
    with pytest.raises(ConfigError, match="runs on backend 'slurm', unknown here"):
        handle.attach(cluster)


@pytest.mark.timeout(30)
def test_a_local_manager_that_wrote_its_end_but_never_exits_is_killed_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handle, "MANAGER_EXIT_S", 0.5)
    cluster = registry.create("s-t2-abcd")
    # A manager wedged in its teardown: its own session, as LocalHandle.start makes it.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    try:
        cluster.write_state(ClusterState(id=cluster.id, status="succeeded", exit_code=0))
        state = LocalHandle(cluster, proc).ended()
        assert state is not None and state.status == "succeeded"
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
