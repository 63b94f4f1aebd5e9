"""Built-in sources: in-memory columns, and Parquet / Arrow IPC / CSV through pyarrow.

``ArrowSource`` finds files with ``pyarrow.dataset`` over any fsspec filesystem
(``file://``, ``memory://``, ``s3://``, ...) and reads a record range by its *chunks*:
Parquet row groups and IPC record batches, located from file metadata, so a split costs
the row groups it overlaps and never a whole file. CSV has no index to seek by, so a CSV
file is parsed once per process and kept in memory.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from clusterflow._checks import whole
from clusterflow.data.api import Columns, Source, SourceError, UnknownFormatError
from clusterflow.data.cache_source import CacheSource
from clusterflow.data.columns import arrow_columns
from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

FORMATS = ("parquet", "ipc", "csv")
_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "ipc",
    ".feather": "ipc",
    ".ipc": "ipc",
    ".csv": "csv",
}
DEFAULT_CACHED_CHUNKS = 2
"""Decoded chunks kept per source: a split that straddles two row groups reads each once."""


# In memory ---------------------------------------------------------------------------


class TensorSource:
    """Records held in memory as named columns (tensors, NumPy arrays or sequences).

    Every worker must build the same columns (e.g. from the same seed or file): the
    dispatcher sends ranges, not data.

    Raises:
        ConfigError: no columns, or columns of different lengths.
    """

    def __init__(self, columns: Mapping[str, Any]) -> None:
        if not columns:
            raise ConfigError("TensorSource needs at least one column")
        self._columns = {str(k): _to_column(str(k), v) for k, v in columns.items()}
        lengths = {k: len(v) for k, v in self._columns.items()}
        if len(set(lengths.values())) != 1:
            raise ConfigError(f"TensorSource columns differ in length: {lengths}")
        self._n = next(iter(lengths.values()))
        layout = ";".join(f"{k}:{v.dtype}:{v.shape}" for k, v in self._columns.items())
        self.uri = f"memory:{hashlib.sha256(layout.encode()).hexdigest()[:16]}"

    def num_records(self) -> int:
        return self._n

    def read(self, start: int, stop: int) -> Columns:
        return {k: v[start:stop] for k, v in self._columns.items()}


def _to_column(name: str, value: Any) -> np.ndarray:
    """One column as an array of records; a scalar (a 0-d array or tensor, a number, a
    string) is refused: it has no records, and a string's would be its characters."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ConfigError(f"TensorSource column {name!r} must hold records, got a scalar")
        return value
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ConfigError(
            f"TensorSource column {name!r} must be an array, a tensor or a sequence of "
            f"records, got {type(value).__name__} {value!r:.60}"
        )
    items = list(value)
    try:
        array = np.asarray(items)
        if array.dtype != object and array.ndim >= 1:
            return array
    except ValueError:
        pass  # ragged: kept as Python objects, so collation can name the bad record
    objects = np.empty(len(items), dtype=object)
    objects[:] = items
    return objects


# Arrow formats -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Chunk:
    file: int
    index: int
    """Row group (Parquet) or record batch (IPC) within the file; 0 for CSV."""
    rows: int


class ArrowSource:
    """Records of Parquet, Arrow IPC (Feather v2) or CSV files, local or remote.

    Args:
        path: a file, a directory, or a list of files; a path or an fsspec URL.
        format: ``parquet``, ``ipc`` or ``csv``; by default from the file extension.
        columns: the columns to read (all by default).
        storage_options: passed to fsspec (credentials, endpoints).
        location_fn: the host storing a file, for location-aware splits (e.g. from a
            distributed filesystem's block map); None when every host is as near.
        cached_chunks: decoded row groups kept for reads that straddle them.

    Raises:
        SourceError: a path does not exist, or a file is not of the format.
        UnknownFormatError: the format cannot be told from the file names (a
            ``ConfigError``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        format: str | None = None,
        columns: Sequence[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        location_fn: Callable[[str], str | None] | None = None,
        cached_chunks: int = DEFAULT_CACHED_CHUNKS,
    ) -> None:
        import pyarrow.dataset as ds  # type: ignore[import-untyped]

        cached = whole("cached_chunks", cached_chunks, least=1)  # before any file is opened
        urls = (
            [os.fspath(path)]
            if isinstance(path, str | os.PathLike)
            else [os.fspath(p) for p in path]
        )
        if not urls:
            raise ConfigError("ArrowSource needs at least one path")
        fs, files = _resolve(urls, storage_options or {})
        self.format = format or _infer_format(files)
        if self.format not in FORMATS:
            raise ConfigError(f"unknown format {self.format!r}; expected one of {FORMATS}")
        # Compared when workers register: local paths absolute, so cwd does not matter.
        self.uri = f"{self.format}:{','.join(_normalize(u) for u in urls)}"
        self.files = files
        self.columns = list(columns) if columns is not None else None
        self._fs = fs
        self._location_fn = location_fn
        self._lock = threading.Lock()
        self._handles: dict[int, Any] = {}
        self._cache: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._cached_chunks = cached
        self._tables: dict[int, Any] = {}  # CSV files, parsed whole
        self.chunks_read = 0
        """Chunks decoded so far (cache misses): what a read of a split costs."""
        try:
            self._dataset = ds.dataset(files, format=self._ds_format(), filesystem=fs)
        except _arrow_errors() as exc:
            raise SourceError(f"cannot open {self.uri!r}: {exc}") from exc
        if self.columns is not None:
            missing = [c for c in self.columns if c not in self._dataset.schema.names]
            if missing:
                raise ConfigError(
                    f"{self.uri!r} has no columns {missing}; it has {self._dataset.schema.names}"
                )
        self._chunks = [c for i in range(len(files)) for c in self._index(i)]
        self._starts = [0]
        for chunk in self._chunks:
            self._starts.append(self._starts[-1] + chunk.rows)
        log.debug("%s: %d records in %d chunks", self.uri, self._starts[-1], len(self._chunks))

    def num_records(self) -> int:
        return self._starts[-1]

    def read(self, start: int, stop: int) -> Columns:
        """Records ``[start, stop)``, reading only the chunks that hold them.

        A range that is exactly one Parquet row group not held decoded (a split of a
        file written one row group per split, as recommended) is decoded for this read
        alone and not kept: its numeric columns come out writable over the decoded
        memory itself, so the reader makes no copy of them, and since no later read
        gets that memory, a batch written in place never changes what is read next.
        """
        whole = self._whole_chunk(start, stop)
        if whole is not None:
            return arrow_columns(self._decode(whole), owned=True)
        return arrow_columns(self.read_table(start, stop))

    def file_schemas(self) -> list[Any]:
        """Each file's own Arrow schema (the dataset itself takes the first file's)."""
        try:
            return [fragment.physical_schema for fragment in self._dataset.get_fragments()]
        except _arrow_errors() as exc:
            raise SourceError(f"cannot read the schemas of {self.uri!r}: {exc}") from exc

    def read_table(self, start: int, stop: int) -> Any:
        """Records ``[start, stop)`` as a pyarrow Table (what ``read`` converts)."""
        import pyarrow as pa  # type: ignore[import-untyped]

        if not 0 <= start <= stop <= self.num_records():
            raise SourceError(f"{self.uri!r}: no records [{start}, {stop}) in {self.num_records()}")
        first = bisect.bisect_right(self._starts, start) - 1
        pieces = []
        k = first
        while k < len(self._chunks) and self._starts[k] < stop:
            table = self._chunk(k)
            lo = max(start, self._starts[k]) - self._starts[k]
            hi = min(stop, self._starts[k + 1]) - self._starts[k]
            pieces.append(table.slice(lo, hi - lo))
            k += 1
        if not pieces:
            return _select(self._dataset.schema.empty_table(), self.columns)
        return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)

    @property
    def has_locations(self) -> bool:
        """Whether ``location`` can say anything (only with a ``location_fn``)."""
        return self._location_fn is not None

    def location(self, start: int, stop: int) -> str | None:
        """The host of the file holding record ``start`` (by ``location_fn``)."""
        if self._location_fn is None or start >= self.num_records():
            return None
        k = bisect.bisect_right(self._starts, start) - 1
        return self._location_fn(self.files[self._chunks[k].file])

    # Internals -------------------------------------------------------------------------

    def _ds_format(self) -> str:
        return "feather" if self.format == "ipc" else self.format

    def _index(self, i: int) -> list[_Chunk]:
        """The chunks of file ``i``, from its metadata (Parquet footer, IPC batch list)."""
        try:
            if self.format == "parquet":
                meta = self._handle(i).metadata
                return [
                    _Chunk(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
                ]
            if self.format == "ipc":
                reader = self._handle(i)
                return [
                    _Chunk(i, b, reader.get_batch(b).num_rows)
                    for b in range(reader.num_record_batches)
                ]
            return [_Chunk(i, 0, self._csv(i).num_rows)]
        except _arrow_errors() as exc:
            raise SourceError(f"cannot read {self.files[i]!r} as {self.format}: {exc}") from exc

    def _handle(self, i: int) -> Any:
        handle = self._handles.get(i)
        if handle is None:
            import pyarrow as pa
            import pyarrow.fs as pafs  # type: ignore[import-untyped]
            import pyarrow.parquet as pq  # type: ignore[import-untyped]

            local = isinstance(self._fs, pafs.LocalFileSystem)
            if self.format == "parquet":
                # Pre-buffering coalesces a row group's reads and issues them on
                # pyarrow's I/O threads: worth it where a read is a network round trip,
                # but from a local file it is a thread hand-off per row group, a tenth
                # of a split's read CPU (docs/benchmarks.md, "Data service: local reads").
                handle = pq.ParquetFile(
                    self._fs.open_input_file(self.files[i]), pre_buffer=not local
                )
            elif local:
                # Memory-mapped: indexing touches only batch headers, reads share the map.
                handle = pa.ipc.open_file(pa.memory_map(self.files[i]))
            else:
                handle = pa.ipc.open_file(self._fs.open_input_file(self.files[i]))
            self._handles[i] = handle
        return handle

    def _csv(self, i: int) -> Any:
        table = self._tables.get(i)
        if table is None:
            from pyarrow import csv  # type: ignore[import-untyped]

            with self._fs.open_input_stream(self.files[i]) as stream:
                table = csv.read_csv(stream)
            self._tables[i] = table
        return table

    def _whole_chunk(self, start: int, stop: int) -> int | None:
        """The Parquet row group that ``[start, stop)`` is exactly, if it is not held
        decoded already (then reading it again costs nothing); else None."""
        if self.format != "parquet" or not 0 <= start < stop <= self.num_records():
            return None
        k = bisect.bisect_right(self._starts, start) - 1
        if self._starts[k] != start or self._starts[k + 1] != stop:
            return None
        chunk = self._chunks[k]
        with self._lock:
            return None if (chunk.file, chunk.index) in self._cache else k

    def _decode(self, k: int) -> Any:
        """Chunk ``k`` decoded for one read: not kept, its memory is the caller's."""
        with self._lock:
            return self._load(k)

    def _chunk(self, k: int) -> Any:
        chunk = self._chunks[k]
        key = (chunk.file, chunk.index)
        with self._lock:
            table = self._cache.get(key)
            if table is not None:
                self._cache.move_to_end(key)
                return table
            table = self._load(k)
            self._cache[key] = table
            if len(self._cache) > self._cached_chunks:
                self._cache.popitem(last=False)
            return table

    def _load(self, k: int) -> Any:
        """Decodes chunk ``k`` (call under ``_lock``: file handles are not thread-safe)."""
        chunk = self._chunks[k]
        try:
            if self.format == "parquet":
                table = self._handle(chunk.file).read_row_group(
                    chunk.index, columns=self.columns, use_threads=False
                )
            elif self.format == "ipc":
                batch = self._handle(chunk.file).get_batch(chunk.index)
                table = _select(batch_to_table(batch), self.columns)
            else:
                table = _select(self._csv(chunk.file), self.columns)
        except _arrow_errors() as exc:
            raise SourceError(
                f"cannot read chunk {chunk.index} of {self.files[chunk.file]!r}: {exc}"
            ) from exc
        self.chunks_read += 1
        return table


def _arrow_errors() -> tuple[type[Exception], ...]:
    """What pyarrow raises for a missing, truncated or foreign file."""
    import pyarrow as pa

    return (OSError, ValueError, pa.lib.ArrowException)


def batch_to_table(batch: Any) -> Any:
    import pyarrow as pa

    return pa.Table.from_batches([batch])


def _select(table: Any, columns: list[str] | None) -> Any:
    return table if columns is None else table.select(columns)


def as_source(source: Source | str | os.PathLike[str] | Mapping[str, Any]) -> Source:
    """A ``Source`` from a source, a path / URL (``ArrowSource``), ``cache://NAME``
    (``CacheSource``) or columns (``TensorSource``).

    Raises:
        ConfigError: the value is none of those.
    """
    if isinstance(source, str) and source.startswith("cache://"):
        return CacheSource(source)
    if isinstance(source, str | os.PathLike):
        try:
            return ArrowSource(source)
        except UnknownFormatError as exc:
            # Here the path was the source: ArrowSource's own format= is one step away.
            raise exc.with_remedy(
                f"pass ArrowSource({os.fspath(source)!r}, format=...) as the source, "
                f"format one of {', '.join(FORMATS)}"
            ) from None
    if isinstance(source, Mapping):
        return TensorSource(source)
    if isinstance(source, Source):
        return source
    raise ConfigError(
        f"cannot read records from {type(source).__name__}: pass a Source, a path or URL, "
        "or a mapping of column name to tensor / array"
    )


# Paths -------------------------------------------------------------------------------


def _resolve(urls: list[str], storage_options: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """The pyarrow filesystem for ``urls`` and the files they name, sorted.

    Local paths use pyarrow's own filesystem (no Python in the read path); any other
    fsspec protocol is wrapped with ``FSSpecHandler``.
    """
    import fsspec  # type: ignore[import-untyped]
    import pyarrow.fs as pafs  # type: ignore[import-untyped]

    fs: Any = None
    files: list[str] = []
    for url in urls:
        try:
            url_fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except (ValueError, ImportError) as exc:
            raise SourceError(f"cannot open {url!r}: {exc}") from exc
        if fs is None:
            fs = url_fs
        elif type(url_fs) is not type(fs):
            raise ConfigError(f"all paths must be on one filesystem; {url!r} is not")
        if any(ch in path for ch in "*?["):
            found = sorted(url_fs.glob(path))
        elif url_fs.isdir(path):
            found = sorted(
                p for p in url_fs.find(path) if not os.path.basename(p).startswith((".", "_"))
            )
        elif url_fs.exists(path):
            found = [path]
        else:
            raise SourceError(f"no such file or directory: {url!r}")
        if not found:
            raise SourceError(f"no files at {url!r}")
        files.extend(found)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return pafs.LocalFileSystem(), [os.path.abspath(f) for f in files]
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), files


def _normalize(url: str) -> str:
    if url.startswith("file://"):
        url = url.removeprefix("file://")
    return url if "://" in url else os.path.abspath(url)


def _infer_format(files: list[str]) -> str:
    for name in files:
        base = name.lower().removesuffix(".gz")
        ext = os.path.splitext(base)[1]
        if ext in _EXTENSIONS:
            return _EXTENSIONS[ext]
    extensions = ", ".join(_EXTENSIONS) + " (or those and .gz)"
    raise UnknownFormatError(files[:3], extensions, f"pass format= one of {', '.join(FORMATS)}")
