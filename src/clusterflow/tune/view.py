"""What ``tune ls`` and ``tune describe`` show, read from the study's storage."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from clusterflow.errors import ConfigError
from clusterflow.tune.study import INTERRUPTED, _optuna, default_storage

__all__ = ["best_checkpoint", "studies", "trials"]


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def studies(storage: str | None) -> list[dict[str, str]]:
    """One row per study: trials done / running / pruned / failed, best value."""
    optuna = _optuna()
    url = storage or default_storage()
    rows = []
    for summary in optuna.get_all_study_summaries(url, include_best_trial=True):
        study = optuna.load_study(study_name=summary.study_name, storage=url)
        counts = Counter(
            "interrupted" if t.user_attrs.get(INTERRUPTED) else t.state.name.lower()
            for t in study.get_trials(deepcopy=False)
        )
        best = summary.best_trial
        rows.append(
            {
                "study": summary.study_name,
                "direction": summary.direction.name.lower(),
                "done": str(counts["complete"]),
                "running": str(counts["running"]),
                "pruned": str(counts["pruned"]),
                "failed": str(counts["fail"]),
                "best": _value(best.value if best else None),
                "best trial": str(best.number) if best else "-",
            }
        )
    return rows


def _load(name: str, storage: str | None) -> Any:
    optuna = _optuna()
    try:
        return optuna.load_study(study_name=name, storage=storage or default_storage())
    except KeyError:
        raise ConfigError(f"no study {name!r} (see `clusterflow tune ls`)") from None


def trials(name: str, storage: str | None) -> list[dict[str, str]]:
    """One row per trial: params, value, status, cluster id, checkpoint, summary."""
    study = _load(name, storage)
    best = best_checkpoint(name, storage)
    rows = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        status = "interrupted" if attrs.get(INTERRUPTED) else t.state.name.lower()
        checkpoint = str(attrs.get("checkpoint") or "-")
        rows.append(
            {
                "trial": str(t.number) + (" (best)" if best and best[0] == t.number else ""),
                "status": status,
                "value": _value(t.value),
                "params": json.dumps(t.params),
                "cluster": str(attrs.get("cluster_id", "-")),
                "checkpoint": checkpoint,
                "summary": str(attrs.get("summary", "")),
            }
        )
    return rows


def best_checkpoint(name: str, storage: str | None) -> tuple[int, str] | None:
    """The best trial's number and checkpoint folder (``load_module`` opens it)."""
    study = _load(name, storage)
    try:
        best = study.best_trial
    except ValueError:
        return None
    return best.number, str(best.user_attrs.get("checkpoint", ""))
