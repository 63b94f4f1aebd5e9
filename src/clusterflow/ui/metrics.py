"""``/metrics``: the dashboard's figures in Prometheus' text format, for an existing scraper.

A ``prometheus_client`` collector that reads every cluster's state at scrape time (the
same reads as the pages, ``views``), so a scrape is never out of date and nothing is
counted twice. Labels: ``cluster`` (its id), ``job`` and ``task`` (the index in its
job), as Prometheus' own jobs are named apart from instances.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from clusterflow.errors import ClusterflowError
from clusterflow.manager import registry
from clusterflow.ui import views

__all__ = ["ClusterCollector", "make_registry"]

STATUSES = ("created", "starting", "running", "restarting", "succeeded", "failed", "stopped")
"""Every status a cluster's ``status`` gauge has a series for (plus ``stale``)."""

_TASK_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("step", "clusterflow_task_step", "The last step the task's job reported."),
    ("loss", "clusterflow_task_loss", "The last loss the task's job reported."),
    ("samples_per_s", "clusterflow_task_samples_per_second", "The task's samples per second."),
    ("restarts", "clusterflow_task_restarts", "Times the task was relaunched."),
    (
        "memory_requested",
        "clusterflow_task_memory_requested_bytes",
        "Memory the task's placement asked for (Ray backend).",
    ),
    (
        "memory_measured",
        "clusterflow_task_memory_measured_bytes",
        "Resident memory of the task's processes (Ray: the peak; local: now).",
    ),
)


class ClusterCollector(Collector):
    """Yields one family per figure, with a sample per cluster or task."""

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        status = GaugeMetricFamily(
            "clusterflow_cluster_status",
            "1 for the cluster's current status (stale: its manager is gone; unreachable: "
            "its Ray cannot be reached), else 0.",
            labels=["cluster", "status"],
        )
        restarts = GaugeMetricFamily(
            "clusterflow_cluster_restarts", "Whole-cluster restarts so far.", labels=["cluster"]
        )
        age = GaugeMetricFamily(
            "clusterflow_cluster_age_seconds",
            "Seconds since the manager started (to its end, once ended).",
            labels=["cluster"],
        )
        tasks = {
            key: GaugeMetricFamily(name, doc, labels=["cluster", "job", "task"])
            for key, name, doc in _TASK_FIGURES
        }
        up = GaugeMetricFamily(
            "clusterflow_task_up",
            "1 while the task runs, else 0.",
            labels=["cluster", "job", "task"],
        )
        for cluster in registry.all_clusters():
            try:
                state = views.read_state(cluster)
            except ClusterflowError:
                continue
            row = views.cluster_row(cluster, state, now)
            for name in (*STATUSES, "stale", "unreachable"):
                status.add_metric([cluster.id, name], 1.0 if row["status"] == name else 0.0)
            restarts.add_metric([cluster.id], float(state.restarts))
            if row["age_s"] is not None:
                age.add_metric([cluster.id], row["age_s"])
            local = views.tasks_here(state)
            for task in state.tasks:
                task_row: dict[str, Any] = views.task_row(task, local=local)
                labels = [cluster.id, task_row["job"], task_row["index"]]
                running = task.exit_code is None and task.status == "running"
                up.add_metric(labels, 1.0 if running else 0.0)
                for key, family in tasks.items():
                    value = task_row[key]
                    if value is not None:
                        family.add_metric(labels, float(value))
        yield status
        yield restarts
        yield age
        yield up
        yield from tasks.values()


def make_registry() -> CollectorRegistry:
    """A registry of its own (not the process-wide one): only clusterflow's figures."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ClusterCollector())
    return reg
