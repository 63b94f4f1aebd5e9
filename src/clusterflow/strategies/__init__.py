"""Distribution strategies: one API over the collective and parameter-server engines."""

from __future__ import annotations

from typing import TYPE_CHECKING

from clusterflow._lazy import lazy_exports
from clusterflow.collective.api import (
    AllReduceAlgorithm,
    CollectiveError,
    CommunicationImplementation,
    CommunicationOptions,
    Compression,
    MembershipError,
    PeerLost,
)
from clusterflow.strategies.api import ReduceOp, Strategy, StrategyError
from clusterflow.strategies.resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)

if TYPE_CHECKING:
    from clusterflow.strategies.all_reduce import CollectiveAllReduceStrategy, unwrap
    from clusterflow.strategies.coordinator import ClusterCoordinator, RemoteValue, serve_worker
    from clusterflow.strategies.mirrored import MirroredStrategy, MultiWorkerMirroredStrategy

__all__ = [
    "AllReduceAlgorithm",
    "ClusterCoordinator",
    "ClusterResolver",
    "CollectiveAllReduceStrategy",
    "CollectiveError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "Compression",
    "MembershipError",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "PeerLost",
    "ReduceOp",
    "RemoteValue",
    "SimpleClusterResolver",
    "Strategy",
    "StrategyError",
    "TFConfigClusterResolver",
    "serve_worker",
    "unwrap",
]

# Names whose modules import torch: loaded on first use, so that importing this package
# (the resolver, from a control-plane process) stays free of torch.
_LAZY = {
    "ClusterCoordinator": "clusterflow.strategies.coordinator",
    "RemoteValue": "clusterflow.strategies.coordinator",
    "serve_worker": "clusterflow.strategies.coordinator",
    "CollectiveAllReduceStrategy": "clusterflow.strategies.all_reduce",
    "MirroredStrategy": "clusterflow.strategies.mirrored",
    "MultiWorkerMirroredStrategy": "clusterflow.strategies.mirrored",
    "unwrap": "clusterflow.strategies.all_reduce",
}


__getattr__ = lazy_exports(__name__, _LAZY)
