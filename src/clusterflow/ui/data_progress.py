"""The data service's progress, asked of the manager that hosts its dispatcher.

The dispatcher keeps its counts in the manager's memory only, so this is the one figure
the dashboard asks the manager for instead of reading a file: ``data.state_dict`` (once,
to learn each dataset's name and size, and again only when a new one appears) and
``data.status`` per dataset, each with a short deadline. A manager that is gone, busy or
hosting no dataset yields an empty list, never an error on the page.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Final

from clusterflow.data.dispatcher_client import DispatcherClient
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.state import ClusterState
from clusterflow.rpc import Credentials, RpcClient, RpcError

log = logging.getLogger(__name__)

__all__ = ["DataProgress"]

DEADLINE_S: Final = 2.0
"""A dashboard never waits long for a manager: its page shows the last figures."""
NAMES_EVERY_S: Final = 15.0
"""How often the list of datasets is asked for again (workers register theirs once)."""


class DataProgress:
    """Per cluster, a client to its manager and what it last learned of the datasets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[str, RpcClient]] = {}
        self._sizes: dict[str, tuple[float, dict[str, int]]] = {}

    def read(self, cluster: ClusterDir, state: ClusterState) -> list[dict[str, Any]]:
        """One row per dataset: its oldest live epoch's splits, acked, leased and
        pending, and the leases of later epochs (``_row``)."""
        address = state.manager.address if state.manager else None
        if not address or state.status not in ("running", "restarting"):
            self._drop(cluster.id)
            return []
        try:
            client = DispatcherClient(self._client(cluster, address))
            sizes = self._dataset_sizes(cluster.id, client)
            rows = [_row(name, num, client.status(name)) for name, num in sizes.items()]
        except (RpcError, OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("data progress of %s unavailable: %s", cluster.id, exc)
            self._sizes.pop(cluster.id, None)
            return []
        return rows

    def _client(self, cluster: ClusterDir, address: str) -> RpcClient:
        with self._lock:
            known = self._clients.get(cluster.id)
            if known is not None and known[0] == address:
                return known[1]
            if known is not None:
                known[1].close()
            client = RpcClient(
                address, Credentials.from_file(cluster.secret_file), deadline=DEADLINE_S
            )
            self._clients[cluster.id] = (address, client)
            return client

    def _dataset_sizes(self, cluster_id: str, client: DispatcherClient) -> dict[str, int]:
        asked, sizes = self._sizes.get(cluster_id, (0.0, {}))
        if time.monotonic() - asked < NAMES_EVERY_S and sizes:
            return sizes
        datasets = client.state_dict().get("datasets") or {}
        sizes = {
            str(name): _num_splits(cursor.get("spec") or {}) for name, cursor in datasets.items()
        }
        self._sizes[cluster_id] = (time.monotonic(), sizes)
        return sizes

    def _drop(self, cluster_id: str) -> None:
        with self._lock:
            known = self._clients.pop(cluster_id, None)
        self._sizes.pop(cluster_id, None)
        if known is not None:
            known[1].close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for _, client in clients:
            client.close()


def _num_splits(spec: dict[str, Any]) -> int:
    records, size = int(spec.get("num_records", 0)), int(spec.get("split_size", 0) or 1)
    return -(-records // size)


def _row(name: str, num_splits: int, status: dict[str, Any]) -> dict[str, Any]:
    """The oldest live epoch's splits, each counted once: acked + leased + pending =
    splits (``data/leases.py``: a split is in exactly one of the three states).

    The ledger's ``outstanding`` counts the leases of every live epoch, and the next
    epoch opens while this one still has leases out: shown as this epoch's, it made
    ``leased 11`` beside 10 of 12 acknowledged. Leases of later epochs are their own
    figure, ``leased_ahead``.
    """
    live = status.get("live") or {}
    epoch = int(status.get("epoch", 0))
    current = live.get(str(epoch)) or {}
    acked, pending = int(current.get("acked", 0)), int(current.get("pending", 0))
    outstanding = int(status.get("outstanding", 0))
    finished = bool(status.get("finished"))
    leased = 0 if finished else max(0, min(outstanding, num_splits - acked - pending))
    return {
        "dataset": name,
        "epoch": epoch,
        "finished": finished,
        "splits": num_splits,
        "leased": leased,
        "acked": num_splits if finished else acked,
        "pending": pending,
        "leased_ahead": outstanding - leased,
    }
