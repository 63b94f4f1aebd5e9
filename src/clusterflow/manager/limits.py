"""Bounds on what one cluster may ask the manager to launch.

A cluster file or a command line is user input, and sometimes hostile input: a
``workers: 100000000`` would have the manager build a table of a hundred million tasks
and try to start them, hanging the CLI instead of failing it (docs/failure-semantics.md,
"Hostile values"). Refusing it at the edge costs nothing and says why in one line.
"""

from __future__ import annotations

from typing import Final

from clusterflow.errors import ConfigError

MAX_PROCESSES: Final = 10_000
"""More task processes than one manager supervises: each costs a supervisor, heartbeats
and a port; well beyond the largest clusters this manager has run."""


def check_task_count(ps: int, workers: int, replicas_per_host: int) -> None:
    """Refuses a cluster of more than ``MAX_PROCESSES`` task processes.

    Call after each count was checked to be a non-negative integer.

    Raises:
        ConfigError: naming the counts and the limit.
    """
    processes = ps + (workers + 2) * replicas_per_host  # a chief and an evaluator, at most
    if processes > MAX_PROCESSES:
        raise ConfigError(
            f"--ps {ps} --workers {workers} --replicas-per-host {replicas_per_host} asks for "
            f"{processes} task processes; at most {MAX_PROCESSES} are allowed"
        )
