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
from clusterflow.rpc import Request
from clusterflow.server.manager_messages import TrialReportRequest


def line(body: Any) -> str:
    """The report file's line for a ``trial.report`` body (``TrialReportRequest``).

    Raises:
        MalformedBody: the body is not a step and a map of names to numbers.
    """
    report = TrialReportRequest.from_wire(body)
    # NaN is kept as null: the tuner drops it (a diverged step), the line stays JSON.
    shown = {k: (None if math.isnan(v) else v) for k, v in report.metrics.items()}
    return json.dumps({"step": report.step, "time": time.time(), "metrics": shown}) + "\n"


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
