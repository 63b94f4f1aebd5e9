"""From what the user passes as ``data`` to this replica's batches, epoch by epoch.

``fit`` takes these forms of data:

* tensors ``(x, y)`` or a map-style ``Dataset``: batched here into global batches of
  ``global_batch_size``, reshuffled every epoch by a seeded generator. Every replica
  draws the same order (the seed, never a per-process random one), so every replica
  walks the same global batches, and reads only its own rows of each.
* any other iterable of ``(x, y)`` batches (a ``DataLoader``, a list): each element is
  one global batch, and this replica takes its slice. Seed a shuffling loader alike on
  every replica, as with ``strategy.distribute``.
* a data-service client (``clusterflow.data.distributed_dataset``): its batches are
  this worker's already (the dispatcher lent them to it alone); its ``collate_fn``
  must give ``(x, y)``.

Replica ``r`` of ``n`` takes the ``r``-th contiguous block of a global batch
(``strategies.batches.replica_slice``, what ``strategy.distribute`` does), so the
replicas together see exactly the rows one process would, in the same order: that is
what makes a run on ``n`` replicas equal a single process on the same global batches.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

from clusterflow._checks import whole
from clusterflow.strategies.api import Replicas
from clusterflow.strategies.batches import batch_size_of, replica_slice, split_batch
from clusterflow.train.api import TrainConfigError

__all__ = ["Feed", "Feeder", "as_dataset", "is_data_client"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Feed:
    """One step's input on this replica."""

    inputs: Any
    targets: Any
    rows: int
    """Rows of this replica's share."""
    loss_scale: float
    """Factor on this replica's mean loss so the update is the global batch's mean."""
    epoch: int


def is_data_client(data: object) -> bool:
    """Whether ``data`` is a data-service client (its batches are this worker's own)."""
    from clusterflow.data.client import DataClient

    return isinstance(data, DataClient)


def as_dataset(data: object) -> Dataset[Any] | None:
    """``data`` as a map-style dataset, when it is one (or a tuple of equal-length tensors)."""
    if isinstance(data, tuple | list) and data and all(isinstance(t, torch.Tensor) for t in data):
        tensors: Sequence[torch.Tensor] = data
        lengths = {t.shape[0] if t.dim() else 0 for t in tensors}
        if len(lengths) != 1:
            raise TrainConfigError(
                f"data tensors have different lengths {sorted(lengths)}; pass (inputs, "
                "targets) with one row per sample in each"
            )
        return TensorDataset(*tensors)
    if (
        isinstance(data, Dataset)
        and not isinstance(data, IterableDataset)
        and hasattr(data, "__len__")
    ):
        return data
    return None


class Feeder:
    """This replica's batches of ``data``, one epoch at a time.

    Args:
        data: see the module docstring.
        replicas: this replica's rank and the number the global batch is split across.
        global_batch_size: rows of a global batch; for an iterable of batches, the most
            a batch may hold (default: the first batch's size).
        shuffle: reshuffle a dataset's order every epoch.
        seed: seeds that order; the same on every replica.
        steps_per_epoch: steps an epoch takes at most (needed for a one-pass iterator
            trained for more than one epoch).
        device: where batches go (the model's device).
        what: names the argument in errors (``data``, ``validation_data``).

    Raises:
        TrainConfigError: the global batch size is not a positive multiple of the
            replica count, or the data is none of the forms above.
    """

    def __init__(
        self,
        data: Any,
        replicas: Replicas,
        *,
        global_batch_size: int | None,
        shuffle: bool,
        seed: int,
        steps_per_epoch: int | None,
        device: torch.device,
        what: str = "data",
    ) -> None:
        self.replicas = replicas
        self.what = what
        self._shuffle = shuffle
        self._seed = seed
        self._device = device
        self._steps = steps_per_epoch
        self.client = is_data_client(data)
        self._dataset = None if self.client else as_dataset(data)
        if global_batch_size is not None:
            _check_batch_size(global_batch_size, replicas.count, what)
        if self._dataset is not None:
            self._batch = global_batch_size or 32  # Keras's default batch size
            _check_batch_size(self._batch, replicas.count, what)
        else:
            self._batch = global_batch_size or 0  # set by the first batch
        if not self.client and self._dataset is None and not isinstance(data, Iterable):
            raise TrainConfigError(
                f"{what} must be tensors (inputs, targets), a Dataset, an iterable of "
                f"(inputs, targets) batches or a data-service client; got {type(data).__name__}"
            )
        self.data = data
        self._stream: Iterator[Any] | None = None
        self._warned = False
        if not self.client and self._dataset is None and iter(data) is data:
            self._stream = data  # a one-pass iterator: epochs continue where it stopped

    @property
    def one_pass(self) -> bool:
        """Whether the data is a single stream, read once across all epochs."""
        return self._stream is not None

    def steps_in_epoch(self) -> int | None:
        """Steps one epoch takes, when known ahead (a dataset, a sized iterable)."""
        if self.client or self._stream is not None:
            return self._steps
        size = None
        if self._dataset is not None:
            rows = len(self._dataset)  # type: ignore[arg-type]
            size = sum(
                1
                for start in range(0, rows, self._batch)
                if min(self._batch, rows - start) >= self.replicas.count
            )
        elif hasattr(self.data, "__len__"):
            size = len(self.data)
        if size is None:
            return self._steps
        return size if self._steps is None else min(size, self._steps)

    def epoch(self, epoch: int, *, skip: int = 0, done: int = 0) -> Iterator[Feed]:
        """This replica's feeds for ``epoch``.

        Args:
            epoch: seeds the epoch's shuffle.
            skip: global batches to pass over first. Resuming inside an epoch skips the
                steps already done; every replica skips alike, so all stay on the same
                global batches.
            done: steps of this epoch already taken (they count toward steps_per_epoch).
        """
        if self.client:
            raise TrainConfigError("a data-service client is read with client_batches()")
        feeds = (self._share(batch, epoch) for batch in self._global_batches(epoch, skip))
        kept = (feed for feed in feeds if feed is not None)
        limit = None if self._steps is None else max(0, self._steps - done)
        yield from itertools.islice(kept, limit)

    def client_batches(self) -> Iterator[tuple[Any, Feed]]:
        """The data-service client's batches with their feeds: ``(Batch, Feed)`` pairs."""
        for batch in self.data:
            inputs, targets = _pair(batch.data, self.what, client=True)
            rows = batch_size_of((inputs, targets))
            yield batch, Feed(self._to(inputs), self._to(targets), rows, 1.0, batch.epoch)

    # Global batches ----------------------------------------------------------------

    def _global_batches(self, epoch: int, skip: int) -> Iterator[Any]:
        if self._dataset is not None:
            yield from self._dataset_batches(self._dataset, epoch, skip)
            return
        source = self._stream if self._stream is not None else iter(self.data)
        for _ in itertools.islice(source, skip):
            pass
        # A for loop, not `yield from`: closing this generator at an epoch's end must
        # not close a one-pass stream that the next epoch goes on reading.
        for batch in source:  # noqa: UP028
            yield batch

    def _dataset_batches(self, dataset: Dataset[Any], epoch: int, skip: int) -> Iterator[Any]:
        """Global batches of a dataset, each already cut to this replica's rows.

        Only this replica's rows are read: a Dataset's ``__getitem__`` may decode files.
        """
        rows = len(dataset)  # type: ignore[arg-type]
        if self._shuffle:
            gen = torch.Generator().manual_seed((self._seed * 1_000_003 + epoch) % 2**63)
            order = torch.randperm(rows, generator=gen)
        else:
            order = torch.arange(rows)
        count = self.replicas.count
        starts = [s for s in range(0, rows, self._batch) if min(self._batch, rows - s) >= count]
        if rows % self._batch and rows % self._batch < count and not self._warned:
            self._warned = True
            _log.warning(
                "%s: dropping the final batch of each epoch: its %d rows are fewer than the "
                "%d replicas",
                self.what,
                rows % self._batch,
                count,
            )
        for start in starts[skip:]:
            size = min(self._batch, rows - start)
            mine = replica_slice(size, self.replicas.rank, self.replicas.count)
            index = order[start + mine.start : start + mine.stop]
            yield _Cut(_rows(dataset, index), size)

    # One replica's share -----------------------------------------------------------

    def _share(self, batch: Any, epoch: int) -> Feed | None:
        """This replica's part of a global batch; None when the batch is skipped by all."""
        count = self.replicas.count
        if isinstance(batch, _Cut):
            inputs, targets = _pair(batch.rows, self.what)
            total = batch.total
        else:
            inputs, targets = _pair(batch, self.what)
            total = batch_size_of((inputs, targets))
            if not self._batch:
                _check_batch_size(total, count, self.what)
                self._batch = total
            if total > self._batch:
                raise TrainConfigError(
                    f"a batch of {self.what} holds {total} rows, more than the global batch "
                    f"size {self._batch}; each element must be one global batch"
                )
            if total < count:
                # Some replica would get no rows, and an empty batch's mean loss is NaN.
                _log.warning(
                    "%s: skipping a batch of %d rows: fewer than the %d replicas",
                    self.what,
                    total,
                    count,
                )
                return None
            if count > 1:
                inputs, targets = split_batch((inputs, targets), self.replicas.rank, count)
        rows = batch_size_of((inputs, targets))
        scale = 1.0
        if self.replicas.averaged and count > 1 and rows * count != total:
            scale = rows * count / total
        return Feed(self._to(inputs), self._to(targets), rows, scale, epoch)

    def _to(self, value: Any) -> Any:
        if self._device.type == "cpu":
            return value
        return _map_tensors(value, lambda t: t.to(self._device, non_blocking=True))


@dataclass(frozen=True, slots=True)
class _Cut:
    """A replica's rows of one global batch of ``total`` rows."""

    rows: Any
    total: int


def _rows(dataset: Dataset[Any], index: torch.Tensor) -> Any:
    if isinstance(dataset, TensorDataset):  # one gather per tensor, not one per sample
        return tuple(t[index] for t in dataset.tensors)
    return default_collate([dataset[int(i)] for i in index])


def _pair(batch: Any, what: str, *, client: bool = False) -> tuple[Any, Any]:
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    hint = (
        "; give distributed_dataset a collate_fn that returns (inputs, targets)" if client else ""
    )
    if isinstance(batch, dict):
        raise TrainConfigError(
            f"{what}: a batch must be (inputs, targets), got a dict with keys {sorted(batch)}{hint}"
        )
    size = f" of {len(batch)}" if isinstance(batch, tuple | list) else ""
    raise TrainConfigError(
        f"{what}: a batch must be (inputs, targets), got {type(batch).__name__}{size}{hint}"
    )


def _check_batch_size(size: int, replicas: int, what: str) -> None:
    whole("global_batch_size", size, least=1, error=TrainConfigError)
    if size % replicas:
        raise TrainConfigError(
            f"the global batch of {what} ({size} rows) is not divisible by the {replicas} "
            f"replicas; use a multiple of {replicas}, e.g. {max(replicas, size - size % replicas)}"
        )


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value
