"""Elastic clusters on Ray (issue 32): the three 2 -> 4 -> 2 scenarios of the local
backend (async ps, sync ps and ``MultiWorkerMirroredStrategy``, each through ``fit``
with the data service) on one Ray cluster of emulated hosts.

The jobs are the local tests' (``elastic_job.py``, ``elastic_sync_ps_job.py``,
``elastic_allreduce_job.py``) and so are the checks of their logs (``elastic_checks``):
every record applied exactly once per epoch, the sync and all-reduce runs ending with
the parameters of one process taking the same steps (within 1e-5), and the surviving
tasks' supervisor and job pids unchanged across every resize (the state's ``pid`` is
the supervisor its actor started on its node; the hosts share this machine's pids).

On Ray the grow is the growth watcher's (``manager/ray_growth.py``): under
``--workers 2:4`` it takes whatever free room Ray reports. Each worker asks one
``slot`` (a custom resource; CPUs never bind here), two nodes hold two slots each, and
a driver of the test (``Room``) holds two of them in a placement group of its own
while the cluster starts and runs at two workers. Releasing them is the "node that
joins": the watcher grows the cluster onto them, 2 -> 4 workers, while the job holds
at the point the test chose. The shrink is ``clusterflow scale --workers 2``, which
also caps the watcher at 2 (``Elastic.scale_ceiling``), so the freed room is not
taken again.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import elastic_checks as checks
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterflow.manager.registry import TERMINAL
from clusterflow.testing import available
from conftest import LineReader, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

if not available():
    pytest.skip("needs root and iproute2 for the emulated hosts", allow_module_level=True)

from test_ray_growth import Cli  # noqa: E402

from clusterflow.testing.ray_nodes import RayNodes  # noqa: E402 (after the skip)

HERE = Path(__file__).resolve().parent
PY = sys.executable
SLOTS = '--resources={"slot": 2}'

HOLDER = """
import sys, ray
from ray.util.placement_group import placement_group, remove_placement_group
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
group, n = None, 0
print("ready", flush=True)
for line in sys.stdin:
    n += 1
    if line.strip() == "hold":
        group = placement_group([{"slot": 2}])
        ray.get(group.ready(), timeout=120)
    elif group is not None:
        remove_placement_group(group)
        group = None
    print(line.strip(), n, flush=True)
"""


class Room:
    """Two worker slots held by a driver of the test (a placement group of one bundle,
    so both on one node) until ``release``; ``hold`` takes them again."""

    def __init__(self, nodes: RayNodes) -> None:
        self._proc = nodes.popen([PY, "-c", HOLDER, nodes.address], stdin=subprocess.PIPE)
        assert self._proc.stdout is not None
        self._lines = LineReader(self._proc.stdout)
        self._lines.wait_for("ready", 120)
        self._asked = 0

    def _say(self, what: str) -> None:
        assert self._proc.stdin is not None
        self._asked += 1
        self._proc.stdin.write(what + "\n")
        self._proc.stdin.flush()
        self._lines.wait_for(f"{what} {self._asked}", 150)

    def hold(self) -> None:
        self._say("hold")

    def release(self) -> None:
        self._say("release")

    def close(self) -> None:
        self._proc.kill()
        self._proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[tuple[RayNodes, Room]]:
    """Two Ray nodes (the head, host 0, and host 1) of two slots each; every process of
    every host is killed at the end, even on failure."""
    with RayNodes(2, prefix="relastic") as nodes:
        nodes.start_head("--num-cpus=4", SLOTS)
        nodes.start_node(1, "--num-cpus=4", SLOTS)
        wait_until(lambda: len(nodes.probe()["nodes"]) == 2, 60, "two Ray nodes")
        room = Room(nodes)
        try:
            yield nodes, room
        finally:
            room.close()


@pytest.fixture
def cf(ray_nodes: tuple[RayNodes, Room], tmp_path: Path) -> Iterator[Cli]:
    """The CLI, with two slots held; afterwards every cluster the test left running is
    stopped, nothing of it may remain in Ray, and the test's room is released."""
    nodes, room = ray_nodes
    room.hold()
    cli = Cli(nodes, tmp_path / "home")
    try:
        yield cli
    finally:
        room.release()  # first: the check that Ray holds nothing counts its group too
        cli.stop_all()


def _output(cf: Cli, cluster: str, size: int = 6000) -> str:
    """The end of the cluster's output, pulled from its manager (``describe`` pulls it)."""
    cf("describe", cluster)
    path = cf.home / "clusters" / cluster / "output.log"
    return path.read_text()[-size:] if path.exists() else ""


@contextlib.contextmanager
def _explained(cf: Cli, cluster: str) -> Iterator[None]:
    """A wait that timed out inside says the end of the cluster's output."""
    try:
        yield
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{_output(cf, cluster)}") from None


def _start(cf: Cli, out: Path, records: int, job: str, *args: str, ps: bool = True) -> str:
    table = pa.table({"id": pa.array(range(records), pa.int64())})
    pq.write_table(table, out / "records.parquet")
    started = cf(
        "start", "--backend", "ray", "--address", cf.nodes.address, "--chief",
        *(("--ps", "1") if ps else ()), "--workers", "2:4",
        "--resources", "worker:slot=1", "--detach",
        "--", PY, str(HERE / job), str(out), *args,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr + started.stdout
    return started.stdout.strip()


def _state(cf: Cli, cluster: str) -> dict[str, Any]:
    """The state the manager writes on its node (the head's disk; the emulated hosts
    share this machine's files): read without a CLI call and a Ray connection, as the
    waits poll it. ``describe --json`` reads the same through the CLI's mirror."""
    path = cf.nodes.home / "ray" / cluster / "state.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def _joined(state: dict[str, Any]) -> list[str]:
    return [m["task"] for m in state.get("membership") or [] if m["change"] == "joined"]


def _grow(cf: Cli, room: Room, cluster: str) -> dict[str, Any]:
    """Frees the two slots; the watcher grows the cluster onto them (worker:2 and
    worker:3 registered); returns the state then."""
    room.release()
    state: dict[str, Any] = wait_until(
        lambda: sorted(_joined(s := _state(cf, cluster))) == ["worker:2", "worker:3"] and s,
        120,
        "the watcher's grow to 4 workers",
    )
    return state


def _shrink(cf: Cli, cluster: str) -> str:
    done = cf("scale", cluster, "--workers", "2")
    assert done.returncode == 0, f"{done.stderr}\n{_output(cf, cluster)}"
    said = done.stdout.strip()
    assert said.endswith("2 workers at spec version 5 (removed worker:3, worker:2)"), said
    return said


def _finish(cf: Cli, cluster: str, out: Path, survivors: tuple[str, ...]) -> dict[str, Any]:
    """Lets the run end; it succeeded with no restart, the survivors alone left."""
    checks.allow(out, None)
    wait_until(lambda: _state(cf, cluster)["status"] in TERMINAL, 180, f"the end of {cluster}")
    state = cf.state(cluster)
    assert state["status"] == "succeeded", f"{state.get('summary')}\n{_output(cf, cluster)}"
    assert state["restarts"] == 0
    assert [t["task"] for t in state["tasks"]] == list(survivors)
    assert [t["restarts"] for t in state["tasks"]] == [0] * len(survivors)
    history = [(m["task"], m["change"], m["spec_version"]) for m in state["membership"]]
    # the two newcomers of the watcher's grow register in either order
    assert sorted(history[:2]) in (
        [("worker:2", "joined", 2), ("worker:3", "joined", 3)],
        [("worker:2", "joined", 3), ("worker:3", "joined", 2)],
    ), history
    assert history[2:] == [("worker:3", "left", 4), ("worker:2", "left", 5)], history
    return state


def _pids_of(cf: Cli, cluster: str) -> Callable[[tuple[str, ...]], dict[str, tuple[int, int]]]:
    return lambda tasks: checks.pids(_state(cf, cluster), tasks)


def test_async_ps_grows_2_4_2_on_ray_applying_every_record_once_per_epoch(
    ray_nodes: tuple[RayNodes, Room], cf: Cli, tmp_path: Path
) -> None:
    """``elastic_job`` (async ps): the newcomers train; the leavers' leases go back
    (else the epoch never completes); every record applied once per epoch; the
    survivors' pids unchanged."""
    _, room = ray_nodes
    records, epochs = 400, 2
    survivors = ("chief:0", "ps:0", "worker:0", "worker:1")
    checks.allow(tmp_path, 20)
    cluster = _start(cf, tmp_path, records, "elastic_job.py", str(records), str(epochs))
    with _explained(cf, cluster):
        wait_until(lambda: checks.steps(tmp_path) >= 20, 180, "20 steps at 2 workers")
        pids = _pids_of(cf, cluster)
        before = checks.running_pids(lambda: _state(cf, cluster), survivors)

        _grow(cf, room, cluster)
        checks.allow(tmp_path, checks.steps(tmp_path) + 10)
        wait_until(
            lambda: (
                checks.steps(tmp_path, "worker:2") >= 1 and checks.steps(tmp_path, "worker:3") >= 1
            ),
            120,
            "steps of worker:2 and worker:3",
        )
        assert pids(survivors) == before, "a resize restarted a surviving task"

        _shrink(cf, cluster)
        assert pids(survivors) == before, "a resize restarted a surviving task"
        _finish(cf, cluster, tmp_path, survivors)
        checks.check_async_ps(tmp_path, records, epochs)


def test_sync_ps_resizes_2_4_2_on_ray_as_one_process_would_train(
    ray_nodes: tuple[RayNodes, Room], cf: Cli, tmp_path: Path
) -> None:
    """``elastic_sync_ps_job``: every replica holds after step 4 while the watcher
    grows the cluster and after step 9 while it shrinks; the steps follow the
    membership, every record once per epoch, the one-process parameters."""
    from elastic_sync_ps_job import RECORDS

    _, room = ray_nodes
    survivors = ("chief:0", "ps:0", "worker:0", "worker:1")
    three = ("chief:0", "worker:0", "worker:1")
    checks.allow(tmp_path, checks.SYNC_GROW_AFTER)
    cluster = _start(cf, tmp_path, RECORDS, "elastic_sync_ps_job.py")
    with _explained(cf, cluster):
        wait_until(
            lambda: checks.took(tmp_path, three, checks.SYNC_GROW_AFTER),
            180,
            "step 4 at 3 replicas",
        )
        pids = _pids_of(cf, cluster)
        before = checks.running_pids(lambda: _state(cf, cluster), survivors)

        _grow(cf, room, cluster)
        checks.allow(tmp_path, checks.SYNC_SHRINK_AFTER)
        five = (*three, "worker:2", "worker:3")
        wait_until(
            lambda: checks.took(tmp_path, five, checks.SYNC_SHRINK_AFTER),
            120,
            "step 9 at 5 replicas",
        )
        assert pids(survivors) == before, "a resize restarted a surviving task"

        leavers = checks.running_pids(lambda: _state(cf, cluster), ("worker:2", "worker:3"))
        _shrink(cf, cluster)
        assert pids(survivors) == before, "a resize restarted a surviving task"
        wait_until(
            lambda: not any(checks.alive(pid) for pair in leavers.values() for pid in pair),
            60,
            "the leavers' exit",
        )
        _finish(cf, cluster, tmp_path, survivors)
        checks.check_sync_ps(tmp_path)


def test_allreduce_resizes_live_2_4_2_on_ray_as_one_process_would_train(
    ray_nodes: tuple[RayNodes, Room], cf: Cli, tmp_path: Path
) -> None:
    """``elastic_allreduce_job`` (``MultiWorkerMirroredStrategy``): the survivors
    re-form the group across hosts, the newcomers receive the model and the momentum
    from a survivor; every record once per epoch, the one-process parameters."""
    _, room = ray_nodes
    records, epochs = 600, 2
    survivors = ("chief:0", "worker:0", "worker:1")
    checks.allow(tmp_path, 3 * 8)
    cluster = _start(
        cf, tmp_path, records, "elastic_allreduce_job.py", str(records), str(epochs), ps=False
    )
    with _explained(cf, cluster):
        wait_until(lambda: checks.steps(tmp_path) >= 3 * 8, 180, "8 steps at 3 replicas")
        pids = _pids_of(cf, cluster)
        before = checks.running_pids(lambda: _state(cf, cluster), survivors)

        _grow(cf, room, cluster)
        newcomers = ("worker:2", "worker:3")
        wait_until(lambda: checks.started(tmp_path, newcomers), 120, "the newcomers' jobs")
        checks.pace(
            tmp_path,
            lambda: (
                checks.steps(tmp_path, "worker:2") >= 1 and checks.steps(tmp_path, "worker:3") >= 1
            ),
            "steps of worker:2 and worker:3",
        )
        assert pids(survivors) == before, "a resize restarted a surviving task"

        said: list[str] = []
        shrink = threading.Thread(target=lambda: said.append(_shrink(cf, cluster)), daemon=True)
        shrink.start()
        checks.pace(tmp_path, lambda: not shrink.is_alive(), "the shrink")
        assert said, "the shrink failed"
        assert pids(survivors) == before, "a resize restarted a surviving task"
        _finish(cf, cluster, tmp_path, survivors)
        checks.check_allreduce(tmp_path, records, epochs, survivors)
