"""Caches on the local backend: real cache-server daemons, real Parquet files, the CLI.

Each test has its own ``CLUSTERFLOW_HOME`` (the ``cf`` fixture); the ``caches`` fixture
kills every cache server the test left behind and removes its shared memory, even when
the test failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterflow.rpc import Credentials, RpcClient
from conftest import Clusterflow

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RECORDS = 6000
JOB = textwrap.dedent(
    """
    import json, os, sys, time
    from clusterflow.data import distributed_dataset, numpy_collate

    out = sys.argv[1]
    data = distributed_dataset(  # NumPy batches: no torch import, a faster test
        "cache://", batch_size=100, split_size=1024, seed=1, collate_fn=numpy_collate
    )
    # Both workers start reading together: the data service hands splits to whoever asks
    # first, so a worker that starts seconds late (a cold import) could otherwise find
    # every split taken, and this test is about each worker's own reads.
    name = os.environ["CLUSTERFLOW_TASK"].replace(":", "-")
    open(os.path.join(out, name + ".ready"), "w").close()
    deadline = time.monotonic() + 60
    while len([f for f in os.listdir(out) if f.endswith(".ready")]) < 2:
        assert time.monotonic() < deadline, "the other worker never started"
        time.sleep(0.02)
    seen = []
    for batch in data:
        seen.extend(int(i) for i in batch.data["id"])
        assert batch.data["x"].shape[1:] == (4,)
    locality = data.status()["locality"]
    stats = data.source.stats()
    data.close()
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump({"ids": seen, "stats": stats, "locality": locality}, f)
    """
)


def write_parquet(folder: Path, files: int = 2, records: int = RECORDS) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    per = records // files
    for f in range(files):
        ids = np.arange(f * per, (f + 1) * per)
        x = np.random.default_rng(f).random((per, 4), dtype=np.float32)
        table = pa.table(
            {"id": ids, "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4)}
        )
        pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=500)
    return str(folder / "*.parquet")


@pytest.fixture
def caches(cf: Clusterflow) -> Iterator[Clusterflow]:
    """``cf``, and afterwards every cache server of this test's home killed, its shared
    memory removed."""
    yield cf
    for record in (cf.home / "caches").glob("*/nodes/*.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(record.read_text())
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(int(data["pid"]))
                if str(record.parent.parent) in proc.cmdline():
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
            for path in data.get("files", {}).values():
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def server_stats(cf: Clusterflow, name: str) -> dict[str, int]:
    folder = cf.home / "caches" / name
    record = json.loads(next((folder / "nodes").glob("*.json")).read_text())
    with RpcClient(record["address"], Credentials.from_file(folder / "secret"), deadline=10) as c:
        stats: dict[str, int] = c.call("cache.stats").body
    return stats


def test_workers_read_every_record_once_through_shared_memory(
    tmp_path: Path, caches: Clusterflow
) -> None:
    cf = caches
    source = write_parquet(tmp_path / "src")
    made = cf.run("cache", "create", "digits", "--from", source, "--partitions", "3")
    assert made.returncode == 0, made.stderr
    assert "6000 records in 3 partitions" in made.stdout

    listed = cf.run("cache", "ls").stdout.splitlines()
    assert listed[1].split()[:3] == ["digits", "3", "6000"] and listed[1].endswith("ready")
    described = json.loads(cf.run("cache", "describe", "digits", "--json").stdout)
    spans = [(p[1], p[2]) for p in described["partitions"]]
    assert spans == [(0, 2048), (2048, 4096), (4096, 6000)]  # on multiples of 1024
    (node,) = described["bytes_per_node"]
    assert described["bytes_per_node"][node] >= RECORDS * (8 + 16)  # id + 4 floats, held

    out = tmp_path / "out"
    out.mkdir()
    script = cf.script("job.py", JOB)
    run = cf.run(
        "start", "--cache", "digits", "--workers", "2", "--",
        sys.executable, str(script), str(out), timeout=150,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(results) == 2
    ids = sorted(i for r in results for i in r["ids"])
    assert ids == list(range(RECORDS))  # every record, exactly once, across both workers
    for r in results:
        assert r["ids"], "both workers got splits"
        stats = r["stats"]
        assert stats["records_local"] == len(r["ids"]) and stats["records_remote"] == 0
        assert stats["bytes_copied"] == 0 and stats["bytes_remote"] == 0
        assert stats["bytes_zero_copy"] == len(r["ids"]) * (8 + 16)
    locality = results[0]["locality"]
    assert locality["local"] == locality["located"] == 6  # every split lent where it lies
    sent = server_stats(cf, "digits")
    assert sent["records_sent"] == 0 and sent["bytes_sent"] == 0  # nothing over a socket

    # The cache outlived the cluster; drop frees it.
    folder = cf.home / "caches" / "digits"
    record = json.loads(next((folder / "nodes").glob("*.json")).read_text())
    assert psutil.pid_exists(record["pid"])
    dropped = cf.run("cache", "drop", "digits")
    assert dropped.returncode == 0, dropped.stderr
    assert not folder.exists()
    assert not any(os.path.exists(p) for p in record["files"].values())
    assert cf.alive([record["pid"]]) == []


def test_bad_input_is_one_line_and_exit_2_and_loses_nothing(
    tmp_path: Path, caches: Clusterflow
) -> None:
    cf = caches
    source = write_parquet(tmp_path / "src", records=2000)
    assert cf.run("cache", "create", "kept", "--from", source, "--partitions", "2").returncode == 0
    other = tmp_path / "other"
    write_parquet(other, files=1, records=100)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(other / "part-0.parquet", mixed / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([1.5, 2.5])}), mixed / "b.parquet")

    new = ["cache", "create", "new", "--from"]
    cases = {
        "unknown cache": (["cache", "describe", "nope"], "no cache 'nope' (caches: kept)"),
        "unknown drop": (["cache", "drop", "nope"], "no cache 'nope'"),
        "unknown start": (["start", "--cache", "nope", "--", "true"], "no cache 'nope'"),
        "0 partitions": (
            [*new, source, "--partitions", "0"],
            "--partitions must be an integer >= 1, got 0",
        ),
        "missing source": (
            [*new, str(tmp_path / "none/*.parquet"), "--partitions", "2"],
            "no files at",
        ),
        "schemas differ": (
            [*new, str(mixed), "--partitions", "1"],
            "differ in schema",
        ),
        "name taken": (
            ["cache", "create", "kept", "--from", str(other), "--partitions", "1"],
            "cache 'kept' exists",
        ),
        "does not fit": (
            [*new, source, "--partitions", "2", "--memory-per-node", "10K"],
            "does not fit node",
        ),
    }  # fmt: skip
    for what, (argv, message) in cases.items():
        done = cf.run(*argv)
        assert done.returncode == 2, (what, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (what, done.stderr)
        assert message in lines[0], (what, lines[0])
    assert "short by" in cf.run(*cases["does not fit"][0]).stderr

    # Nothing of the existing cache was lost, and nothing of the failed ones remains.
    assert sorted(p.name for p in (cf.home / "caches").iterdir()) == ["kept"]
    listed = cf.run("cache", "ls").stdout.splitlines()
    assert len(listed) == 2 and listed[1].split()[:3] == ["kept", "2", "2000"]
    assert listed[1].endswith("ready")
    code = (
        "from clusterflow.data.cache_source import CacheSource\n"
        "s = CacheSource('cache://kept'); c = s.read(0, 2000)\n"
        "print(int(c['id'].sum()), s.stats()['records_local'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(sum(range(2000))), "2000"]
