"""Elastic clusters on the local backend (issue 32): ``--workers MIN:MAX`` and
``clusterflow scale``.

The job (``elastic_job.py``) trains ``chaos_job.Counter`` through ``fit`` with an async
``ParameterServerStrategy`` and the data service: ``counts[i]`` is how often record
``i``'s update was applied, so "every record applied exactly once per epoch" is every
count equal to the number of epochs, as in the chaos suite. The test paces the job
with ``OUT/allow`` (the job waits at a step boundary while ``steps.log`` holds as many
lines), so each resize happens mid-run and never after the data ran out.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import elastic_checks as checks
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
PY = sys.executable
RECORDS, EPOCHS = 600, 2
SURVIVORS = ("chief:0", "ps:0", "worker:0", "worker:1")


def _pids(cf: Clusterflow, cluster_id: str, tasks: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each task's supervisor pid and its job's pid (the supervisor's child)."""
    return checks.pids(cf.state(cluster_id), tasks)


def _job_pids(cf: Clusterflow, cluster_id: str, tasks: tuple[str, ...]) -> dict[str, Any]:
    """``_pids`` once every one of ``tasks`` has a running job."""
    return checks.running_pids(lambda: cf.state(cluster_id), tasks)


def _ended(cf: Clusterflow, cluster_id: str) -> bool:
    from clusterflow.manager.registry import TERMINAL

    return cf.state(cluster_id).get("status") in TERMINAL


def _start(cf: Clusterflow, out: Path, workers: str, *extra: str) -> str:
    table = pa.table({"id": pa.array(range(RECORDS), pa.int64())})
    pq.write_table(table, out / "records.parquet")
    return cf.start_detached(
        "--chief",
        "--ps",
        "1",
        "--workers",
        workers,
        *extra,
        "--",
        PY,
        str(HERE / "elastic_job.py"),
        str(out),
        str(RECORDS),
        str(EPOCHS),
    )


def _scale(cf: Clusterflow, cluster_id: str, workers: int) -> str:
    done = cf.run("scale", cluster_id, "--workers", str(workers), timeout=200)
    assert done.returncode == 0, f"{done.stderr}\n{cf.output(cluster_id)}"
    return done.stdout.strip()


def _workers_in_spec(cf: Clusterflow, cluster_id: str) -> Any:
    state = cf.state(cluster_id)
    return (state.get("spec") or {}).get("worker"), state.get("spec_version")


def _spec_version(cf: Clusterflow, cluster_id: str, version: int) -> Any:
    """The spec's workers once ``state.json`` shows ``version`` (the manager rewrites it
    at its next poll after a change)."""
    cf.wait_until(
        lambda: cf.state(cluster_id).get("spec_version") == version, 30, f"spec v{version}"
    )
    return _workers_in_spec(cf, cluster_id)[0]


def _succeeds(cf: Clusterflow, cluster_id: str, out: Path) -> dict[str, Any]:
    """Lets the run end (``OUT/allow`` gone); its state, once it succeeded and its
    manager exited."""
    checks.allow(out, None)
    cf.wait_until(lambda: _ended(cf, cluster_id), 180, f"the end of {cluster_id}")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    state = cf.state(cluster_id)
    assert state["status"] == "succeeded", f"{state.get('summary')}\n{cf.output(cluster_id)}"
    return state


def _finish(cf: Clusterflow, cluster_id: str, out: Path) -> None:
    """Lets the run end; every record was applied once per epoch (the chief's
    final.json)."""
    _succeeds(cf, cluster_id, out)
    checks.check_async_ps(out, RECORDS, EPOCHS)


@pytest.mark.timeout(420)
def test_async_ps_through_fit_grows_2_4_2_applying_every_record_once_per_epoch(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """2 -> 4 -> 2 workers during one ``fit`` run with the data service.

    Pins: new workers join at a new spec version and train, both taken by the warm
    standbys kept for the next grow; the leaving ones' leases go
    back (without ``_leave``'s ``release_worker`` the epoch never completes); every
    record applied exactly once per epoch; the surviving tasks' supervisor and job
    pids unchanged across every resize; the membership history in ``describe``.
    """
    checks.allow(tmp_path, 30)
    cluster_id = _start(cf, tmp_path, "2:4")
    cf.wait_until(lambda: checks.steps(tmp_path) >= 30, 120, "30 steps at 2 workers")
    before = _job_pids(cf, cluster_id, SURVIVORS)
    assert _workers_in_spec(cf, cluster_id) == ([*_workers_in_spec(cf, cluster_id)[0]], 1)

    said = _scale(cf, cluster_id, 4)
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"
    assert said.endswith("4 workers at spec version 3 (added worker:2, worker:3)"), said
    assert len(_spec_version(cf, cluster_id, 3)) == 4
    # the newcomers came from the warm standbys kept for a grow (manager/standby.py)
    events = [json.loads(line) for line in (cf.path(cluster_id) / "events.jsonl").open()]
    warm = {e["task"] for e in events if e["event"] == "standby_took_over"}
    assert warm == {"worker:2", "worker:3"}, events
    # the newcomers train: each logs steps of its own
    checks.allow(tmp_path, checks.steps(tmp_path) + 40)
    cf.wait_until(
        lambda: checks.steps(tmp_path, "worker:2") >= 1 and checks.steps(tmp_path, "worker:3") >= 1,
        120,
        "steps of worker:2 and worker:3",
    )
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

    said = _scale(cf, cluster_id, 2)
    assert said.endswith("2 workers at spec version 5 (removed worker:3, worker:2)"), said
    assert len(_spec_version(cf, cluster_id, 5)) == 2
    assert [t["task"] for t in cf.state(cluster_id)["tasks"]] == list(SURVIVORS)
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

    _finish(cf, cluster_id, tmp_path)
    state = cf.state(cluster_id)
    assert state["restarts"] == 0
    assert [t["restarts"] for t in state["tasks"]] == [0, 0, 0, 0]

    history = [(m["task"], m["change"], m["spec_version"]) for m in state["membership"]]
    # the two newcomers register in either order; the highest-indexed leaves first
    assert sorted(history[:2]) == [("worker:2", "joined", 2), ("worker:3", "joined", 3)] or sorted(
        history[:2]
    ) == [("worker:2", "joined", 3), ("worker:3", "joined", 2)], history
    assert history[2:] == [("worker:3", "left", 4), ("worker:2", "left", 5)], history
    # the size each change left the job at: the newcomers' own, not the grow's final one
    assert [m["workers"] for m in state["membership"]] == [3, 4, 3, 2], state["membership"]
    assert state["workers_range"] == [2, 4]
    shown = cf.run("describe", cluster_id)
    assert "workers:  2 (elastic, 2:4)" in shown.stdout, shown.stdout
    assert "worker:3       left    spec v4" in shown.stdout, shown.stdout
    as_json = json.loads(cf.run("describe", cluster_id, "--json").stdout)
    assert as_json["membership"] == state["membership"]


@pytest.mark.timeout(300)
def test_a_worker_lost_above_min_with_no_restart_left_leaves_and_the_run_goes_on(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """Pins ``Decision.SHRINK`` (``policy._may_leave``): a worker killed at 3 of 2:3
    workers with ``--max-restarts 0`` leaves; nothing restarts, the others keep their
    pids, every record is applied once per epoch. Without the rule the run fails."""
    checks.allow(tmp_path, 20)
    cluster_id = _start(cf, tmp_path, "2:3", "--max-restarts", "0")
    cf.wait_until(lambda: checks.steps(tmp_path) >= 20, 120, "20 steps at 2 workers")
    _scale(cf, cluster_id, 3)
    checks.allow(tmp_path, checks.steps(tmp_path) + 30)
    cf.wait_until(lambda: checks.steps(tmp_path, "worker:2") >= 1, 120, "a step of worker:2")
    others = ("chief:0", "ps:0", "worker:0", "worker:2")
    before = _job_pids(cf, cluster_id, (*others, "worker:1"))
    os.kill(before.pop("worker:1")[1], signal.SIGKILL)
    cf.wait_until(
        lambda: any(m["change"] == "lost" for m in cf.state(cluster_id).get("membership") or []),
        60,
        f"worker:1 lost\n{cf.output(cluster_id)}",
    )
    assert _pids(cf, cluster_id, others) == before, "the loss restarted another task"
    workers, _ = _workers_in_spec(cf, cluster_id)
    assert workers == {"0": workers["0"], "2": workers["2"]}, workers  # a sparse job

    _finish(cf, cluster_id, tmp_path)
    state = cf.state(cluster_id)
    assert state["restarts"] == 0
    assert [t["task"] for t in state["tasks"]] == list(others)


@pytest.mark.timeout(240)
def test_bad_scale_requests_are_one_line_with_exit_2_and_leave_the_cluster_untouched(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """Unknown, fixed-size, below MIN, above MAX, below 1, ``--ps``, finished: each
    refused, nothing changed. (A job that declared that it does not resize is refused
    in the pipeline test below; one that declared nothing, as this one, is restarted at
    the new size: test_elastic_restart.py.)"""
    job = ["--", PY, "-c", "import time; time.sleep(600)"]
    fixed = cf.start_detached("--workers", "2", *job)
    elastic = cf.start_detached("--workers", "2:3", *job)
    for cluster_id in (fixed, elastic):
        cf.wait_until(lambda c=cluster_id: cf.state(c).get("status") == "running", 60, "running")
    snapshot = {
        c: (_workers_in_spec(cf, c), _pids(cf, c, ("worker:0", "worker:1")))
        for c in (fixed, elastic)
    }
    cases = [
        (["scale", "nosuchcluster", "--workers", "2"], "no cluster"),
        (["scale", fixed, "--workers", "3"], f"cluster {fixed} has a fixed size of 2 worker(s)"),
        (["scale", elastic, "--workers", "1"], "--workers 1 is outside the range 2:3"),
        (["scale", elastic, "--workers", "4"], "--workers 4 is outside the range 2:3"),
        (["scale", elastic, "--workers", "0"], "--workers must be at least 1, got 0"),
        (["scale", elastic, "--ps", "2"], "scale --ps: the ps tasks keep their number"),
        (["scale", elastic, "--workers", "x"], "'x' is not a valid integer"),
    ]
    for args, message in cases:
        done = cf.run(*args)
        lines = done.stderr.splitlines()
        assert done.returncode == 2, (args, done.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
            args,
            done.stderr,
        )
    for cluster_id, before in snapshot.items():
        assert (
            _workers_in_spec(cf, cluster_id),
            _pids(cf, cluster_id, ("worker:0", "worker:1")),
        ) == before
        assert cf.state(cluster_id).get("membership") == []
    assert cf.run("stop", fixed, "--grace", "2").returncode == 0
    done = cf.run("scale", fixed, "--workers", "2")
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: cluster {fixed} is not running (stopped): nothing to scale"
    ), done.stderr


COORDINATED = """\
import os, sys
from pathlib import Path
from clusterflow.strategies import TFConfigClusterResolver

OUT = Path(sys.argv[1])
resolver = TFConfigClusterResolver()
if resolver.task_type == "worker":
    from clusterflow.strategies.coordinator import serve_worker
    serve_worker()
    sys.exit(0)
from clusterflow.strategies.coordinator import ClusterCoordinator
from clusterflow.strategies.parameter_server import ParameterServerStrategy

coordinator = ClusterCoordinator(ParameterServerStrategy(resolver), worker_timeout_s=5.0)


def where():
    return os.environ["CLUSTERFLOW_TASK"]


while not (OUT / "done").exists():
    values = [coordinator.schedule(where) for _ in range(8)]
    coordinator.join()  # raises if a function failed
    with open(OUT / "rounds.log", "a") as log:
        log.write(" ".join(sorted({v.fetch() for v in values})) + "\\n")
coordinator.close()
"""


def _rounds(out: Path) -> list[set[str]]:
    log = out / "rounds.log"
    return [set(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.timeout(300)
def test_the_coordinator_sends_functions_to_the_workers_a_scale_adds_and_not_to_those_it_removes(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """Pins ``ClusterCoordinator._follow_membership``: at a new spec version it uses the
    new workers and stops using the departed ones; no function fails, the chief and the
    surviving workers keep their pids."""
    script = cf.script("coordinated.py", COORDINATED)
    cluster_id = cf.start_detached(
        "--chief", "--ps", "1", "--workers", "2:4", "--", PY, str(script), str(tmp_path)
    )
    cf.wait_until(lambda: len(_rounds(tmp_path)) >= 3, 120, "rounds at 2 workers")
    kept = ("chief:0", "worker:0", "worker:1")
    before = _job_pids(cf, cluster_id, kept)
    assert set().union(*_rounds(tmp_path)) <= {"worker:0", "worker:1"}  # one may start late

    _scale(cf, cluster_id, 4)
    cf.wait_until(
        lambda: any({"worker:2", "worker:3"} <= r for r in _rounds(tmp_path)),
        60,
        f"a round on the new workers\n{cf.output(cluster_id)}",
    )
    _scale(cf, cluster_id, 2)
    after = len(_rounds(tmp_path))
    cf.wait_until(
        lambda: any(r == {"worker:0", "worker:1"} for r in _rounds(tmp_path)[after:]),
        60,
        f"a round on worker:0 and worker:1 alone\n{cf.output(cluster_id)}",
    )
    assert _pids(cf, cluster_id, kept) == before, "a resize restarted a surviving task"
    # a name that left may come back: worker:2 again, a new process at spec version 6
    said = _scale(cf, cluster_id, 3)
    assert said.endswith("3 workers at spec version 6 (added worker:2)"), said
    after = len(_rounds(tmp_path))
    cf.wait_until(
        lambda: any("worker:2" in r for r in _rounds(tmp_path)[after:]),
        60,
        f"a round on worker:2 again\n{cf.output(cluster_id)}",
    )
    assert _pids(cf, cluster_id, kept) == before, "a resize restarted a surviving task"
    (tmp_path / "done").write_text("")
    cf.wait_until(lambda: _ended(cf, cluster_id), 60, f"the end of {cluster_id}")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    state = cf.state(cluster_id)
    assert state["status"] == "succeeded", f"{state.get('summary')}\n{cf.output(cluster_id)}"
    assert state["restarts"] == 0


PIPELINE = """\
import sys, torch
from pathlib import Path
from torch import nn
import clusterflow as cf

out = Path(sys.argv[1])
strategy = cf.PipelineStrategy("1f1b", microbatches=2)
with strategy.scope():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))


def done():
    # Both stages stop after the same round: one that saw the file alone would leave
    # the other waiting in the next round's first step for a peer that has exited.
    seen = torch.tensor([float((out / "done").exists())])
    torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
    return bool(seen.item())


rounds = 0
while not done():
    cf.fit(model, nn.CrossEntropyLoss(), optimizer, (x, y), strategy=strategy,
           epochs=1, global_batch_size=16, seed=rounds)
    rounds += 1
    (out / f"rounds-{cf.TFConfigClusterResolver().task_id}").write_text(str(rounds))
"""


def _rounds_done(path: Path) -> int:
    """The rounds a stage wrote it finished (0 while the file is being rewritten)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


@pytest.mark.timeout(240)
def test_a_pipeline_keeps_its_stage_count_and_scale_is_refused_in_one_line(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """Issue 32: a pipeline's stage count is the model's cut, so its workers never
    declare that they resize; ``scale`` on it is one line, exit 2, and the stages run on
    in the same processes."""
    script = cf.script("pipeline_scaled.py", PIPELINE)
    cluster_id = cf.start_detached("--workers", "2:3", "--", PY, str(script), str(tmp_path))
    cf.wait_until(
        lambda: all((tmp_path / f"rounds-{i}").exists() for i in (0, 1)), 120, "a pipeline round"
    )
    before = _job_pids(cf, cluster_id, ("worker:0", "worker:1"))
    done = cf.run("scale", cluster_id, "--workers", "3")
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "have not declared that they resize live" in lines[0] and "pipeline" in lines[0]
    rounds = _rounds_done(tmp_path / "rounds-0")
    cf.wait_until(lambda: _rounds_done(tmp_path / "rounds-0") > rounds, 60, "the stages to go on")
    assert _job_pids(cf, cluster_id, ("worker:0", "worker:1")) == before
    addresses, _ = _workers_in_spec(cf, cluster_id)
    assert len(addresses) == 2 and cf.state(cluster_id).get("membership") == []
    (tmp_path / "done").write_text("")
    cf.wait_until(lambda: _ended(cf, cluster_id), 60, "the pipeline to end")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    assert cf.state(cluster_id)["status"] == "succeeded", cf.output(cluster_id)
