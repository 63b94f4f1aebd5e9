"""Sources: in-memory columns, Parquet by row group, IPC, CSV, fsspec URLs, bad files."""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from pyarrow import feather

from clusterflow.data import ArrowSource, Source, SourceError, TensorSource, as_source
from clusterflow.errors import ConfigError


def table(n: int) -> pa.Table:
    return pa.table(
        {
            "id": np.arange(n, dtype=np.int64),
            "x": np.arange(n, dtype=np.float32) / 2,
            "pair": pa.array([[i, -i] for i in range(n)], pa.list_(pa.int32(), 2)),
            "name": [f"r{i}" for i in range(n)],
        }
    )


def test_parquet_reads_only_the_row_groups_of_a_range(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(table(1000), path, row_group_size=100)
    source = ArrowSource(str(path))
    assert source.num_records() == 1000 and source.uri == f"parquet:{path}"
    cols = source.read(250, 260)
    assert source.chunks_read == 1
    assert cols["id"].tolist() == list(range(250, 260))
    assert cols["pair"].shape == (10, 2) and cols["pair"][0].tolist() == [250, -250]
    assert cols["name"][0] == "r250"
    cols = source.read(190, 310)  # straddles groups 1, 2 and 3; 2 is cached
    assert cols["id"].tolist() == list(range(190, 310))
    assert source.chunks_read == 3


def test_a_whole_row_group_is_read_writable_in_place_and_never_handed_out_again(
    tmp_path: Path,
) -> None:
    """A split that is one row group comes out writable over the decoded memory (no copy
    for the reader to make), and a batch written in place never changes a later read."""
    path = tmp_path / "t.parquet"
    pq.write_table(table(300), path, row_group_size=100)
    source = ArrowSource(str(path))
    cols = source.read(100, 200)
    for name in ("id", "x", "pair"):
        assert cols[name].flags.writeable, name
        owner = cols[name].base
        while isinstance(owner, np.ndarray):  # the list column is a reshaped view
            owner = owner.base
        assert isinstance(owner, pa.Buffer), name  # Arrow's memory, not a copy
    cols["x"][:] = -1
    cols["pair"][:] = -1
    again = source.read(100, 200)
    assert again["x"].tolist() == [i / 2 for i in range(100, 200)]
    assert again["pair"][0].tolist() == [100, -100]
    assert source.chunks_read == 2  # decoded anew: the written memory was never kept
    part = source.read(200, 250)  # part of a row group: kept decoded, so Arrow's, read-only
    assert not part["x"].flags.writeable and source.read(200, 300)["x"][0] == 100


NUMBER_TYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
NUMBER_TYPES += ["float16", "float32", "float64"]


def test_an_owned_row_group_of_numbers_is_converted_in_one_pass_as_the_general_path_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row group of number columns decoded for one read (``owned``) is converted in one
    pass over its record batch, never column by column, into the arrays the general
    path gives: same values and types, writable over Arrow's memory. A table it does not
    fit (a null, booleans, lists, several chunks, immutable memory) goes the
    general way."""
    from clusterflow.data import columns as columns_module

    n = 300
    numbers = pa.table({t: pa.array(np.arange(n) % 100, type=t) for t in NUMBER_TYPES})
    path = tmp_path / "numbers.parquet"
    pq.write_table(numbers, path, row_group_size=n)
    general = columns_module.arrow_columns(pq.read_table(path))

    def column_by_column(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted column by column")

    with monkeypatch.context() as m:
        m.setattr(columns_module, "_writable_view", column_by_column)
        decoded = pq.ParquetFile(path).read_row_group(0, use_threads=False)
        owned = columns_module.arrow_columns(decoded, owned=True)
    assert list(owned) == NUMBER_TYPES
    for name, values in owned.items():
        assert values.dtype == general[name].dtype and values.tolist() == general[name].tolist()
        assert values.flags.writeable and isinstance(values.base, pa.Buffer), name
    others = {
        "null": pa.table({"v": pa.array([1, None, 3])}),
        "bool": pa.table({"v": [True, False]}),
        "list": pa.table({"v": pa.array([[1, 2]], pa.list_(pa.int32(), 2))}),
        "chunks": pa.concat_tables([pa.table({"v": [1.0, 2.0]}), pa.table({"v": [3.0]})]),
        "immutable": pa.table(  # over bytes, which Arrow may not write
            {"v": pa.Array.from_buffers(pa.float64(), 4, [None, pa.py_buffer(bytes(32))])}
        ),
    }
    for what, other in others.items():
        got = columns_module.arrow_columns(other, owned=True)["v"]
        want = columns_module.arrow_columns(other)["v"]
        assert got.tolist() == want.tolist() and got.dtype == want.dtype, what
    assert not columns_module.arrow_columns(others["immutable"], owned=True)["v"].flags.writeable


def test_directory_of_files_in_name_order(tmp_path: Path) -> None:
    for i in range(3):
        pq.write_table(table(10).slice(0, 10), tmp_path / f"part-{i}.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    source = ArrowSource(str(tmp_path), columns=["id"])
    assert source.num_records() == 30
    assert list(source.read(8, 12)) == ["id"]
    assert source.read(8, 12)["id"].tolist() == [8, 9, 0, 1]
    with pytest.raises(ConfigError, match="no columns"):
        ArrowSource(str(tmp_path), columns=["nope"])


def test_ipc_and_csv(tmp_path: Path) -> None:
    t = table(50).drop(["pair"])
    feather.write_feather(t, tmp_path / "t.arrow", chunksize=20)
    pacsv.write_csv(t, tmp_path / "t.csv")
    ipc = ArrowSource(str(tmp_path / "t.arrow"))
    assert ipc.num_records() == 50 and ipc.read(15, 25)["id"].tolist() == list(range(15, 25))
    assert ipc.chunks_read == 2
    csv = ArrowSource(str(tmp_path / "t.csv"))
    assert csv.read(48, 50)["name"].tolist() == ["r48", "r49"]


def test_fsspec_memory_url() -> None:
    fs = fsspec.filesystem("memory")
    with fs.open("/clusterflow-test/t.parquet", "wb") as f:
        pq.write_table(table(30), f, row_group_size=8)
    source = ArrowSource("memory://clusterflow-test/t.parquet")
    assert source.read(5, 9)["id"].tolist() == [5, 6, 7, 8]
    fs.rm("/clusterflow-test", recursive=True)


def test_only_a_remote_parquet_file_is_pre_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-buffering hands a row group's reads to pyarrow's I/O threads: worth it over a
    network, a thread hand-off per row group from a local file (read in the reading
    thread instead)."""
    opened: list[bool] = []
    real = pq.ParquetFile

    def recording(source: object, **kwargs: object) -> object:
        opened.append(bool(kwargs.get("pre_buffer", True)))  # pyarrow's default: True
        return real(source, **kwargs)

    pq.write_table(table(30), tmp_path / "t.parquet", row_group_size=8)
    fs = fsspec.filesystem("memory")
    with fs.open("/clusterflow-test-buffer/t.parquet", "wb") as f:
        pq.write_table(table(30), f, row_group_size=8)
    monkeypatch.setattr(pq, "ParquetFile", recording)
    try:
        local = ArrowSource(str(tmp_path / "t.parquet"))
        remote = ArrowSource("memory://clusterflow-test-buffer/t.parquet")
        assert local.read(5, 9)["id"].tolist() == remote.read(5, 9)["id"].tolist() == [5, 6, 7, 8]
    finally:
        fs.rm("/clusterflow-test-buffer", recursive=True)
    assert opened == [False, True]


def test_missing_and_unreadable_files_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.parquet"
    with pytest.raises(SourceError, match=str(missing)):
        ArrowSource(str(missing))
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet" * 10)
    with pytest.raises(SourceError, match=r"garbage\.parquet"):
        ArrowSource(str(garbage))
    with pytest.raises(ConfigError, match="format"):
        (tmp_path / "data.bin").write_bytes(b"x")
        ArrowSource(str(tmp_path / "data.bin"))
    with pytest.raises(SourceError, match="no such file"):
        as_source("memory://clusterflow-test/nothing.parquet")


def test_tensor_source_and_protocol() -> None:
    source = TensorSource({"a": np.arange(5), "b": [[1], [2, 3], [4], [5], [6]]})
    assert isinstance(source, Source)
    assert source.read(1, 3)["a"].tolist() == [1, 2]
    assert source.read(1, 3)["b"].tolist() == [[2, 3], [4]]
    assert source.uri.startswith("memory:")
    with pytest.raises(ConfigError, match="differ in length"):
        TensorSource({"a": np.arange(5), "b": np.arange(4)})
    with pytest.raises(ConfigError, match="cannot read records from int"):
        as_source(5)  # type: ignore[arg-type]


def test_nulls_stay_visible(tmp_path: Path) -> None:
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"v": pa.array([1, None, 3], pa.int64())}), path)
    assert ArrowSource(str(path)).read(0, 3)["v"].tolist() == [1, None, 3]


def test_same_file_same_uri_however_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pq.write_table(table(5), tmp_path / "t.parquet")
    monkeypatch.chdir(tmp_path)
    uris = {ArrowSource(p).uri for p in ("t.parquet", str(tmp_path / "t.parquet"))}
    uris.add(ArrowSource(f"file://{tmp_path}/t.parquet").uri)
    assert uris == {f"parquet:{tmp_path}/t.parquet"}
    assert not ArrowSource("t.parquet").has_locations
    located = ArrowSource("t.parquet", location_fn=lambda path: "host-a")
    assert located.has_locations and located.location(0, 5) == "host-a"
