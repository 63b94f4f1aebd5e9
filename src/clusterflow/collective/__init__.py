"""The collective engine: all-reduce over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

The value types and errors load without torch; :class:`CollectiveGroup` and the
compression hooks import it on first use, so ``import clusterflow.collective`` stays as
cheap as the control plane needs.
"""

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
from clusterflow.collective.membership import Membership

if TYPE_CHECKING:
    from clusterflow.collective.group import CollectiveGroup, select_backend, select_device

__all__ = [
    "AllReduceAlgorithm",
    "CollectiveError",
    "CollectiveGroup",
    "CommunicationImplementation",
    "CommunicationOptions",
    "Compression",
    "Membership",
    "MembershipError",
    "PeerLost",
    "select_backend",
    "select_device",
]

_LAZY = {
    "CollectiveGroup": "clusterflow.collective.group",
    "select_backend": "clusterflow.collective.group",
    "select_device": "clusterflow.collective.group",
}


__getattr__ = lazy_exports(__name__, _LAZY)
