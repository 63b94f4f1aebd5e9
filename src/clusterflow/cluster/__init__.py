"""The cluster model: specs, task ids, device strings and ``TF_CONFIG``, as pure values.

This package imports nothing of clusterflow's but :mod:`clusterflow.errors`, so every
other layer can depend on it (docs/architecture.md section 2).
"""

from __future__ import annotations

from clusterflow.cluster.device import DeviceSpec
from clusterflow.cluster.errors import ClusterSpecError, DeviceSpecError, TFConfigError
from clusterflow.cluster.spec import (
    JOB_ORDER,
    ClusterSpec,
    ClusterSpecLike,
    TaskId,
    format_address,
    parse_address,
)
from clusterflow.cluster.tf_config import TF_CONFIG_ENV, TFConfig

__all__ = [
    "JOB_ORDER",
    "TF_CONFIG_ENV",
    "ClusterSpec",
    "ClusterSpecError",
    "ClusterSpecLike",
    "DeviceSpec",
    "DeviceSpecError",
    "TFConfig",
    "TFConfigError",
    "TaskId",
    "format_address",
    "parse_address",
]
