"""Bounds on what one cluster may ask the manager to launch.

A cluster file or a command line is user input, and sometimes hostile input: a
``workers: 100000000`` would have the manager build a table of a hundred million tasks
and try to start them, hanging the CLI instead of failing it (docs/failure-semantics.md,
"Hostile values"). Refusing it at the edge costs nothing and says why in one line.
"""

from __future__ import annotations

from typing import Final

MAX_PROCESSES: Final = 10_000
"""More task processes than one manager supervises: each costs a supervisor, heartbeats
and a port; well beyond the largest clusters this manager has run."""


def task_processes(ps: int, workers: int, replicas_per_host: int) -> int:
    """The task processes a cluster of these counts may run, at most: ``RunConfig``
    refuses more than ``MAX_PROCESSES``, naming the counts as they were written."""
    return ps + (workers + 2) * replicas_per_host  # a chief and an evaluator, at most
