"""A tuning trial's variables and its report file (docs/tuning.md).

A trial's cluster gets three variables from ``clusterflow tune``: the parameters as JSON,
the name of its report file (``trial-report.jsonl``, in the manager's folder) and the one
task that reports (the chief, else ``worker:0``). The job sends its figures to its
manager (``server/trial_report.py``), which appends them to that file
(``manager/trial_reports.py``); the tuner reads it (:func:`read_reports`) while the
cluster runs and after it ended, with no server of its own.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from clusterflow.cluster.contract import (
    ENV_TRIAL_PARAMS,
    ENV_TRIAL_REPORT,
    ENV_TRIAL_REPORTER,
)

REPORT_FILE: Final = "trial-report.jsonl"

__all__ = [
    "ENV_TRIAL_PARAMS",
    "ENV_TRIAL_REPORT",
    "ENV_TRIAL_REPORTER",
    "REPORT_FILE",
    "in_trial",
    "params",
    "read_reports",
]


def in_trial(env: Mapping[str, str] | None = None) -> bool:
    """True inside a tuning trial's task."""
    return bool((os.environ if env is None else env).get(ENV_TRIAL_REPORT))


def params() -> dict[str, Any]:
    """This trial's parameters (empty outside a trial)."""
    raw = os.environ.get(ENV_TRIAL_PARAMS)
    return dict(json.loads(raw)) if raw else {}


def read_reports(path: Path) -> list[tuple[int, dict[str, float]]]:
    """Every whole line of a report file, in order: ``(step, figures)``; NaN dropped."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # a line still being written
        try:
            entry = json.loads(line)
            # A figure that was not finite is null in the file: dropped, as NaN is.
            metrics = dict(entry["metrics"]).items()
            figures = {str(k): float(v) for k, v in metrics if v is not None}
            out.append((int(entry["step"]), {k: v for k, v in figures.items() if math.isfinite(v)}))
        except (ValueError, KeyError, TypeError):
            continue
    return out
