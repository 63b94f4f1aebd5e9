"""clusterflow: distributed training for PyTorch on the architecture of distributed TensorFlow.

The public API is re-exported here lazily, so ``import clusterflow`` stays cheap for
processes that never touch torch (the manager, the CLI, task supervisors)::

    import clusterflow as cf

    strategy = cf.ParameterServerStrategy(mode="sync", backup_workers=1)
    with strategy.scope():
        model = Net()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clusterflow._lazy import lazy_exports
from clusterflow.errors import ClusterflowError, ConfigError

__version__ = "0.1.0"

if TYPE_CHECKING:
    from clusterflow import data, strategies, tune
    from clusterflow.cluster import ClusterSpec, DeviceSpec, TaskId, TFConfig
    from clusterflow.server import Server, create_local_server
    from clusterflow.strategies import (
        ClusterCoordinator,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        ReduceOp,
        RemoteValue,
        SimpleClusterResolver,
        Strategy,
        TFConfigClusterResolver,
    )
    from clusterflow.strategies.central_storage import CentralStorageStrategy
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    from clusterflow.strategies.pipeline import PipelineStrategy
    from clusterflow.strategies.variables import Variable, device
    from clusterflow.train import (
        Checkpoint,
        Evaluate,
        History,
        Hook,
        Progress,
        StopAtStep,
        Summary,
        TrainingSession,
        fit,
        run_evaluator,
    )

_LAZY = {
    "ClusterSpec": "clusterflow.cluster",
    "DeviceSpec": "clusterflow.cluster",
    "TaskId": "clusterflow.cluster",
    "TFConfig": "clusterflow.cluster",
    "Server": "clusterflow.server",
    "create_local_server": "clusterflow.server",
    "Strategy": "clusterflow.strategies",
    "ReduceOp": "clusterflow.strategies",
    "SimpleClusterResolver": "clusterflow.strategies",
    "TFConfigClusterResolver": "clusterflow.strategies",
    "MirroredStrategy": "clusterflow.strategies",
    "MultiWorkerMirroredStrategy": "clusterflow.strategies",
    "ClusterCoordinator": "clusterflow.strategies",
    "RemoteValue": "clusterflow.strategies",
    "ParameterServerStrategy": "clusterflow.strategies.parameter_server",
    "CentralStorageStrategy": "clusterflow.strategies.central_storage",
    "PipelineStrategy": "clusterflow.strategies.pipeline",
    "Variable": "clusterflow.strategies.variables",
    "device": "clusterflow.strategies.variables",
    "fit": "clusterflow.train",
    "TrainingSession": "clusterflow.train",
    "History": "clusterflow.train",
    "Hook": "clusterflow.train",
    "StopAtStep": "clusterflow.train",
    "Checkpoint": "clusterflow.train",
    "Summary": "clusterflow.train",
    "Progress": "clusterflow.train",
    "Evaluate": "clusterflow.train",
    "run_evaluator": "clusterflow.train",
    # Subpackages themselves, loaded only when asked for: `cf.tune.report` and
    # `cf.tune.run` (tune sits above the manager), `cf.data.distributed_dataset` and
    # `cf.strategies.serve_worker`, as the docs write them (tests/unit/test_doc_snippets.py).
    "tune": "clusterflow.tune",
    "data": "clusterflow.data",
    "strategies": "clusterflow.strategies",
}

__all__ = [
    "CentralStorageStrategy",
    "Checkpoint",
    "ClusterCoordinator",
    "ClusterSpec",
    "ClusterflowError",
    "ConfigError",
    "DeviceSpec",
    "Evaluate",
    "History",
    "Hook",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "Progress",
    "ReduceOp",
    "RemoteValue",
    "Server",
    "SimpleClusterResolver",
    "StopAtStep",
    "Strategy",
    "Summary",
    "TFConfig",
    "TFConfigClusterResolver",
    "TaskId",
    "TrainingSession",
    "Variable",
    "__version__",
    "create_local_server",
    "data",
    "device",
    "fit",
    "run_evaluator",
    "strategies",
    "tune",
]


__getattr__ = lazy_exports(__name__, _LAZY)
