"""The parameter-server strategy: variables on ps tasks, gradients pushed to them.

See docs/parameter-server.md: ``strategy.py`` (``ParameterServerStrategy``, the order
of calls: pull, step, push, settle), ``config.py`` (``ParameterServerConfig``, its
settings), ``shards.py`` (moving the model's shards to and from the ps tasks),
``staging.py`` (pinned host buffers for a GPU worker), ``keys.py`` (which data splits a
push applied: exactly-once data), ``cut.py`` (its part of a consistent checkpoint),
``tables.py`` and ``sparse.py`` (embedding tables on the ps, dense layers all-reduced).
The one-process form, ``CentralStorageStrategy``, is in ``strategies/central_storage.py``;
the ps tasks' own side is the ``ps`` package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clusterflow._lazy import lazy_exports
from clusterflow.strategies.parameter_server.config import ParameterServerConfig

if TYPE_CHECKING:
    from clusterflow.strategies.parameter_server.strategy import ParameterServerStrategy

__all__ = ["ParameterServerConfig", "ParameterServerStrategy"]

# The strategy loads on first use, as pipeline/ does: a module that needs one helper
# (train/cut.py reads sparse.DENSE_PART) does not load the whole strategy with it.
_LAZY = {"ParameterServerStrategy": "clusterflow.strategies.parameter_server.strategy"}

__getattr__ = lazy_exports(__name__, _LAZY)
