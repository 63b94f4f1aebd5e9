"""A tuning trial's figures, from the job to its manager (docs/tuning.md).

``report`` sends each call's figures to the manager over the task's link
(``ManagerLink``, ``trial.report``); the manager appends them to the trial's report file
(``manager/trial_reports.py``), which the tuner reads. The link reaches the manager from
any node of a Ray cluster, so reports need no filesystem shared with the tuner.

Only the reporting task sends (the chief, else ``worker:0``), so the figures of N
replicas are not counted N times; outside a trial, and in every other task, ``report``
does nothing, so training code may call it always. A report never fails the job: a
manager that does not answer within the link's deadline costs a warning, once.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from clusterflow.cluster.contract import ENV_TASK, ENV_TRIAL_REPORTER
from clusterflow.cluster.trial import in_trial
from clusterflow.rpc import RpcError
from clusterflow.server.manager_messages import TrialReportRequest

__all__ = ["report"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, Any] = {"step": -1, "link": None, "pid": None, "warned": False}
"""This process's last step reported and its link (made again in a forked child)."""


def report(step: int | None = None, **metrics: float) -> None:
    """Reports figures of this trial at ``step`` (an intermediate value, or the last one).

    ``step`` defaults to one past the last step reported by this process.
    """
    if not in_trial():
        return
    reporter = os.environ.get(ENV_TRIAL_REPORTER)
    if reporter and os.environ.get(ENV_TASK, reporter) != reporter:
        return
    with _lock:
        step = _state["step"] + 1 if step is None else int(step)
        _state["step"] = step
        link = _link()
        if link is None:
            log.warning("a tuning trial's report with no manager to send it to: dropped")
            return
        request = TrialReportRequest(step=step, metrics={k: float(v) for k, v in metrics.items()})
        try:
            link.call(request.METHOD, request.to_wire())
        except RpcError as exc:
            if not _state["warned"]:
                _state["warned"] = True
                log.warning("the manager did not take a trial's report: %s", exc)


def _link() -> Any:
    from clusterflow.server.manager_link import ManagerLink

    if _state["pid"] != os.getpid():  # a fork does not share its parent's socket
        _state["link"], _state["pid"] = ManagerLink.from_env(), os.getpid()
    return _state["link"]
