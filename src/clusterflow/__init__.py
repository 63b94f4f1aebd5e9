"""clusterflow: distributed training for PyTorch on the architecture of distributed TensorFlow.

The public API is re-exported here lazily, so ``import clusterflow`` stays cheap for
processes that never touch torch (the manager, the CLI, task supervisors).
"""

from __future__ import annotations

__version__ = "0.1.0"

from clusterflow.errors import ClusterflowError, ConfigError

__all__ = ["ClusterflowError", "ConfigError", "__version__"]
