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
- the global batch stayed 12 rows at every size (the default batch policy);
- a newcomer that finds every split lent out takes part with a peer's batch.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import elastic_checks as checks
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_elastic import _job_pids, _pids, _scale, _succeeds

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
PY = sys.executable
RECORDS, EPOCHS = 600, 2
SURVIVORS = ("chief:0", "worker:0", "worker:1")


@pytest.mark.timeout(420)
def test_allreduce_through_fit_resizes_live_2_4_2_as_one_process_would_train(
    cf: Clusterflow, tmp_path: Path
) -> None:
    table = pa.table({"id": pa.array(range(RECORDS), pa.int64())})
    pq.write_table(table, tmp_path / "records.parquet")
    checks.allow(tmp_path, 3 * 8)
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
    cf.wait_until(lambda: checks.steps(tmp_path) >= 3 * 8, 120, f"8 steps\n{cf.output(cluster_id)}")
    before = _job_pids(cf, cluster_id, SURVIVORS)

    said = _scale(cf, cluster_id, 4)
    assert said.endswith("(added worker:2, worker:3)"), said
    newcomers = ("worker:2", "worker:3")
    cf.wait_until(lambda: checks.started(tmp_path, newcomers), 120, "the newcomers' jobs")
    checks.pace(
        tmp_path,
        lambda: checks.steps(tmp_path, "worker:2") >= 1 and checks.steps(tmp_path, "worker:3") >= 1,
        f"steps of worker:2 and worker:3\n{cf.output(cluster_id)}",
    )
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

    said_box: list[str] = []
    shrink = threading.Thread(
        target=lambda: said_box.append(_scale(cf, cluster_id, 2)), daemon=True
    )
    shrink.start()
    checks.pace(tmp_path, lambda: not shrink.is_alive(), f"the shrink\n{cf.output(cluster_id)}")
    assert said_box and said_box[0].endswith("(removed worker:3, worker:2)"), said_box
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

    state = _succeeds(cf, cluster_id, tmp_path)
    assert state["restarts"] == 0
    assert [t["task"] for t in state["tasks"]] == list(SURVIVORS)

    checks.check_allreduce(tmp_path, RECORDS, EPOCHS, SURVIVORS)


@pytest.mark.timeout(300)
def test_a_newcomer_that_finds_every_split_lent_out_takes_part_with_a_peers_batch(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """A newcomer that joins once every split is lent out has no batch to take part in
    its peers' steps with (its data client waits for splits still out): a peer sends it
    one at the boundary, it sits in at a loss scale of 0, and the run ends as one
    process fed the survivors' batches would. Before, it blocked in its data client
    before its first step while its peers waited for its vote (the group hung), and
    without the peer's batch its first step fails (``fit(): this replica has no
    batch``), and with it the whole run.

    8 splits and two clients asking for 4 each at their start: all are lent before the
    first step, and the run has one epoch, so none is left for the newcomer."""
    from elastic_allreduce_job import reference

    records, split = 384, 48
    table = pa.table({"id": pa.array(range(records), pa.int64())})
    pq.write_table(table, tmp_path / "records.parquet")
    checks.allow(tmp_path, 2)
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
    cf.wait_until(lambda: checks.steps(tmp_path) >= 2, 120, f"a step\n{cf.output(cluster_id)}")
    said = _scale(cf, cluster_id, 2)
    assert said.endswith("(added worker:1)"), said
    cf.wait_until(lambda: checks.started(tmp_path, ["worker:1"]), 120, "worker:1's start")
    checks.pace(
        tmp_path,
        lambda: checks.steps(tmp_path, "worker:1") >= 1,
        f"a step of worker:1\n{cf.output(cluster_id)}",
    )
    state = _succeeds(cf, cluster_id, tmp_path)
    assert state["restarts"] == 0

    log = checks.allreduce_log(tmp_path)
    newcomer = [ids for task, _, ids in log if task == "worker:1"]
    assert newcomer and not any(newcomer), newcomer  # it took part, never with a batch
    checks.assert_once_per_epoch(Counter(i for _, _, ids in log for i in ids), records, 1)
    batches: dict[int, list[int]] = defaultdict(list)
    for _, step, ids in log:
        batches[step].extend(ids)
    order = sorted(batches)
    assert order == list(range(1, len(order) + 1)), order
    final = json.loads((tmp_path / "final.json").read_text())["params"]
    expected = reference(batches[s] for s in order)
    assert max(abs(a - b) for a, b in zip(final, expected, strict=True)) < 1e-5, (final, expected)
