"""The one-call entry point: ``distributed_dataset``.

``distributed_dataset`` serves one process and many with the same code: inside a
cluster it finds the dispatcher from the variables the launcher set; outside one it
starts a dispatcher in-process for the single worker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from clusterflow.data.api import Source
from clusterflow.data.client import DataClient
from clusterflow.data.collate import Collate
from clusterflow.data.config import DataConfig
from clusterflow.data.dispatcher import DispatcherService
from clusterflow.data.env import resolve_dispatcher
from clusterflow.data.sources import as_source
from clusterflow.rpc import Credentials, RpcServer

log = logging.getLogger(__name__)


def distributed_dataset(
    source: Source | str | os.PathLike[str] | Mapping[str, Any],
    *,
    batch_size: int,
    name: str = "default",
    split_size: int = 1024,
    seed: int = 0,
    epochs: int | None = 1,
    shuffle_buffer: int = 0,
    prefetch: int = 4,
    leases_ahead: int = 4,
    auto_ack: bool = True,
    wait_for_all_acks: bool | None = None,
    collate_fn: Collate | None = None,
    dispatcher: str | None = None,
    credentials: Credentials | None = None,
    worker: str | None = None,
    host: str | None = None,
) -> DataClient:
    """This worker's share of a dataset served by the cluster's dispatcher.

    The same call serves one process and many: inside a cluster the dispatcher is found
    from the environment (``resolve_dispatcher``); outside one, a dispatcher is started
    in this process for the client alone.

    Args:
        source: a ``Source``, a path or fsspec URL of Parquet / IPC / CSV files, or a
            mapping of column name to tensor or array.
        See ``DataConfig`` and ``DataClient`` for the rest.

    Raises:
        SourceError: the source cannot be opened.
        ConfigError: a dispatcher address without cluster credentials.
    """
    config = DataConfig(
        name=name,
        batch_size=batch_size,
        split_size=split_size,
        seed=seed,
        epochs=epochs,
        shuffle_buffer=shuffle_buffer,
        prefetch=prefetch,
        leases_ahead=leases_ahead,
        auto_ack=auto_ack,
        wait_for_all_acks=wait_for_all_acks,
    )
    records = as_source(source)
    address = dispatcher or resolve_dispatcher()
    owned: RpcServer | None = None
    if address is None:
        credentials = Credentials.generate()
        owned = RpcServer(credentials, name="data-dispatcher")
        DispatcherService().register_on(owned)
        owned.start()
        address = owned.address
        log.info("no cluster found: serving the data dispatcher in-process at %s", address)
    else:
        credentials = credentials or Credentials.from_env()
    try:
        return DataClient(
            records,
            config,
            dispatcher=address,
            credentials=credentials,
            collate_fn=collate_fn,
            worker=worker,
            # A cache's partitions are located by node (cache_map.py), not by host name.
            host=host if host is not None else getattr(records, "node", None),
            _owned=owned,
        )
    except BaseException:
        if owned is not None:
            owned.stop()
        raise
