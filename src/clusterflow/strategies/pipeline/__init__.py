"""Pipeline parallelism: stages on tasks, torch's synchronous schedules, PipeDream.

See docs/pipeline.md: ``strategy.py`` (the ``Strategy``), ``sync.py`` (GPipe, 1F1B and
interleaved 1F1B on ``torch.distributed.pipelining``), ``pipedream.py`` (asynchronous
1F1B with weight stashing), ``outputs.py`` (the last stage's outputs to every stage),
``split.py`` (cutting a model), ``layout.py`` (ranks to
pipelines and stages), ``groups.py`` (their process groups), ``state.py`` (a stage's
checkpoint part), ``placed.py`` / ``placed_service.py`` / ``placed_protocol.py``
(in-graph placement with ``cf.device`` over RPC).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clusterflow._lazy import lazy_exports
from clusterflow.strategies.pipeline.api import PipelineConfig, PipelineError, Schedule

if TYPE_CHECKING:
    from clusterflow.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["PipelineConfig", "PipelineError", "PipelineStrategy", "Schedule"]

_LAZY = {"PipelineStrategy": "clusterflow.strategies.pipeline.strategy"}

__getattr__ = lazy_exports(__name__, _LAZY)
