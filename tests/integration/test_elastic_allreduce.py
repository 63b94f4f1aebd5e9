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

import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import elastic_checks as checks
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_elastic import _ended, _job_pids, _pids, _scale

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

    checks.allow(tmp_path, None)
    cf.wait_until(lambda: _ended(cf, cluster_id), 180, f"the end of {cluster_id}")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    state = cf.state(cluster_id)
    assert state["status"] == "succeeded", f"{state.get('summary')}\n{cf.output(cluster_id)}"
    assert state["restarts"] == 0
    assert [t["task"] for t in state["tasks"]] == list(SURVIVORS)

    checks.check_allreduce(tmp_path, RECORDS, EPOCHS, SURVIVORS)
