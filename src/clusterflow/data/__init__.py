"""The data service: records handed out as leases, read and batched by the workers.

A dispatcher (``DispatcherService``, hosted by the manager or the chief) cuts every epoch
of a dataset into splits of ``split_size`` records, orders them by a seeded per-epoch
shuffle and lends them to whichever worker asks. Workers read their splits from the
source themselves (``DataClient`` / ``distributed_dataset``) and ack each lease once the
update computed from it is applied; a dead or silent worker's leases go back to the
queue, so at the end of an epoch every record has been acked exactly once.

Typical use in a training script::

    data = clusterflow.data.distributed_dataset(
        "s3://bucket/train/", batch_size=256, split_size=16384, epochs=3
    )
    for batch in data:            # a Batch: .data is a dict of tensors
        loss = step(batch.data)   # the previous batch's leases were acked on next()

Importing this package does not import torch (collation imports it on first use) nor
pyarrow (sources import it when opened).
"""

from __future__ import annotations

from clusterflow.data.api import (
    CollateError,
    Columns,
    DataError,
    DatasetConflictError,
    DatasetSpec,
    Lease,
    LocatedSource,
    Source,
    SourceError,
    SplitKey,
    UnknownDatasetError,
    UnknownFormatError,
    UnknownLeaseError,
    describe_source,
)
from clusterflow.data.batching import Batch
from clusterflow.data.client import DataClient
from clusterflow.data.collate import numpy_collate, torch_collate
from clusterflow.data.config import DataConfig
from clusterflow.data.dataset import distributed_dataset
from clusterflow.data.dispatcher import DispatcherConfig, DispatcherService
from clusterflow.data.dispatcher_client import DispatcherClient
from clusterflow.data.env import default_worker_name, resolve_dispatcher
from clusterflow.data.leases import GrantStatus, LeaseBook
from clusterflow.data.sources import ArrowSource, TensorSource, as_source

__all__ = [
    "ArrowSource",
    "Batch",
    "CollateError",
    "Columns",
    "DataClient",
    "DataConfig",
    "DataError",
    "DatasetConflictError",
    "DatasetSpec",
    "DispatcherClient",
    "DispatcherConfig",
    "DispatcherService",
    "GrantStatus",
    "Lease",
    "LeaseBook",
    "LocatedSource",
    "Source",
    "SourceError",
    "SplitKey",
    "TensorSource",
    "UnknownDatasetError",
    "UnknownFormatError",
    "UnknownLeaseError",
    "as_source",
    "default_worker_name",
    "describe_source",
    "distributed_dataset",
    "numpy_collate",
    "resolve_dispatcher",
    "torch_collate",
]
