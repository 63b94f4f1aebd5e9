"""The data service as ``clusterflow start`` hosts it: in the manager, found from the env."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import Clusterflow

pytestmark = pytest.mark.integration

JOB = textwrap.dedent(
    """
    import os, sys, time
    from clusterflow.data import distributed_dataset

    path, out = sys.argv[1], sys.argv[2]
    seen = []
    data = distributed_dataset(path, batch_size=16, split_size=25, seed=3, epochs=1)
    # Splits go to whoever asks first, and the 40 here take a worker milliseconds: one
    # that starts a little ahead could take them all. This test wants both to read, so
    # each, holding its first batch, waits for the other's first batch (a worker leases
    # only a few splits ahead, so the other always finds some left).
    task = os.environ["CLUSTERFLOW_TASK"].replace(":", "-")
    for n, batch in enumerate(data):
        seen.extend(int(i) for i in batch.data["id"])
        if n == 0:
            open(os.path.join(out, task + ".first"), "w").close()
            deadline = time.monotonic() + 60
            while len([f for f in os.listdir(out) if f.endswith(".first")]) < 2:
                assert time.monotonic() < deadline, "the other worker read nothing"
                time.sleep(0.02)
    data.close()
    with open(os.path.join(out, task), "w") as f:
        f.write(" ".join(map(str, seen)))
    """
)


@pytest.mark.timeout(180)
def test_workers_of_a_cluster_share_one_epoch_through_the_managers_dispatcher(
    tmp_path: Path, cf: Clusterflow
) -> None:
    records = 1000
    table = pa.table({"id": pa.array(range(records), pa.int64()), "x": pa.array([0.5] * records)})
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=100)
    script = cf.script("job.py", JOB)
    out = tmp_path / "out"
    out.mkdir()
    data = str(tmp_path / "data.parquet")
    result = cf.run(
        "start", "--workers", "2", "--", sys.executable, str(script), data, str(out), timeout=150
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = {p.name: [int(v) for v in p.read_text().split()] for p in out.glob("worker-?")}
    assert set(seen) == {"worker-0", "worker-1"}
    ids = seen["worker-0"] + seen["worker-1"]
    assert sorted(ids) == list(range(records))  # every record once, across both workers
    assert seen["worker-0"] and seen["worker-1"]  # both got splits from one file


MIRRORED_JOB = textwrap.dedent(
    """
    import os, sys, torch
    from clusterflow.data import distributed_dataset
    from clusterflow.strategies import MultiWorkerMirroredStrategy

    torch.set_num_threads(1)
    path, out = sys.argv[1], sys.argv[2]
    strategy = MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = distributed_dataset(path, batch_size=10, split_size=10, seed=3, epochs=1)
    ids, steps = [], 0

    def step(batch):
        opt.zero_grad()
        model(batch.data["x"].float().unsqueeze(1)).sum().backward()
        opt.step()

    for batch in strategy.distribute(data):
        strategy.run(step, (batch,))
        ids.extend(int(i) for i in batch.data["id"])
        steps += 1
    data.close()
    with open(os.path.join(out, f"rank-{strategy.rank}"), "w") as f:
        f.write(f"{steps}\\n" + " ".join(map(str, ids)))
    """
)


@pytest.mark.timeout(180)
def test_mirrored_replicas_take_their_own_leases_and_stop_together(
    tmp_path: Path, cf: Clusterflow
) -> None:
    records = 205  # 21 splits: one replica always has a batch more than the other
    table = pa.table({"id": pa.array(range(records), pa.int64()), "x": pa.array([0.5] * records)})
    pq.write_table(table, tmp_path / "data.parquet")
    script = cf.script("mirrored_job.py", MIRRORED_JOB)
    out = tmp_path / "out"
    out.mkdir()
    data = str(tmp_path / "data.parquet")
    result = cf.run(
        "start", "--workers", "2", "--", sys.executable, str(script), data, str(out), timeout=150
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = [(tmp_path / "out" / f"rank-{r}").read_text().split("\n") for r in range(2)]
    steps = [int(run[0]) for run in runs]
    ids = [[int(v) for v in run[1].split()] for run in runs]
    assert steps[0] == steps[1] > 0  # the same number of all-reduce steps: nobody hung
    assert not set(ids[0]) & set(ids[1])  # each replica trained on its own records
    # Every step took one batch (at most 10 records: the 5-record split makes a short
    # one) on each replica; the records of the batches left unread were never acked.
    assert steps[0] * 2 * 10 - 5 <= len(ids[0]) + len(ids[1]) <= min(records, 20 * steps[0])
