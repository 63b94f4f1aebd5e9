"""The backends, each described once (``backends/kinds.py``): a name is looked up in one
place; an unknown one is one line naming it; ``hosts``' launcher comes from the test
harness, and only when a start asks for it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from clusterflow.backends import kinds
from clusterflow.backends.local import LocalBackend
from clusterflow.cli.main import main
from clusterflow.errors import ConfigError
from clusterflow.manager import registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.handle import task_backend
from clusterflow.manager.state import ClusterState, TaskState

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("home")]


def test_an_unknown_backend_is_one_line_naming_it() -> None:
    with pytest.raises(kinds.UnknownBackend, match=r"^unknown backend 'slurm': use local or ray$"):
        kinds.named("slurm")


def test_an_unknown_backend_in_a_cluster_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Validation asks the registry (``check_placement``); the message offers the public
    backends only."""
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text("backend: slurm\nworkers: 1\n")
    with pytest.raises(SystemExit) as exited:
        main(["start", "-c", str(cluster_file), "--", "true"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.splitlines() == [
        f"error: cluster file {str(cluster_file)!r}: backend must be local or ray, got 'slurm'"
    ]


def test_a_local_start_gets_the_local_backend() -> None:
    config = RunConfig.merge({"command": ("true",), "workers": 2})
    kept, backend = task_backend(config)
    assert kept is config and type(backend) is LocalBackend


def test_a_ray_cluster_is_started_by_its_manager_on_ray_not_from_here() -> None:
    with pytest.raises(ConfigError, match="backend 'ray' starts no tasks from this machine"):
        kinds.RAY.launcher()


def test_the_hosts_launcher_registers_itself_from_the_harness_only_when_asked() -> None:
    """Looking ``hosts`` up (to read or stop a cluster on it) imports nothing of the
    harness; asking for its launcher (a start) imports ``clusterflow.testing``, whose
    module registers it, and its check is the harness's own."""
    probe = (
        "import sys\n"
        "from clusterflow.cli import main\n"
        "from clusterflow.backends import kinds\n"
        "from clusterflow.errors import ConfigError\n"
        "from clusterflow.manager.config import RunConfig\n"
        "kind = kinds.named('hosts')\n"
        "print(any(m.startswith('clusterflow.testing') for m in sys.modules))\n"
        "launcher = kind.launcher()\n"
        "print(type(launcher).__module__, type(launcher).__name__)\n"
        "try:\n"
        "    launcher.check(RunConfig.merge({'command': ('true',), 'backend': 'hosts'}))\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CLUSTERFLOW_HOSTS"}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "False",
        "clusterflow.testing.hosts_backend HostsLauncher",
        "--backend hosts needs CLUSTERFLOW_HOSTS=<placement file> "
        "(clusterflow.testing.hosts_backend.Placement.write)",
    ]


@pytest.mark.parametrize(("backend", "measured"), [("local", True), (None, True), ("hosts", False)])
def test_the_dashboard_measures_a_running_tasks_memory_only_on_this_machines_processes(
    backend: str | None, measured: bool
) -> None:
    """``BackendKind.tasks_here`` decides it (``ui/views.py`` ``tasks_here``): a local
    task's process tree is measured by its pid; an emulated host stands for another
    machine, whose pids mean nothing here (as a Ray node's)."""
    from clusterflow.ui import views

    cluster = registry.create(f"k-{backend}-abcd")
    task = TaskState(task="worker:0", status="running", pid=os.getpid())
    state = ClusterState(id=cluster.id, status="running", backend=backend, tasks=(task,))
    cluster.write_state(state)
    row = views.cluster_detail(cluster, with_checkpoints=False)["tasks"][0]
    assert (row["memory_measured"] is not None) is measured
    assert views.tasks_here(replace(state, backend="ray")) is False
    assert views.tasks_here(replace(state, backend="slurm")) is False  # unknown: not here


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_a_resume_trusts_a_missing_checkpoint_folder_only_where_the_manager_ran_elsewhere(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``BackendKind.manager_in_ray`` (``cli/start_settings.py`` ``resumed_settings``): a
    Ray cluster's checkpoints may lie on its manager's node, which this machine does not
    see, so its tasks are left to look there; a local cluster's folder is here, and
    nothing in it is nothing to resume."""
    from clusterflow.cli.start_settings import resumed_settings

    url = str(tmp_path / "on-another-node")
    cluster = registry.create(f"r-{backend}-abcd")
    settings = {"command": ["true"], "backend": backend, "checkpoint_dir": url}
    registry.write_json_atomic(cluster.config_file, settings)
    cluster.write_state(ClusterState(id=cluster.id, status="failed", backend=backend))
    if backend == "ray":
        assert resumed_settings(cluster.id, fresh=False, new_dir=None) == settings
        assert f"from what {url} holds" in capsys.readouterr().err
    else:
        with pytest.raises(ConfigError, match="committed no checkpoint"):
            resumed_settings(cluster.id, fresh=False, new_dir=None)
