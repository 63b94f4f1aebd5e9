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
    import os, sys
    from clusterflow.data import distributed_dataset

    path, out = sys.argv[1], sys.argv[2]
    seen = []
    data = distributed_dataset(path, batch_size=16, split_size=25, seed=3, epochs=1)
    for batch in data:
        seen.extend(int(i) for i in batch.data["id"])
    data.close()
    with open(os.path.join(out, os.environ["CLUSTERFLOW_TASK"].replace(":", "-")), "w") as f:
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
    seen = {p.name: [int(v) for v in p.read_text().split()] for p in out.iterdir()}
    assert set(seen) == {"worker-0", "worker-1"}
    ids = seen["worker-0"] + seen["worker-1"]
    assert sorted(ids) == list(range(records))  # every record once, across both workers
    assert seen["worker-0"] and seen["worker-1"]  # both got splits from one file
