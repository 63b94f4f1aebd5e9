"""Turning a batch of columns into tensors, and naming the record that cannot be.

A collate function takes one batch as named columns (NumPy arrays, or object arrays of
Python values) and returns what the training step consumes. When it raises, the client
calls ``find_bad_record`` to name the record at fault: collation failures are data
problems, and "record 1234567 of split [1234432, 1236480)" is what lets a user fix them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

Collate = Callable[[Mapping[str, Any]], Any]
"""Columns of one batch -> the batch the training step gets."""

_NUMERIC_KINDS = frozenset("biuf")


def numpy_collate(columns: Mapping[str, Any]) -> dict[str, Any]:
    """Columns as NumPy arrays (strings stay lists): for processes that never need torch."""
    return {name: _column(name, values) for name, values in columns.items()}


def torch_collate(columns: Mapping[str, Any]) -> dict[str, Any]:
    """Columns as tensors (zero copy from NumPy where possible; strings stay lists).

    The default. torch is imported on first use, so importing ``clusterflow.data`` does
    not pay for it.
    """
    import torch

    from_numpy = torch.from_numpy
    out: dict[str, Any] = {}
    for name, values in columns.items():
        # The common case first, inline: a batch of small records costs tens of
        # microseconds, and a function call per column is a visible share of it.
        if (
            type(values) is np.ndarray
            and values.dtype.kind in _NUMERIC_KINDS
            and values.flags.writeable
        ):
            out[name] = from_numpy(values)
            continue
        array = _column(name, values)
        if isinstance(array, np.ndarray):
            if not array.flags.writeable:
                array = array.copy()  # torch tensors must own writable memory
            out[name] = from_numpy(array)
        else:
            out[name] = array
    return out


def torch_batches(columns: Mapping[str, Any], lo: int, size: int) -> list[dict[str, Any]]:
    """``torch_collate`` of every full batch of ``size`` records of ``columns`` from
    record ``lo`` on, all at once; empty when a column is not a writable numeric array
    (then each batch goes through ``torch_collate`` on its own).

    Equal to ``torch_collate`` of each batch's slices (tensors over the same memory),
    but made in C++, one call per column: a batch of small records costs a dict instead
    of a NumPy slice and a ``from_numpy`` per column (the training loop's CPU per pass
    of ``benchmarks.data`` fell by a sixth; ``benchmarks._data_cpu``). Each column is
    viewed as (batches, size, ...) and unbound (a view splits the first dimension
    whatever its stride), which makes a tensor for about 360 ns against
    ``Tensor.split``'s 410.
    """
    import torch

    if not columns:
        return []
    full = (len(next(iter(columns.values()))) - lo) // size
    parts = []
    for values in columns.values():
        if not (
            type(values) is np.ndarray
            and values.dtype.kind in _NUMERIC_KINDS
            and values.flags.writeable
            and full > 0
            and len(values) - lo >= full * size
        ):
            return []
        whole = torch.from_numpy(values[lo : lo + full * size])
        parts.append(whole.view(full, size, *values.shape[1:]).unbind(0))
    names = list(columns)
    # A row holds one tensor per column by construction; a strict zip would check that
    # again, for a third of a batch's dict.
    return [dict(zip(names, row, strict=False)) for row in zip(*parts, strict=True)]


def _column(name: str, values: Any) -> Any:
    if isinstance(values, np.ndarray) and values.dtype.kind in _NUMERIC_KINDS:
        return values
    items = list(values)
    if items and all(isinstance(v, str | bytes) for v in items):
        return items
    if any(v is None for v in items):
        raise ValueError(f"column {name!r} holds a null")
    try:
        stacked = np.stack([np.asarray(v) for v in items]) if items else np.empty(0)
    except ValueError as exc:
        raise ValueError(f"column {name!r}: records differ in shape ({exc})") from None
    if stacked.dtype == object:  # numbers boxed as objects: let NumPy infer their type
        stacked = np.array(stacked.tolist())
    if stacked.dtype.kind not in _NUMERIC_KINDS:
        raise ValueError(f"column {name!r} holds {stacked.dtype} values, not numbers")
    return stacked


def writable(columns: Mapping[str, Any]) -> dict[str, Any]:
    """Columns whose batches can become tensors without a copy each.

    Arrow hands out read-only memory, and a tensor over it would have to be copied per
    batch (torch tensors must be writable); one copy per split is cheaper.
    """
    return {
        name: values.copy()
        if isinstance(values, np.ndarray) and not values.flags.writeable
        else values
        for name, values in columns.items()
    }


def take(columns: Mapping[str, Any], index: Any) -> dict[str, Any]:
    """Rows ``index`` (a slice or integer array) of every column."""
    return {name: values[index] for name, values in columns.items()}


def find_bad_record(collate: Collate, columns: Mapping[str, Any]) -> tuple[int, str] | None:
    """(position in the batch, reason) of a record that makes ``collate`` fail.

    A record that fails on its own is named first (a null, a string among numbers);
    otherwise the first record that fails beside record 0 (a ragged shape). None when
    the batch fails only as a whole.
    """
    n = len(next(iter(columns.values()))) if columns else 0
    for i in range(n):
        try:
            collate(take(columns, slice(i, i + 1)))
        except Exception as exc:
            return i, f"{type(exc).__name__}: {exc}"
    for i in range(1, n):
        try:
            collate(take(columns, np.array([0, i])))
        except Exception as exc:
            return i, f"{type(exc).__name__}: {exc} (it differs from the batch's first record)"
    return None
