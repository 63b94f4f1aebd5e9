"""Arrow tables as the NumPy columns the collator takes, for every source that reads Arrow.

Apart from ``sources.py`` because ``cache_source.py`` converts the same way and
``sources.py`` builds a ``CacheSource`` for ``cache://`` URLs: both import this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["arrow_columns"]


def arrow_columns(table: Any) -> dict[str, Any]:
    """A pyarrow table as NumPy columns the collator can take without further checks.

    Fixed-width columns without nulls come out as NumPy arrays (zero copy where Arrow
    allows); fixed-size lists as 2-D arrays (a tensor per record); everything else,
    and numeric columns with nulls, as object arrays of Python values, so a null or a
    ragged list fails collation naming its record instead of silently becoming NaN.
    """
    import pyarrow.types as pat  # type: ignore[import-untyped]

    out: dict[str, Any] = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = column.type
        if column.null_count == 0 and (
            pat.is_integer(kind) or pat.is_floating(kind) or pat.is_boolean(kind)
        ):
            out[name] = column.to_numpy()
        elif column.null_count == 0 and pat.is_fixed_size_list(kind):
            flat = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
            out[name] = flat.reshape(len(column), kind.list_size)
        else:
            values = column.to_pylist()
            objects = np.empty(len(values), dtype=object)
            objects[:] = values
            out[name] = objects
    return out
