"""A synchronous parameter server in an elastic cluster (issue 32): ``fit`` with the data
service, 2 -> 4 -> 2 workers (3 -> 5 -> 3 replicas with the chief) during one run, by
``clusterflow scale``.

The job (``elastic_sync_ps_job.py``) logs, for each push, the step ps 0 took it into
and the ids it trained on; the test rebuilds every step from them and replays the run
in one process. What this pins:

- the steps follow the membership: they take 3 replicas, then 5 (the newcomers are
  waited for from the step after the manager named them: ``ps.members``, sent before
  they are launched; both count from the same step), then 3 (the leavers are waited
  for no more: ``ps.leave``, sent once each is gone). Without the manager's
  ``ps.members`` (or with ``agrees_with`` refusing another replica count) the ps
  refuses the newcomers at ``ps.create`` and they never step; without ``resizable``
  from the sync workers ``scale`` is refused. Every replica holds after the same step
  while the test resizes (``elastic_job.hold_at``), so the step after the pause holds
  no leaver's commit: without the leave it waits for the leavers for good;
- every record applied exactly once per epoch (each id in the applied parts ``EPOCHS``
  times; a leaver's applied but unacked split comes back as an empty part);
- the surviving tasks' supervisor and job pids unchanged across every resize, and no
  restart at all;
- the run ends with the parameters (within 1e-5) of one process taking the same steps.
"""

from __future__ import annotations

import sys
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
SURVIVORS = ("chief:0", "ps:0", "worker:0", "worker:1")


@pytest.mark.timeout(300)
def test_sync_ps_through_fit_resizes_2_4_2_as_one_process_would_train(
    cf: Clusterflow, tmp_path: Path
) -> None:
    from elastic_sync_ps_job import RECORDS

    table = pa.table({"id": pa.array(range(RECORDS), pa.int64())})
    pq.write_table(table, tmp_path / "records.parquet")
    # steps 0-4 at 3 replicas, then every replica holds
    checks.allow(tmp_path, checks.SYNC_GROW_AFTER)
    cluster_id = cf.start_detached(
        "--chief",
        "--ps",
        "1",
        "--workers",
        "2:4",
        "--",
        PY,
        str(HERE / "elastic_sync_ps_job.py"),
        str(tmp_path),
    )
    three = ("chief:0", "worker:0", "worker:1")
    cf.wait_until(
        lambda: checks.took(tmp_path, three, checks.SYNC_GROW_AFTER),
        120,
        f"step 4\n{cf.output(cluster_id)}",
    )
    before = _job_pids(cf, cluster_id, SURVIVORS)

    said = _scale(cf, cluster_id, 4)
    assert said.endswith("(added worker:2, worker:3)"), said
    checks.allow(tmp_path, checks.SYNC_SHRINK_AFTER)
    five = (*three, "worker:2", "worker:3")
    cf.wait_until(
        lambda: checks.took(tmp_path, five, checks.SYNC_SHRINK_AFTER),
        120,
        f"step 9\n{cf.output(cluster_id)}",
    )
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

    # Every replica holds after step 9, none with a push in flight: the leavers' last
    # pushes are all in the log. (A leaver stopped with its commit in the step being
    # collected is counted in that step, and its log line never written: the ps's
    # quorum rule for it is ``tests/unit/test_ps_membership.py``'s.)
    leavers = _job_pids(cf, cluster_id, ("worker:2", "worker:3"))
    said = _scale(cf, cluster_id, 2)
    assert said.endswith("(removed worker:3, worker:2)"), said
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"
    cf.wait_until(
        lambda: not any(checks.alive(pid) for pids in leavers.values() for pid in pids),
        60,
        "the leavers' exit",
    )

    state = _succeeds(cf, cluster_id, tmp_path)
    assert state["restarts"] == 0
    assert [t["task"] for t in state["tasks"]] == list(SURVIVORS)

    checks.check_sync_ps(tmp_path)  # once per epoch, the steps' membership, the replay
