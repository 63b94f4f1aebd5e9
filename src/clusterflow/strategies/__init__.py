"""Distribution strategies: one API over the collective and parameter-server engines."""

from __future__ import annotations

from clusterflow.strategies.api import ReduceOp, Strategy, StrategyError
from clusterflow.strategies.resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)

__all__ = [
    "ClusterResolver",
    "ReduceOp",
    "SimpleClusterResolver",
    "Strategy",
    "StrategyError",
    "TFConfigClusterResolver",
]
