"""What the dashboard shows, read from where ``ps`` and ``describe`` read it.

Every figure comes from the cluster's folder (``state.json``, ``events.jsonl``, the task
logs) as the manager wrote it, or from the manager itself (the data service's counts);
nothing is counted or kept here, so the dashboard can never disagree with ``describe``.
The values are plain JSON (the pages, the event stream and ``/metrics`` share them).
All of it blocks on files (and, for the data service, one RPC with a deadline): the app
calls it from worker threads.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import psutil

from clusterflow.backends import kinds
from clusterflow.cluster.contract import TENSORBOARD_FILE
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.manager import handle, registry
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.state import ClusterState, TaskState

__all__ = [
    "LOG_TAIL_BYTES",
    "MAX_EVENTS",
    "UnknownCluster",
    "checkpoints",
    "cluster_detail",
    "cluster_row",
    "cluster_rows",
    "find",
    "log_tails",
    "membership",
    "read_state",
    "tensorboard_dir",
]

LOG_TAIL_BYTES: Final = 8192
"""How much of each task's log the page follows: the last screenful or so."""
MAX_EVENTS: Final = 200
"""The timeline shows the newest events; ``describe`` prints them all."""


class UnknownCluster(ClusterflowError):
    """The URL names no cluster (the app answers 404)."""


def find(cluster_id: str) -> ClusterDir:
    """The cluster with this exact id (no prefixes: a URL names one cluster).

    Raises:
        UnknownCluster: there is none, or the id could not be one.
    """
    try:
        cluster = registry.find(cluster_id)
    except ConfigError as exc:
        raise UnknownCluster(str(exc)) from None
    except OSError:  # a name the filesystem refuses (too long): no cluster has it
        raise UnknownCluster(f"no cluster {cluster_id[:80]!r}") from None
    if cluster.id != cluster_id:
        raise UnknownCluster(f"no cluster {cluster_id!r}")
    return cluster


_LOCKS_LOCK = threading.Lock()
_REFRESH_LOCKS: dict[str, threading.Lock] = {}


def read_state(cluster: ClusterDir) -> ClusterState:
    """The state as ``ps`` reads it: a Ray cluster's mirror refreshed first.

    One refresh of a cluster at a time in this process: a refresh appends the manager's
    new output to the mirror from the sizes it found, so two at once (a page's stream, the
    list's, a scrape) would append the same bytes twice.
    """
    with _LOCKS_LOCK:
        lock = _REFRESH_LOCKS.setdefault(cluster.id, threading.Lock())
    with lock:  # its Ray unreachable: the mirror's state, reading `unreachable` (why)
        return handle.read(cluster)


def _age(state: ClusterState, now: float) -> float | None:
    if not state.created:
        return None
    return max(0.0, (state.ended or now) - state.created)


def cluster_row(cluster: ClusterDir, state: ClusterState, now: float) -> dict[str, Any]:
    """One line of the cluster list (and the head of its page)."""
    live = [t for t in state.tasks if t.exit_code is None and t.status == "running"]
    step, rate = state.figures()
    return {
        "id": cluster.id,
        "status": registry.effective_status(state),
        "tasks": len(state.tasks),
        "running": len(live),
        "restarts": state.restarts,
        "max_restarts": state.max_restarts,
        "age_s": _age(state, now),
        "created": state.created,
        "step": step,
        "samples_per_s": rate,
        "command": shlex.join(state.command),
        "backend": state.backend or "local",
        "summary": state.summary,
        "exit_code": state.exit_code,
    }


def cluster_rows() -> list[dict[str, Any]]:
    """Every cluster, newest first; one whose state cannot be read says so."""
    now = time.time()
    rows = []
    for cluster in registry.all_clusters():
        try:
            rows.append(cluster_row(cluster, read_state(cluster), now))
        except ClusterflowError as exc:
            rows.append({"id": cluster.id, "status": "unreadable", "summary": str(exc)})
    return rows


def _tree_rss(pid: int | None) -> int | None:
    """Resident memory of a local task's process tree now (its supervisor and job)."""
    if not pid:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total or None


def tasks_here(state: ClusterState) -> bool:
    """Whether the cluster's tasks are this machine's processes (``BackendKind.tasks_here``):
    only then is a live task's memory measured by its pid. A backend unknown here: no."""
    kind = kinds.find(state.backend or kinds.LOCAL.name)
    return kind is not None and kind.tasks_here


def task_row(task: TaskState, *, local: bool) -> dict[str, Any]:
    """One task, as the tasks table and the charts show it."""
    job, _, index = task.task.partition(":")
    measured = task.memory_peak
    if measured is None and local and task.exit_code is None:
        measured = _tree_rss(task.pid)
    return {
        "task": task.task,
        "job": job,
        "index": index,
        "node": task.node_ip or (task.node_id[:12] if task.node_id else "local"),
        "status": task.status,
        "address": task.address,
        "pid": task.pid,
        "exit_code": task.exit_code,
        "step": task.step,
        "samples_per_s": task.samples_per_s,
        "loss": task.loss,
        "memory_requested": task.memory_requested,
        "memory_measured": measured,
        "restarts": task.restarts,
        "tracked": task.tracked,
    }


def membership(state: ClusterState) -> dict[str, Any]:
    """The worker job's size and who joined and left it (an elastic cluster, issue 32).

    ``workers`` counts the worker tasks now, as ``describe`` does; ``range`` is MIN and
    MAX (None: a fixed size); ``history`` is the state's membership, newest first, each
    row with the size the change left the job at.
    """
    return {
        "workers": state.workers(),
        "range": list(state.workers_range) if state.workers_range else None,
        "history": [
            {
                "time": m.time,
                "task": m.task,
                "change": m.change,
                "step": m.step,
                "spec_version": m.spec_version,
                "workers": m.workers,
            }
            for m in reversed(state.membership)
        ],
    }


def events(cluster: ClusterDir) -> list[dict[str, Any]]:
    """The newest ``MAX_EVENTS`` of the timeline, oldest first."""
    return cluster.read_events()[-MAX_EVENTS:]


def checkpoints(state: ClusterState) -> list[dict[str, Any]]:
    """The committed checkpoints under the cluster's checkpoint folder, oldest first.

    Manifests only (a listing and one small read each): parts are not verified here,
    which is the restore's job.
    """
    if not state.checkpoint_dir:
        return []
    from clusterflow.checkpoint import CheckpointStorage

    try:
        found = CheckpointStorage(state.checkpoint_dir).committed()
    except (ClusterflowError, OSError, ValueError):
        return []
    return [
        {
            "step": m.step,
            "created": m.created,
            "parts": len(m.parts),
            "bytes": sum(p.size for p in m.parts.values()),
            "directory": m.directory,
        }
        for m in found
    ]


def tensorboard_dir(cluster: ClusterDir) -> str | None:
    """The run's TensorBoard folder, if its chief writes summaries (``Summary`` hook)."""
    try:
        text = (cluster.path / TENSORBOARD_FILE).read_text().strip()
    except OSError:
        return None
    return text or None


def _tail(path: Path, limit: int) -> str:
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError:
        return ""
    if len(data) == limit and b"\n" in data:
        data = data[data.index(b"\n") + 1 :]  # not half a line
    return data.decode("utf-8", "replace")


def log_tails(cluster: ClusterDir, tasks: Iterable[str]) -> dict[str, str]:
    """The last ``LOG_TAIL_BYTES`` of each task's log."""
    return {task: _tail(cluster.task_log(task), LOG_TAIL_BYTES) for task in tasks}


def cluster_detail(cluster: ClusterDir, *, with_checkpoints: bool = True) -> dict[str, Any]:
    """Everything the cluster's page shows except log tails and the data service."""
    state = read_state(cluster)
    local = tasks_here(state)
    detail = cluster_row(cluster, state, time.time())
    detail.update(
        {
            "spec": state.spec,
            "spec_version": state.spec_version,
            "tasks": [task_row(t, local=local) for t in state.tasks],
            "membership": membership(state),
            "events": events(cluster),
            "checkpoint_dir": state.checkpoint_dir,
            "tensorboard_dir": tensorboard_dir(cluster),
            "folder": str(cluster.path),
            "manager_address": state.manager.address if state.manager else None,
            "ended": state.ended,
        }
    )
    if with_checkpoints:
        detail["checkpoints"] = checkpoints(state)
    return detail
