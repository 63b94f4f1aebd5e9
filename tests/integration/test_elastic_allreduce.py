"""An all-reduce group that resizes live (issue 32): ``MultiWorkerMirroredStrategy``
through ``fit`` with the data service, 2 -> 4 -> 2 workers (3 -> 5 -> 3 replicas with
the chief) during one run, by ``clusterflow scale``.

The job (``elastic_allreduce_job.py``) logs the ids each replica trained on at each
step; the test rebuilds every step's global batch from them and replays the run in one
process. What this pins:

- every record applied exactly once per epoch (each id in the log ``EPOCHS`` times);
- the surviving tasks' supervisor and job pids unchanged across every resize (they
  re-form the group, they are not restarted), and no restart at all;
- the run ends with the parameters (within 1e-5) of one process fed the same global
  batches: the newcomers got the model and the SGD momentum from a survivor, every
  replica took part in the same steps (the boundary agreement), and each step's update
  is the mean over the union of the replicas' batches (shares of 12 rows over 5
  replicas are uneven: 3, 3, 2, 2, 2);
- the global batch stayed 12 rows at every size (the default batch policy).
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_elastic import _allow, _ended, _job_pids, _pids, _scale, _steps

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
PY = sys.executable
RECORDS, EPOCHS = 600, 2
SURVIVORS = ("chief:0", "worker:0", "worker:1")


def _log(out: Path) -> list[tuple[str, int, list[int]]]:
    """``(task, step, ids)`` per logged step."""
    rows = []
    for line in (out / "steps.log").read_text().splitlines():
        task, _, step, _, ids = line.split(" ")
        rows.append((task, int(step), [int(i) for i in ids.split(",") if i != "-"]))
    return rows


def _pace(cf: Clusterflow, out: Path, done: Callable[[], bool], what: str) -> None:
    """Lets the run go on a line of ``steps.log`` at a time until ``done()``: a step is
    a few milliseconds, and a resize must find the run still going (rank 0 sees a
    newcomer at its next look at the manager's spec; a leaver leaves at the next step
    boundary, within the stop's grace period), yet never after the data ran out."""

    def advanced() -> bool:
        if done():
            return True
        _allow(out, _steps(out) + 1)
        return False

    cf.wait_until(advanced, 180, what)


@pytest.mark.timeout(420)
def test_allreduce_through_fit_resizes_live_2_4_2_as_one_process_would_train(
    cf: Clusterflow, tmp_path: Path
) -> None:
    sys.path.insert(0, str(HERE))
    from elastic_allreduce_job import reference

    table = pa.table({"id": pa.array(range(RECORDS), pa.int64())})
    pq.write_table(table, tmp_path / "records.parquet")
    _allow(tmp_path, 3 * 8)
    cluster_id = cf.start_detached(
        "--chief",
        "--workers",
        "2:4",
        "--",
        PY,
        str(HERE / "elastic_allreduce_job.py"),
        str(tmp_path),
        str(RECORDS),
        str(EPOCHS),
    )
    cf.wait_until(lambda: _steps(tmp_path) >= 3 * 8, 120, f"8 steps\n{cf.output(cluster_id)}")
    before = _job_pids(cf, cluster_id, SURVIVORS)

    said = _scale(cf, cluster_id, 4)
    assert said.endswith("(added worker:2, worker:3)"), said
    # the survivors hold until the newcomers' jobs run: a cold start under load can
    # outlast the steps left, and then they would only sit in at the end
    cf.wait_until(
        lambda: all((tmp_path / f"up-worker:{i}").exists() for i in (2, 3)),
        120,
        "the starts of worker:2 and worker:3",
    )
    _pace(
        cf,
        tmp_path,
        lambda: _steps(tmp_path, "worker:2") >= 1 and _steps(tmp_path, "worker:3") >= 1,
        f"steps of worker:2 and worker:3\n{cf.output(cluster_id)}",
    )
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

    said_box: list[str] = []
    shrink = threading.Thread(
        target=lambda: said_box.append(_scale(cf, cluster_id, 2)), daemon=True
    )
    shrink.start()
    _pace(cf, tmp_path, lambda: not shrink.is_alive(), f"the shrink\n{cf.output(cluster_id)}")
    assert said_box and said_box[0].endswith("(removed worker:3, worker:2)"), said_box
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

    _allow(tmp_path, None)
    cf.wait_until(lambda: _ended(cf, cluster_id), 180, f"the end of {cluster_id}")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    state = cf.state(cluster_id)
    assert state["status"] == "succeeded", f"{state.get('summary')}\n{cf.output(cluster_id)}"
    assert state["restarts"] == 0
    assert [t["task"] for t in state["tasks"]] == list(SURVIVORS)

    log = _log(tmp_path)
    seen = Counter(i for _, _, ids in log for i in ids)
    wrong = {i: seen.get(i, 0) for i in range(RECORDS) if seen.get(i, 0) != EPOCHS}
    assert not wrong, f"records not applied exactly {EPOCHS}x: {wrong}"

    batches: dict[int, list[int]] = defaultdict(list)
    shares: dict[int, dict[str, int]] = defaultdict(dict)
    for task, step, ids in log:
        batches[step].extend(ids)
        shares[step][task] = len(ids)
    steps = sorted(batches)
    assert steps == list(range(1, len(steps) + 1)), steps  # one sequence of steps
    worlds = [len(shares[s]) for s in steps]
    assert worlds[0] == 3 and 5 in worlds and 4 in worlds and worlds[-1] == 3, worlds
    # The global batch stays 12 rows: each replica's batch is its share (4 at 3
    # replicas, 3 or 2 at 5, 3 at 4), but at the step a group re-forms (the survivors
    # read their batch before it), a leaver's last step (it takes all the records of
    # the splits it began), an epoch's end and the run's end.
    resized = {s for s in steps[1:] if shares[s].keys() != shares[s - 1].keys()}
    last_of = {task: step for task, step, _ in log if task not in SURVIVORS}
    over = {
        s: shares[s]
        for s in steps
        if s not in resized
        and any(
            rows > -(-12 // len(shares[s])) and last_of.get(task) != s
            for task, rows in shares[s].items()
        )
    }
    assert not over, f"batches above the replica's share of 12 rows: {over}"
    # (at the end the replicas wait for each other's last splits: smaller batches)
    full = [s for s in steps if len(batches[s]) == 12]
    assert len(full) >= 2 * len(steps) // 3, {s: len(batches[s]) for s in steps}

    final = json.loads((tmp_path / "final.json").read_text())["params"]
    expected = reference(batches[s] for s in steps)
    assert max(abs(a - b) for a, b in zip(final, expected, strict=True)) < 1e-5, (
        final,
        expected,
    )


@pytest.mark.timeout(300)
def test_a_newcomer_that_finds_every_split_lent_out_takes_part_with_a_peers_batch(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """A newcomer that joins once every split is lent out has no batch to take part in
    its peers' steps with (its data client waits for splits still out): a peer sends it
    one at the boundary, it sits in at a loss scale of 0, and the run ends as one
    process fed the survivors' batches would. Without the peer's batch its first step
    failed (``fit(): this replica ... has no batch``), and with it the whole run.

    8 splits and two clients asking for 4 each at their start: all are lent before the
    first step, and the run has one epoch, so none is left for the newcomer."""
    sys.path.insert(0, str(HERE))
    from elastic_allreduce_job import reference

    records, split = 384, 48
    table = pa.table({"id": pa.array(range(records), pa.int64())})
    pq.write_table(table, tmp_path / "records.parquet")
    _allow(tmp_path, 2)
    cluster_id = cf.start_detached(
        "--chief",
        "--workers",
        "1:2",
        "--",
        PY,
        str(HERE / "elastic_allreduce_job.py"),
        str(tmp_path),
        str(records),
        "1",
        str(split),
    )
    cf.wait_until(lambda: _steps(tmp_path) >= 2, 120, f"a step\n{cf.output(cluster_id)}")
    said = _scale(cf, cluster_id, 2)
    assert said.endswith("(added worker:1)"), said
    cf.wait_until((tmp_path / "up-worker:1").exists, 120, "worker:1's start")
    _pace(
        cf,
        tmp_path,
        lambda: _steps(tmp_path, "worker:1") >= 1,
        f"a step of worker:1\n{cf.output(cluster_id)}",
    )
    _allow(tmp_path, None)
    cf.wait_until(lambda: _ended(cf, cluster_id), 180, f"the end of {cluster_id}")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    state = cf.state(cluster_id)
    assert state["status"] == "succeeded", f"{state.get('summary')}\n{cf.output(cluster_id)}"
    assert state["restarts"] == 0

    log = _log(tmp_path)
    newcomer = [ids for task, _, ids in log if task == "worker:1"]
    assert newcomer and not any(newcomer), newcomer  # it took part, never with a batch
    seen = Counter(i for _, _, ids in log for i in ids)
    wrong = {i: seen.get(i, 0) for i in range(records) if seen.get(i, 0) != 1}
    assert not wrong, f"records not applied exactly once: {wrong}"
    batches: dict[int, list[int]] = defaultdict(list)
    for _, step, ids in log:
        batches[step].extend(ids)
    steps = sorted(batches)
    assert steps == list(range(1, len(steps) + 1)), steps
    final = json.loads((tmp_path / "final.json").read_text())["params"]
    expected = reference(batches[s] for s in steps)
    assert max(abs(a - b) for a, b in zip(final, expected, strict=True)) < 1e-5, (final, expected)
