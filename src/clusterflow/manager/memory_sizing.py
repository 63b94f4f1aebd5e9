"""Memory sized by the platform (``--memory auto``, the default on Ray), not guessed.

Users asked to name a task's memory ask for as much as they dare, which strands the
nodes' GPUs; a task that asks too little is killed. So each task's peak memory (its whole
process tree) is measured while it runs (``backends/ray_actor.py``), and kept here, per command
and job, in ``$CLUSTERFLOW_HOME/memory.json`` of the machine that runs the CLI. A later
run of the same command (a new ``start``, or ``--resume``) asks for the measured peak
times ``HEADROOM``; a job never measured asks for ``ESTIMATE``. Within a run, every later
placement (a whole restart, a standby taking a task over) asks for the peak measured so
far (``backends/memory_watch.within_run``), never less than a kill for memory made it ask.

Every request, automatic or named (``--resources JOB:memory=...``, ``--memory SIZE``),
is enforced on the node (``backends/memory_watch.py``): a task whose process tree
outgrows it is killed, and the cluster restarts with the job asking 1.5 times as much,
bounded by the largest node; such a restart does not count against ``--max-restarts``
(``manager/policy.py``). A first guess that was too small thus costs a restart from the
last checkpoint, never the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from clusterflow.backends import kinds
from clusterflow.backends.memory_watch import FLOOR, HEADROOM, within_run
from clusterflow.cluster import TaskId
from clusterflow.manager import registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.job_settings import parse_size
from clusterflow.manager.state import ClusterState

ESTIMATE = float(1 << 30)
"""A first run's request per task: a small PyTorch job's processes (the interpreter,
torch, a model of some MB, the supervisor) use 0.3-0.6 GiB; 1 GiB places it with room."""


def store_file() -> Path:
    return registry.home() / "memory.json"


def job_key(config: RunConfig, job: str) -> str:
    """The same command and job, the same key (the command's arguments included); or the
    same ``memory_key`` and job (a study's trials: its command before ``{name}`` is filled
    in, so that each trial is sized by the earlier trials' peaks)."""
    if config.memory_key:
        return hashlib.sha256(json.dumps(["key", config.memory_key, job]).encode()).hexdigest()[:24]
    command = list(config.command_for(TaskId(job, 0)))
    return hashlib.sha256(json.dumps([command, job]).encode()).hexdigest()[:24]


def _read() -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(store_file().read_text())
        if isinstance(data, dict):
            return data
    return {}


def measured(config: RunConfig, job: str) -> float | None:
    """The job's peak memory from the last run of the same command; None if never run."""
    entry = _read().get(job_key(config, job))
    peak = entry.get("peak") if isinstance(entry, dict) else None
    return float(peak) if isinstance(peak, int | float) and peak > 0 else None


def record(config: RunConfig, state: ClusterState) -> None:
    """Keeps each job's measured peak (the largest of its tasks') from a run's state."""
    peaks: dict[str, float] = {}
    for task in state.tasks:
        if task.memory_peak:
            job = task.task.split(":")[0]
            peaks[job] = max(peaks.get(job, 0.0), task.memory_peak)
    if not peaks:
        return
    data = _read()
    for job, peak in peaks.items():
        data[job_key(config, job)] = {"job": job, "command": list(config.command), "peak": peak}
    registry.write_json_atomic(store_file(), data)


def earlier_peaks(config: RunConfig, jobs: frozenset[str]) -> dict[str, float]:
    """The peaks earlier runs measured for ``jobs`` (those found), for ``within_run``."""
    found = {job: measured(config, job) for job in jobs}
    return {job: peak for job, peak in found.items() if peak}


def size(config: RunConfig) -> tuple[RunConfig, frozenset[str]]:
    """``config`` with a memory request for every job (on Ray); and the jobs sized
    automatically (not named by the user: an error blames only what the user named)."""
    if not kinds.named(config.backend).placed_by_ray:  # only Ray places by memory requests
        return config, frozenset()
    resources = {job: dict(r) for job, r in config.resources.items()}
    automatic = set()
    for job in {t.job for t in config.tasks()}:
        wanted = resources.setdefault(job, {})
        if wanted.get("memory"):
            continue
        if config.memory and config.memory != "auto":
            wanted["memory"] = float(parse_size(config.memory, "--memory"))
            continue
        peak = measured(config, job)
        wanted["memory"] = max(FLOOR, peak * HEADROOM) if peak else ESTIMATE
        automatic.add(job)
    return replace(config, resources=resources), frozenset(automatic)


__all__ = [
    "ESTIMATE",
    "FLOOR",
    "HEADROOM",
    "earlier_peaks",
    "measured",
    "record",
    "size",
    "within_run",
]
