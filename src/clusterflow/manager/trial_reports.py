"""The manager's side of a tuning trial's reports: ``trial.report`` appended to a file.

The reporting task sends its figures over the link every task has to its manager
(``server/trial_report.py``), wherever it runs; the manager appends one JSON line per
report to ``trial-report.jsonl`` in its own folder. For a local trial that folder is the
trial's; on Ray it is the manager's folder on its node, which the tuner's mirror pulls
(``manager/ray_host.py``), so a trial reports from any node with no shared filesystem.
The line is written before the call is answered: a job that reported and exited has its
last figures on disk before its manager can end.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from clusterflow.cluster.contract import ManagerMethod
from clusterflow.cluster.trial import REPORT_FILE
from clusterflow.rpc import MalformedBody, Request, body_map

MAX_FIGURES = 256
"""Most figures one report may carry (a report is a handful; a flood is refused)."""
MAX_NAME = 200


def line(body: Any) -> str:
    """The report file's line for a ``trial.report`` body ``{"step", "metrics"}``.

    Raises:
        MalformedBody: the body is not a step and a map of names to numbers.
    """
    body = body_map("trial.report body", body)
    step, metrics = body.get("step"), body.get("metrics")
    if isinstance(step, bool) or not isinstance(step, int):
        raise MalformedBody(f"trial.report: step must be a whole number, got {step!r}")
    if not isinstance(metrics, dict) or len(metrics) > MAX_FIGURES:
        raise MalformedBody(
            f"trial.report: metrics must map at most {MAX_FIGURES} names to numbers"
        )
    figures: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise MalformedBody(f"trial.report: bad figure name {str(name)[:MAX_NAME]!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MalformedBody(f"trial.report: figure {name} is not a number: {value!r}")
        figures[name] = float(value) if math.isfinite(value) else float("nan")
    # NaN is kept as null: the tuner drops it (a diverged step), the line stays JSON.
    shown = {k: (None if math.isnan(v) else v) for k, v in figures.items()}
    return json.dumps({"step": step, "time": time.time(), "metrics": shown}) + "\n"


class TrialReports:
    """Appends each ``trial.report`` to ``folder/trial-report.jsonl``."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / REPORT_FILE
        self._lock = threading.Lock()

    def register_on(self, rpc: Any) -> TrialReports:
        rpc.register(ManagerMethod.TRIAL_REPORT, self.on_report, blocking=False)
        return self

    def on_report(self, request: Request) -> None:
        """``trial.report``: the line written before the answer."""
        text = line(request.body)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
