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

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_elastic import _allow, _ended, _job_pids, _pids, _scale

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
PY = sys.executable
SURVIVORS = ("chief:0", "ps:0", "worker:0", "worker:1")

Part = tuple[str, list[int], bool]
"""A push a step took: (task, ids, whether its gradients were applied)."""


def _took(out: Path, tasks: tuple[str, ...], step: int) -> bool:
    """Whether every one of ``tasks`` logged a push that step ``step`` took."""
    if not (out / "steps.log").exists():
        return False
    return all(any(t == task and s == step for t, s, _, _ in _log(out)) for task in tasks)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _log(out: Path) -> list[tuple[str, int | None, bool, list[int]]]:
    """``(task, step, applied, ids)`` per logged push; ``step`` None: no step took it."""
    rows = []
    for line in (out / "steps.log").read_text().splitlines():
        task, _, step, _, applied, _, ids = line.split(" ")
        taken = None if step == "-" else int(step)
        rows.append((task, taken, applied == "1", [int(i) for i in ids.split(",")]))
    return rows


@pytest.mark.timeout(300)
def test_sync_ps_through_fit_resizes_2_4_2_as_one_process_would_train(
    cf: Clusterflow, tmp_path: Path
) -> None:
    sys.path.insert(0, str(HERE))
    from elastic_sync_ps_job import EPOCHS, RECORDS, reference

    table = pa.table({"id": pa.array(range(RECORDS), pa.int64())})
    pq.write_table(table, tmp_path / "records.parquet")
    _allow(tmp_path, 4)  # steps 0-4 at 3 replicas, then every replica holds
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
    cf.wait_until(lambda: _took(tmp_path, three, 4), 120, f"step 4\n{cf.output(cluster_id)}")
    before = _job_pids(cf, cluster_id, SURVIVORS)

    said = _scale(cf, cluster_id, 4)
    assert said.endswith("(added worker:2, worker:3)"), said
    _allow(tmp_path, 9)
    five = (*three, "worker:2", "worker:3")
    cf.wait_until(lambda: _took(tmp_path, five, 9), 120, f"step 9\n{cf.output(cluster_id)}")
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
        lambda: not any(_alive(pid) for pids in leavers.values() for pid in pids),
        60,
        "the leavers' exit",
    )

    _allow(tmp_path, None)
    cf.wait_until(lambda: _ended(cf, cluster_id), 180, f"the end of {cluster_id}")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    state = cf.state(cluster_id)
    assert state["status"] == "succeeded", f"{state.get('summary')}\n{cf.output(cluster_id)}"
    assert state["restarts"] == 0
    assert [t["task"] for t in state["tasks"]] == list(SURVIVORS)

    log = _log(tmp_path)
    seen = Counter(i for _, step, applied, ids in log if step is not None and applied for i in ids)
    wrong = {i: seen.get(i, 0) for i in range(RECORDS) if seen.get(i, 0) != EPOCHS}
    assert not wrong, f"records not applied exactly {EPOCHS}x: {wrong}"

    steps: dict[int, list[Part]] = defaultdict(list)
    for task, step, applied, ids in log:
        if step is not None:
            steps[step].append((task, ids, applied))
    order = sorted(steps)
    assert order == list(range(len(order))), order  # one sequence of steps, none missing
    members = [frozenset(task for task, _, _ in steps[s]) for s in order]
    three, five = (
        frozenset({"chief:0", "worker:0", "worker:1"}),
        frozenset({"chief:0", "worker:0", "worker:1", "worker:2", "worker:3"}),
    )
    # 3 replicas, then 5 from one step on, then 3 again from the step after the pause;
    # the end takes fewer as the replicas' data runs out (each leaves the steps then).
    first5 = members.index(frozenset(five))
    last5 = len(members) - 1 - members[::-1].index(frozenset(five))
    assert last5 == 9, members
    assert all(m == frozenset(three) for m in members[:first5]), members[:first5]
    assert all(m == frozenset(five) for m in members[first5 : last5 + 1]), members
    tail = members[last5 + 1 :]
    assert all(m <= frozenset(three) for m in tail), tail
    assert tail[:3] == [frozenset(three)] * 3, tail
    joined = {
        task: min(s for s in order if task in members[s]) for task in ("worker:2", "worker:3")
    }
    assert set(joined.values()) == {first5}, joined  # both counted from the same step

    finals = [json.loads(p.read_text()) for p in tmp_path.glob("final-*.json")]
    assert len(finals) == 3, finals  # the survivors'; the leavers were stopped
    final = max(finals, key=lambda f: f["version"])
    assert final["version"] == len(order)
    expected = reference([[(ids, applied) for _, ids, applied in steps[s]] for s in order])
    assert max(abs(a - b) for a, b in zip(final["params"], expected, strict=True)) < 1e-5, (
        final,
        expected,
    )
