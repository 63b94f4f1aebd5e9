"""``CacheSource`` against a real cache server in this process: local reads map the
server's shared-memory files without a copy; another node's reads go over RPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterflow.cache.plan import partition_ranges, place
from clusterflow.cache.server import CacheServer
from clusterflow.cache.store import SchemaMismatchError, inspect, open_source
from clusterflow.data.cache_map import CacheMap
from clusterflow.data.cache_source import CacheSource
from clusterflow.rpc import Credentials

N = 3000


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CacheMap, Credentials]]:
    root = tmp_path_factory.mktemp("cache")
    ids = np.arange(N)
    x = np.stack([ids, -ids], axis=1).astype(np.float32)
    table = pa.table(
        {
            "id": ids,
            "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 2),
            "name": [f"r{i}" for i in range(N)],
        }
    )
    pq.write_table(table, root / "data.parquet", row_group_size=700)
    url = str(root / "data.parquet")
    info = inspect(open_source(url), url)
    parts = place(partition_ranges(N, 2), info.bytes_per_record, ["here"], replicas=0)
    credentials = Credentials.generate()
    server = CacheServer("t", "here", credentials, root / "shm").start()
    try:
        server.load(url, [(p.index, p.start, p.stop) for p in parts], None)
        cache = CacheMap(name="t", source=url, schema=info.schema, partitions=parts, status="ready")
        yield cache.with_servers({"here": server.record()}), credentials
    finally:
        server.close()


def test_local_reads_are_arrays_over_the_shared_mapping(
    served: tuple[CacheMap, Credentials],
) -> None:
    cache, credentials = served
    source = CacheSource("t", node="here", cache_map=cache, credentials=credentials)
    before = pa.total_allocated_bytes()
    columns = source.read(100, 1124)
    assert pa.total_allocated_bytes() == before  # Arrow allocated nothing: no copy
    assert columns["id"].tolist() == list(range(100, 1124))
    assert columns["x"].shape == (1024, 2) and columns["x"][5].tolist() == [105.0, -105.0]
    assert columns["id"].flags.writeable  # a tensor can take it without a copy
    assert columns["name"][0] == "r100"  # strings have no NumPy layout: converted, counted
    stats = source.stats()
    assert stats["records_local"] == 1024 and stats["records_remote"] == 0
    assert stats["bytes_zero_copy"] == 1024 * (8 + 8)
    assert stats["bytes_copied"] > 0 and stats["bytes_remote"] == 0
    columns["id"][0] = -1  # copy-on-write: the cache itself is untouched
    assert source.read(100, 101)["id"].tolist() == [100]
    assert source.location(0, 10) == "here" and source.location(N, N) is None


def test_another_nodes_reads_go_over_the_wire(served: tuple[CacheMap, Credentials]) -> None:
    cache, credentials = served
    source = CacheSource("t", node="elsewhere", cache_map=cache, credentials=credentials)
    try:
        columns = source.read(2040, 2100)  # spans both partitions
        assert columns["id"].tolist() == list(range(2040, 2100))
        stats = source.stats()
        assert stats["records_remote"] == 60 and stats["records_local"] == 0
        assert stats["bytes_remote"] > 60 * 16
    finally:
        source.close()


def test_files_of_differing_schemas_are_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": pa.array([1, 2])}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": pa.array(["1", "2"])}), tmp_path / "b.parquet")
    with pytest.raises(
        SchemaMismatchError, match=r"differ in schema: .*b\.parquet.* has \(id: string\)"
    ):
        open_source(str(tmp_path / "*.parquet"))
