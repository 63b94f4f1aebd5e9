"""The job side of a tuning trial: its parameters in, its figures out (docs/tuning.md).

A trial's cluster gets three variables from ``clusterflow tune``: the parameters as JSON,
the file its figures go to (``trial-report.jsonl`` in the cluster's folder) and the one
task that reports (the chief, else ``worker:0``), so the figures of N replicas are not
counted N times. A file, not the manager link: the tuner reads it while the cluster
runs and after it ended, with no server of its own, and a report never fails a job.
Outside a trial :func:`report` does nothing, so training code may call it always.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from clusterflow.cluster.contract import (
    ENV_TASK,
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
    "report",
]


def in_trial(env: Mapping[str, str] | None = None) -> bool:
    """True inside a tuning trial's task."""
    return bool((os.environ if env is None else env).get(ENV_TRIAL_REPORT))


def params() -> dict[str, Any]:
    """This trial's parameters (empty outside a trial)."""
    raw = os.environ.get(ENV_TRIAL_PARAMS)
    return dict(json.loads(raw)) if raw else {}


def report(step: int | None = None, **metrics: float) -> None:
    """Reports figures of this trial at ``step`` (an intermediate value, or the last one).

    Only the reporting task writes; elsewhere, and outside a trial, this does nothing.
    ``step`` defaults to one past the last step reported by this process.
    """
    path = os.environ.get(ENV_TRIAL_REPORT)
    if not path:
        return
    reporter = os.environ.get(ENV_TRIAL_REPORTER)
    if reporter and os.environ.get(ENV_TASK, reporter) != reporter:
        return
    step = _last_step[0] + 1 if step is None else int(step)
    _last_step[0] = step
    figures = {k: float(v) for k, v in metrics.items()}
    line = json.dumps({"step": step, "time": time.time(), "metrics": figures})
    # One write of one line in append mode: readers see whole lines only.
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


_last_step = [-1]  # this process's last step reported


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
            figures = {str(k): float(v) for k, v in dict(entry["metrics"]).items()}
            out.append((int(entry["step"]), {k: v for k, v in figures.items() if math.isfinite(v)}))
        except (ValueError, KeyError, TypeError):
            continue
    return out
