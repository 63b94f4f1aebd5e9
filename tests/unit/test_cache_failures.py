"""A node's failed load reaches the command that created the cache by its kind, not its words.

A local cache server writes its failure into its record (``NodeServer.failure``), a Ray
cache actor into its reply (``plan.failure_kind``); the creating command raises
``CacheMemoryError`` for a shortfall of memory and ``ConfigError`` for anything else,
whatever the message says.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clusterflow.cache import local, plan
from clusterflow.cache.plan import CacheMemoryError, partition_ranges, place
from clusterflow.cache.server import serve_local
from clusterflow.cache.store import inspect, open_source
from clusterflow.data.cache_map import CacheMap, NodeServer
from clusterflow.errors import ConfigError
from clusterflow.rpc import Credentials

N = 2000


def _folder(tmp_path: Path) -> Path:
    """A cache's folder as ``local.create`` leaves it for its server: plan and secret."""
    ids = np.arange(N)
    pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float32)}), tmp_path / "d.parquet")
    url = str(tmp_path / "d.parquet")
    info = inspect(open_source(url), url)
    parts = place(partition_ranges(N, 2), info.bytes_per_record, ["here"], replicas=0)
    cache = CacheMap(name="t", source=url, schema=info.schema, partitions=parts, status="loading")
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "cache.json").write_text(json.dumps(cache.to_json()))
    Credentials.generate().to_file(folder / "secret")
    return folder


def test_a_local_server_short_of_memory_records_the_kind_and_the_creator_raises_by_it(
    tmp_path: Path,
) -> None:
    folder = _folder(tmp_path)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:  # serve_local is a daemon's body: it takes SIGINT and SIGTERM for itself
        code = serve_local(folder, "here", str(tmp_path / "shm"), limit=100)
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert code == 1
    record = NodeServer.from_json(json.loads((folder / "nodes" / "here.json").read_text()))
    assert record.status.startswith("failed: ") and record.failure == plan.MEMORY
    error = local._load_failure("t", record)
    assert isinstance(error, CacheMemoryError)
    assert str(error).startswith("cache 't' does not fit node here") and "short by" in str(error)


def test_the_creator_decides_by_the_recorded_kind_never_by_the_reason_words() -> None:
    worded = NodeServer(node="n", address="a:1", status="failed: x does not fit", failure="config")
    error = local._load_failure("t", worded)
    assert type(error) is ConfigError
    assert str(error) == "cache 't' failed to load: failed: x does not fit"
    unworded = NodeServer(node="n", address="a:1", status="failed: out", failure=plan.MEMORY)
    assert isinstance(local._load_failure("t", unworded), CacheMemoryError)


def test_a_ray_actors_failure_travels_as_its_kind() -> None:
    short = plan.load_error("short by 1K", plan.failure_kind(CacheMemoryError("short by 1K")))
    assert isinstance(short, CacheMemoryError) and str(short) == "short by 1K"
    other = plan.load_error("does not fit", plan.failure_kind(ConfigError("does not fit")))
    assert type(other) is ConfigError


def test_a_record_keeps_its_failure_kind_through_json_and_old_records_read_as_none() -> None:
    record = NodeServer(node="n", address="a:1", status="failed: why", failure=plan.MEMORY)
    assert NodeServer.from_json(record.to_json()) == record
    old = {k: v for k, v in record.to_json().items() if k != "failure"}
    assert NodeServer.from_json(old).failure == ""
