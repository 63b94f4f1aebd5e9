"""Splitting global batches across replicas, as ``experimental_distribute_dataset`` does.

Every replica walks the same sequence of global batches and keeps its contiguous slice,
replica ``r`` of ``n`` getting rows ``[r*b/n, (r+1)*b/n)``. Contiguous (not strided) so
that two replicas together see exactly the rows one process would, in the same order,
which is what makes a two-replica step equal a one-process step on the global batch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from clusterflow.strategies.api import StrategyError

__all__ = ["batch_size_of", "deal_out", "distribute_batches", "replica_slice", "split_batch"]

_log = logging.getLogger(__name__)


def check_divisible(global_batch_size: int, replicas: int) -> int:
    """The per-replica batch size.

    Raises:
        StrategyError: ``global_batch_size`` is not a positive multiple of ``replicas``.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        raise StrategyError(f"global_batch_size must be an integer, got {global_batch_size!r}")
    if global_batch_size < 1 or global_batch_size % replicas:
        raise StrategyError(
            f"global batch size {global_batch_size} is not divisible by the {replicas} replicas "
            f"in sync; use a multiple of {replicas} (e.g. "
            f"{max(replicas, global_batch_size - global_batch_size % replicas)})"
        )
    return global_batch_size // replicas


def replica_slice(size: int, rank: int, replicas: int) -> slice:
    """Rows of a batch of ``size`` that replica ``rank`` takes; as even as can be.

    The first ``size % replicas`` replicas take one row more (a final partial batch).
    """
    base, extra = divmod(size, replicas)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def batch_size_of(batch: Any) -> int:
    """Rows in ``batch``: the leading size of its tensors, which must all agree.

    Raises:
        StrategyError: the batch holds no tensor, or tensors of different leading sizes.
    """
    sizes = {leaf.shape[0] if leaf.dim() else 0 for leaf in _tensors(batch)}
    if not sizes:
        raise StrategyError(
            f"a batch must hold tensors (alone, in a tuple, list or dict); got {type(batch)!r}"
        )
    if len(sizes) > 1:
        raise StrategyError(f"the tensors of one batch have different batch sizes: {sorted(sizes)}")
    return sizes.pop()


def split_batch(batch: Any, rank: int, replicas: int) -> Any:
    """Replica ``rank``'s rows of every tensor in ``batch``; other leaves pass unchanged."""
    rows = replica_slice(batch_size_of(batch), rank, replicas)
    return _map_tensors(batch, lambda t: t[rows])


def distribute_batches(
    dataset: Iterable[Any] | Dataset[Any],
    *,
    rank: int,
    replicas: int,
    global_batch_size: int | None,
    drop_remainder: bool,
    device: torch.device,
) -> Iterator[Any]:
    """This replica's share of each global batch of ``dataset``.

    A map-style ``Dataset`` (``__len__`` and ``__getitem__``) is batched here, every
    ``global_batch_size`` consecutive samples making one global batch, and this replica
    reads only its own samples. Anything else is taken to yield global batches already
    (a ``DataLoader`` with ``batch_size`` = the global batch), and each is sliced.

    Raises:
        StrategyError: the global batch size is not divisible by ``replicas``, a map-style
            dataset comes without one, or a batch exceeds it. Raised on the call for the
            first two, when the batch is reached for the last.
    """
    if global_batch_size is not None:
        check_divisible(global_batch_size, replicas)
    if _is_map_style(dataset):
        if global_batch_size is None:
            raise StrategyError(
                "distribute() of a map-style dataset needs global_batch_size, to batch it"
            )
        batches = _read_map_style(dataset, rank, replicas, global_batch_size, drop_remainder)
    else:
        batches = _slice_batches(
            cast(Iterable[Any], dataset), rank, replicas, global_batch_size, drop_remainder
        )
    if device.type == "cpu":
        return batches
    return (_map_tensors(b, lambda t: t.to(device, non_blocking=True)) for b in batches)


def is_data_client(dataset: object) -> bool:
    """A ``clusterflow.data`` client: already this replica's share, batched and leased."""
    from clusterflow.data.client import DataClient

    return isinstance(dataset, DataClient)


def batch_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors in containers, or a data-service ``Batch``) moved to ``device``."""
    from clusterflow.data.batching import Batch

    move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    if isinstance(batch, Batch):
        return dataclasses.replace(batch, data=_map_tensors(batch.data, move))
    return _map_tensors(batch, move)


def _is_map_style(dataset: object) -> bool:
    return (
        isinstance(dataset, Dataset)
        and not isinstance(dataset, IterableDataset)
        and hasattr(dataset, "__len__")
    )


def _read_map_style(
    dataset: Any, rank: int, replicas: int, global_batch_size: int, drop_remainder: bool
) -> Iterator[Any]:
    total = len(dataset)
    for start in range(0, total, global_batch_size):
        size = min(global_batch_size, total - start)
        if not _keep(size, global_batch_size, replicas, drop_remainder):
            return
        rows = replica_slice(size, rank, replicas)
        yield default_collate([dataset[start + i] for i in range(rows.start, rows.stop)])


def _slice_batches(
    batches: Iterable[Any],
    rank: int,
    replicas: int,
    global_batch_size: int | None,
    drop_remainder: bool,
) -> Iterator[Any]:
    expected = global_batch_size
    for batch in batches:
        size = batch_size_of(batch)
        if expected is None:
            # The first batch sets the size; later smaller ones are partial batches.
            check_divisible(size, replicas)
            expected = size
        if size > expected:
            raise StrategyError(
                f"a batch of {size} rows exceeds the global batch size {expected}; "
                "distribute() takes global batches, not larger ones"
            )
        if not _keep(size, expected, replicas, drop_remainder):
            continue
        yield split_batch(batch, rank, replicas)


def _keep(size: int, expected: int, replicas: int, drop_remainder: bool) -> bool:
    if size == expected:
        return True
    if drop_remainder:
        return False
    if size < replicas:
        # Some replica would get no rows, and an empty batch's mean loss is NaN.
        _log.warning(
            "dropping a final batch of %d rows: fewer than the %d replicas", size, replicas
        )
        return False
    return True


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        for value in batch:
            yield from _tensors(value)


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _map_tensors(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch


def deal_out(dataset: Iterable[Any], count: int, index: int) -> Iterator[Any]:
    """This replica's share of ``dataset`` when replicas take whole elements.

    A ``clusterflow.data`` client is already this replica's share (the dispatcher lends
    each split to one worker): it passes through whole. Any other iterable is dealt
    out: every ``count``-th element, starting at ``index``.
    """
    if is_data_client(dataset):
        yield from dataset
        return
    for i, element in enumerate(dataset):
        if i % count == index:
            yield element
