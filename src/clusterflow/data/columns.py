"""Arrow tables as the NumPy columns the collator takes, for every source that reads Arrow.

Apart from ``sources.py`` because ``cache_source.py`` converts the same way and
``sources.py`` builds a ``CacheSource`` for ``cache://`` URLs: both import this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["arrow_columns"]


def arrow_columns(table: Any, *, owned: bool = False) -> dict[str, Any]:
    """A pyarrow table as NumPy columns the collator can take without further checks.

    Fixed-width columns without nulls come out as NumPy arrays (zero copy where Arrow
    allows); fixed-size lists as 2-D arrays (a tensor per record); everything else,
    and numeric columns with nulls, as object arrays of Python values, so a null or a
    ragged list fails collation naming its record instead of silently becoming NaN.

    ``owned``: nothing else holds or will read ``table``'s memory (a row group decoded
    for this read alone). Its numeric columns then come out *writable* over that memory
    itself, where Arrow allocated it mutable: tensors can share them as they are, where
    read-only arrays cost the reader a copy of every split (``collate.writable``).
    """
    import pyarrow.types as pat  # type: ignore[import-untyped]

    if owned:
        numbers = _owned_numbers(table)
        if numbers is not None:
            return numbers
    out: dict[str, Any] = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = column.type
        if column.null_count == 0 and (
            pat.is_integer(kind) or pat.is_floating(kind) or pat.is_boolean(kind)
        ):
            mine = _writable_view(column) if owned else None
            out[name] = mine if mine is not None else column.to_numpy()
        elif column.null_count == 0 and pat.is_fixed_size_list(kind):
            flat = _writable_view(column, values=True) if owned else None
            if flat is None:
                flat = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
            out[name] = flat.reshape(len(column), kind.list_size)
        else:
            values = column.to_pylist()
            objects = np.empty(len(values), dtype=object)
            objects[:] = values
            out[name] = objects
    return out


def _writable_view(column: Any, *, values: bool = False) -> np.ndarray | None:
    """A writable NumPy array over a one-chunk column's own data buffer (its list values
    with ``values``), or None where that is not possible: several chunks, booleans
    (bit-packed), nulls among list values, or memory Arrow marks immutable (a memory
    map, a buffer borrowed from Python)."""
    import pyarrow.types as pat

    if column.num_chunks != 1:
        return None
    array = column.chunk(0)
    if values:
        array = array.flatten()  # the list values of this slice of the column
        if array.null_count:
            return None
    kind = array.type
    if not (pat.is_integer(kind) or pat.is_floating(kind)):
        return None
    data = array.buffers()[1]
    if data is None or not data.is_mutable:
        return None
    dtype = np.dtype(kind.to_pandas_dtype())
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


_NUMBER_DTYPES: dict[int, np.dtype[Any]] = {}
"""Arrow type id -> NumPy dtype of the integer and floating types (``_number_dtype``)."""


def _number_dtype(kind: Any) -> np.dtype[Any] | None:
    """The NumPy dtype of an Arrow integer or floating type; None for any other type."""
    if not _NUMBER_DTYPES:
        import pyarrow as pa  # type: ignore[import-untyped]

        names = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
        for t in (getattr(pa, n)() for n in [*names, "float16", "float32", "float64"]):
            _NUMBER_DTYPES[t.id] = np.dtype(t.to_pandas_dtype())
    return _NUMBER_DTYPES.get(kind.id)


def _owned_numbers(table: Any) -> dict[str, Any] | None:
    """``arrow_columns(table, owned=True)`` in one pass where every column is one chunk
    of integers or floats without nulls (a Parquet row group of such columns, the data
    service's common split); None otherwise, for the general path. Equal to what that
    path gives, at about half its cost: the record batch's arrays instead of the table's
    chunked columns and a chunk of each, one dtype lookup instead of the type checks and
    ``to_pandas_dtype``: 28-30 us a split of 16 columns against 51 (the reading thread's
    CPU; docs/benchmarks.md, "Data service: fewer calls")."""
    batches = table.to_batches()
    if len(batches) != 1:  # columns chunked apart, or no rows
        return None
    out: dict[str, Any] = {}
    for name, array in zip(table.schema.names, batches[0].columns, strict=True):
        dtype = _number_dtype(array.type)
        if dtype is None or array.null_count:
            return None
        # A batch has rows, so its number arrays have a data buffer. Over memory Arrow
        # marks immutable, frombuffer's array is read-only, as the general path's is.
        out[name] = np.frombuffer(
            array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize
        )
    return out
