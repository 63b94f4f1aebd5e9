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
  from the sync workers ``scale`` is refused (``tests/unit/test_ps_membership.py``
  pins the leave, which here only matters when the step being collected lacks a
  leaver's commit);
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

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_elastic import _allow, _ended, _job_pids, _pids, _scale, _steps

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
PY = sys.executable
SURVIVORS = ("chief:0", "ps:0", "worker:0", "worker:1")

Part = tuple[str, list[int], bool]
"""A push a step took: (task, ids, whether its gradients were applied)."""


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
    _allow(tmp_path, 3 * 5)
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
    cf.wait_until(lambda: _steps(tmp_path) >= 3 * 5, 120, f"5 steps\n{cf.output(cluster_id)}")
    before = _job_pids(cf, cluster_id, SURVIVORS)

    said = _scale(cf, cluster_id, 4)
    assert said.endswith("(added worker:2, worker:3)"), said
    _allow(tmp_path, _steps(tmp_path) + 5 * 4)
    cf.wait_until(
        lambda: _steps(tmp_path, "worker:2") >= 1 and _steps(tmp_path, "worker:3") >= 1,
        120,
        f"steps of worker:2 and worker:3\n{cf.output(cluster_id)}",
    )
    # the run pauses at the allowed line (every task holds after its push)
    cf.wait_until(
        lambda: _steps(tmp_path) >= int((tmp_path / "allow").read_text()),
        120,
        f"the steps allowed at 5 replicas\n{cf.output(cluster_id)}",
    )
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

    said = _scale(cf, cluster_id, 2)
    assert said.endswith("(removed worker:3, worker:2)"), said
    assert _pids(cf, cluster_id, SURVIVORS) == before, "a resize restarted a surviving task"

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
    # 3 replicas, then 5 from one step on, then 3 again. The two leave one after the
    # other, each at its own step boundary: the step being collected when one was
    # stopped may hold its push, committed before, and the other's; a replica past the
    # pause takes at most one more step, so at most two steps fall between. The end
    # takes fewer as the replicas' data runs out (each leaves the steps then).
    first5 = members.index(five)
    last5 = len(members) - 1 - members[::-1].index(five)
    assert all(m == three for m in members[:first5]), members[:first5]
    assert all(m == five for m in members[first5 : last5 + 1]), members
    tail = members[last5 + 1 :]
    settled = next(i for i in range(len(tail)) if all(m <= three for m in tail[i:]))
    assert settled <= 2 and all(three < m <= five for m in tail[:settled]), tail[:4]
    assert tail[settled:].count(three) >= 3, tail
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
