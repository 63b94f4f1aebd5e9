"""How the CLI shows a cluster's state: the columns of ``ps`` and the lines of ``describe``.

Pure functions of a ``ClusterState`` (and, for the checkpoint line, the checkpoint
folder), apart from the commands that print them (``cli/main.py``), so the figures are
tested without a cluster.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clusterflow.manager.state import ClusterState, TaskState


def uptime(state: ClusterState) -> str:
    if not state.created:
        return "-"
    seconds = int(max(0.0, (state.ended or time.time()) - state.created))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def task_summary(state: ClusterState) -> str:
    tasks = state.tasks
    running = sum(1 for t in tasks if t.exit_code is None and t.status == "running")
    jobs = Counter(t.task.split(":")[0] for t in tasks)
    shape = " ".join(f"{job}:{n}" for job, n in jobs.items())
    return f"{running}/{len(tasks)} running ({shape})" if tasks else "-"


def figures(state: ClusterState) -> tuple[str, str]:
    """The cluster's live figures (``ClusterState.figures``) as ``ps`` prints them."""
    step, rate = state.figures()
    return ("-" if step is None else str(step), "-" if rate is None else f"{rate:.0f}")


def task_figures(task: TaskState) -> str:
    parts = [f"step {task.step}"] if task.step is not None else []
    parts += [f"loss {task.loss:.4g}"] if task.loss is not None else []
    parts += [f"{task.samples_per_s:.0f} samples/s"] if task.samples_per_s is not None else []
    parts += [f"restarts {task.restarts}"] if task.restarts else []
    return ("  " + ", ".join(parts)) if parts else ""


def task_placement(task: TaskState) -> str:
    """Where a task on Ray runs: its node and what Ray gave it."""
    if not task.node_id:
        return ""
    resources = ",".join(f"{k}={v:g}" for k, v in (task.resources or {}).items() if k != "memory")
    asked, peak = task.memory_requested, task.memory_peak
    memory = f" memory asked {mib(asked)}, peak {mib(peak)}" if asked or peak else ""
    return f"  node {task.node_id[:12]} ({task.node_ip}) {resources}{memory}"


def mib(value: float | None) -> str:
    return f"{value / 2**20:.0f}M" if value else "-"


def checkpoint_line(url: str) -> str:
    """The checkpoint folder, named only once it holds a committed checkpoint: a folder
    with no manifest has nothing to resume from, and naming it sent users looking."""
    from clusterflow.manager.restore import committed_or_none

    newest = committed_or_none(url)
    if newest is None:
        return "none committed"
    return f"{url} (newest step {newest.step})"
