"""Hyperparameter tuning on Optuna: a study's trials, each a clusterflow cluster.

``clusterflow tune`` (or :func:`run`) asks Optuna for parameters, starts each trial as
a cluster, reads the figures the job reports with :func:`report` (``fit`` reports its
``History`` by itself) and tells Optuna. Importing this package needs no Optuna (nor
torch): the job side only writes a file; running a study imports Optuna. docs/tuning.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clusterflow._checks import listed
from clusterflow._lazy import lazy_exports
from clusterflow.cluster.trial import in_trial, params
from clusterflow.server.trial_report import report
from clusterflow.tune.space import Param, parse_params

if TYPE_CHECKING:
    from clusterflow.tune.study import TuneSettings, default_storage

# The job side (report, params) stays light: the study's loop (the manager's registry,
# Optuna) loads only when a study runs.
__getattr__ = lazy_exports(
    __name__,
    {"TuneSettings": "clusterflow.tune.study", "default_storage": "clusterflow.tune.study"},
)

__all__ = ["Param", "TuneSettings", "default_storage", "in_trial", "params", "report", "run"]


def run(
    study: str,
    *,
    params: Mapping[str, str] | Sequence[str],
    command: Sequence[str],
    metric: str,
    direction: str = "maximize",
    trials: int = 10,
    parallel: int = 1,
    sampler: str = "tpe",
    pruner: str = "median",
    storage: str | None = None,
    max_failures: int = 3,
    seed: int | None = None,
    cluster: Mapping[str, Any] | None = None,
    echo: Callable[[str], None] | None = None,
) -> int:
    """Runs a study, as ``clusterflow tune`` does; returns its exit code (0: all done).

    ``params`` maps names to ``KIND:...`` (``{"lr": "loguniform:1e-4:1e-1"}``) or lists
    ``--param`` texts; ``cluster`` holds ``start``'s settings (``{"workers": 2}``).
    """
    from clusterflow.tune.study import StudyRunner, TuneSettings

    listed("command", command, "arguments")

    specs = [f"{k}={v}" for k, v in params.items()] if isinstance(params, Mapping) else params
    settings = TuneSettings(
        study=study,
        metric=metric,
        params=parse_params(specs),
        command=tuple(command),
        trials=trials,
        parallel=parallel,
        direction=direction,
        sampler=sampler,
        pruner=pruner,
        storage=storage,
        max_failures=max_failures,
        seed=seed,
        cluster=dict(cluster or {}),
    )
    return StudyRunner(settings, echo).run()
