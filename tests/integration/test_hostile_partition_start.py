"""Partitions from the manager under ``clusterflow start`` (docs/failure-semantics.md).

One real cluster (``--chief --ps 1 --workers 2``, the counter model through ``fit()``),
the manager and every task each inside an emulated host (``start --backend hosts``),
runs once for the module (``benchmarks/scenarios/start.py``): first ``worker:0``'s host
is cut from ``ps:0``'s, then ``worker:1``'s from the manager's, each until the manager
has respawned the task and the replacement trained, then ``ps:0``'s from the manager's
until the manager has restarted every task; each link heals.
The run must succeed with every record applied exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from benchmarks.scenarios import start as scenario

from clusterflow.rpc.auth import Credentials
from clusterflow.testing import available

pytestmark = pytest.mark.integration

if not available():
    pytest.skip("needs root and iproute2 to make network namespaces", allow_module_level=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[scenario.Run]:
    # run() stops the cluster and removes the hosts (namespaces, bridge) in its finally.
    yield scenario.run(tmp_path_factory.mktemp("partition-start"))


def _detail(run: scenario.Run) -> str:
    return f"status {run.status}, cuts {run.cuts}\n{run.output}"


@pytest.mark.timeout(300)
def test_every_task_runs_in_its_host_at_its_address_with_curve(run: scenario.Run) -> None:
    hosts = run.addresses
    assert run.manager.rsplit(":", 1)[0] == hosts["manager"], _detail(run)
    placed = {
        f"{job}:{i}": address.rsplit(":", 1)[0]
        for job, addresses in run.spec.items()
        for i, address in enumerate(addresses)
    }
    assert placed == {t: hosts[t] for t in ("chief:0", "ps:0", "worker:0", "worker:1")}
    # Beyond loopback the cluster's secret yields curve keys (plain is refused there).
    assert Credentials.generate().resolve_mode(hosts["manager"]) == "curve"


@pytest.mark.timeout(300)
def test_a_worker_cut_from_its_ps_raises_at_its_deadline_and_is_respawned_before_the_heal(
    run: scenario.Run,
) -> None:
    cut = next((c for c in run.cuts if c.scenario == "worker_ps"), None)
    assert cut is not None, _detail(run)
    assert cut.recovery == "task_respawned", _detail(run)
    assert cut.ended_before_heal, _detail(run)
    assert "DeadlineExceeded" in run.output, _detail(run)


@pytest.mark.timeout(300)
def test_a_worker_cut_from_the_manager_stops_and_is_respawned_before_the_heal(
    run: scenario.Run,
) -> None:
    cut = next((c for c in run.cuts if c.scenario == "worker_manager"), None)
    assert cut is not None, _detail(run)
    assert cut.recovery == "task_respawned", _detail(run)
    # Its supervisor gave up on the manager and stopped it while the link was still cut.
    assert cut.ended_before_heal, _detail(run)


@pytest.mark.timeout(300)
def test_a_ps_cut_from_the_manager_restarts_every_task_and_the_run_resumes(
    run: scenario.Run,
) -> None:
    cut = next((c for c in run.cuts if c.scenario == "ps_manager"), None)
    assert cut is not None, f"the run ended before the ps was cut: {_detail(run)}"
    assert cut.recovery == "cluster_restarted", _detail(run)
    assert cut.ended_before_heal, _detail(run)


@pytest.mark.timeout(300)
def test_the_run_succeeds_with_every_record_applied_exactly_once(run: scenario.Run) -> None:
    assert [c.scenario for c in run.cuts] == list(scenario.SCENARIOS), _detail(run)
    assert run.status == "succeeded", _detail(run)
    assert (run.lost, run.duplicated) == (0, 0), _detail(run)


def test_the_placement_file_is_checked() -> None:
    from clusterflow.errors import ConfigError
    from clusterflow.testing.hosts_backend import Placement, Slot, for_run

    with pytest.raises(ConfigError, match="CLUSTERFLOW_HOSTS"):
        for_run(object(), environ={})
    with pytest.raises(ConfigError, match="not an emulated host's address"):
        Slot("place-1-abcdef-0", "8.8.8.8")
    with pytest.raises(ConfigError, match="not an emulated host's namespace"):
        Slot("x; rm -rf /", "10.77.0.1")
    spare = Slot("place-1-abcdef-5", "10.77.0.6")
    with pytest.raises(ConfigError, match="heartbeat_timeout_s must be a positive"):
        Placement(manager=spare, tasks={}, spare=spare, limits={"heartbeat_timeout_s": -1})
    with pytest.raises(ConfigError, match="limit 'host' unknown"):
        Placement(manager=spare, tasks={}, spare=spare, limits={"host": 1.0})


def test_a_bad_placement_file_is_one_line(tmp_path: Path) -> None:
    from clusterflow.errors import ConfigError
    from clusterflow.testing.hosts_backend import Placement

    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a placement file"):
        Placement.read(str(tmp_path / "p.json"))


def test_start_backend_hosts_without_a_placement_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CLUSTERFLOW_HOSTS"}
    env["CLUSTERFLOW_HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "clusterflow.cli.main", "start", "--detach", "--backend", "hosts",
         "--workers", "1", "--", sys.executable, "-c", "pass"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --backend hosts needs CLUSTERFLOW_HOSTS=<placement file> "
        "(clusterflow.testing.hosts_backend.Placement.write)"
    ]
    assert not (tmp_path / "clusters").exists() or not any((tmp_path / "clusters").iterdir())
