"""The backends a cluster can run on, each described once: what callers ask of it.

A cluster's settings name its backend (``--backend``, ``backend:`` in a cluster file);
the name is looked up here once (:func:`named`), and callers ask the description the
question they need answered, named for it: where the manager runs
(``manager_in_ray``: ``manager/handle.py`` picks the cluster's handle by it), whether
Ray places the tasks (Ray's settings, memory requests, a trial's share of the nodes, a
cache's servers and the workers that read it), whether the tasks are this machine's
processes as the dashboard sees them, whether the worker job may be resized, and how a
manager on this machine starts the tasks (its :class:`TaskLauncher`). No caller compares
a backend's name, so a backend is added here, not in every caller.

``hosts`` (each task inside an emulated host, for tests and benchmarks) is described
here, so a cluster on it is read and stopped as a local one, but its launcher lives
with the harness: ``clusterflow.testing.hosts_backend`` registers it
(:func:`register_launcher`) when a start first asks for it. The product never imports
the harness for any other backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from clusterflow.backends.api import Backend
from clusterflow.backends.local import LocalLauncher
from clusterflow.errors import ConfigError


class TaskLauncher(Protocol):
    """How a manager on this machine starts a backend's tasks."""

    def check(self, config: Any) -> None:
        """Raises ``ConfigError`` when ``config``'s cluster cannot start on this backend
        from here; called before the cluster's folder is made."""
        ...

    def backend(self, config: Any) -> tuple[Any, Backend]:
        """The run's config as the manager runs it (a backend may set the manager's
        address), and the ``Backend`` that launches its supervisors."""
        ...


class UnknownBackend(ConfigError):
    """A backend name no description here carries."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendKind:
    """One backend as its callers need it (see the module's docstring)."""

    name: str
    """What ``--backend`` and a cluster's settings call it."""
    public: bool
    """Offered by ``--backend``'s help and by messages (``hosts`` is the harness's)."""
    manager_in_ray: bool
    """The manager is a detached actor in a Ray cluster (``manager/ray_host.py``) and
    the cluster's folder here a mirror of its own; else it is a process on this machine
    (``python -m clusterflow.manager``, or the CLI itself in the foreground)."""
    placed_by_ray: bool
    """Ray places the tasks: they take Ray's settings (``RAY_ONLY``), each job gets a
    memory request (``memory_sizing``), Ray gives them their GPUs, a trial's share is what
    the Ray nodes fit (``tune/placement.py``), and a cache on it is served by one actor
    per node, its workers placed on the owners' nodes (``cache/ray_nodes.py``)."""
    tasks_here: bool
    """The tasks are processes of this machine as a reader sees them: the dashboard
    measures their memory by pid. Emulated hosts stand for other machines: no."""
    resizable: bool
    """``--workers MIN:MAX`` may resize the worker job while it runs (issue 32)."""
    launcher_from: str | None = None
    """The module that registers this backend's :class:`TaskLauncher` when it is first
    asked for (a backend not shipped with the product's own modules)."""

    def launcher(self) -> TaskLauncher:
        """How a manager on this machine starts this backend's tasks.

        Raises:
            ConfigError: the backend's manager does not run on this machine (Ray's
                manager places its own tasks, ``manager/ray_host.py``).
        """
        found = _LAUNCHERS.get(self.name)
        if found is None and self.launcher_from is not None:
            importlib.import_module(self.launcher_from)  # it calls register_launcher
            found = _LAUNCHERS.get(self.name)
        if found is None:
            raise ConfigError(f"backend {self.name!r} starts no tasks from this machine")
        return found


LOCAL = BackendKind(
    name="local",
    public=True,
    manager_in_ray=False,
    placed_by_ray=False,
    tasks_here=True,
    resizable=True,
)
RAY = BackendKind(
    name="ray",
    public=True,
    manager_in_ray=True,
    placed_by_ray=True,
    tasks_here=False,
    # A grow's tasks are placed per change; a node that joins is used (manager/ray_growth.py).
    resizable=True,
)
HOSTS = BackendKind(
    name="hosts",
    public=False,
    manager_in_ray=False,
    placed_by_ray=False,
    tasks_here=False,
    resizable=False,
    launcher_from="clusterflow.testing.hosts_backend",
)

KINDS: Mapping[str, BackendKind] = {kind.name: kind for kind in (LOCAL, RAY, HOSTS)}
"""Every backend, by name. The one place a backend's name is looked up."""
PUBLIC = tuple(name for name, kind in KINDS.items() if kind.public)
"""The names messages and ``--backend``'s help offer."""
HIDDEN = tuple(name for name, kind in KINDS.items() if not kind.public)
"""The names ``--backend`` takes without offering them (the harness's)."""

_LAUNCHERS: dict[str, TaskLauncher] = {LOCAL.name: LocalLauncher()}


def register_launcher(name: str, launcher: TaskLauncher) -> None:
    """Gives backend ``name`` its launcher (``hosts``: from the harness, on import)."""
    if name not in KINDS:
        raise UnknownBackend(f"no backend {name!r} to register a launcher for")
    _LAUNCHERS[name] = launcher


def find(name: object) -> BackendKind | None:
    """The backend called ``name``; None for a name none is called (settings not checked
    yet, or a folder written by another version), for callers that have an answer for
    that case of their own."""
    return KINDS.get(name) if isinstance(name, str) else None


def named(name: str) -> BackendKind:
    """The backend called ``name``.

    Raises:
        UnknownBackend: no backend is called so (one line naming it and the known ones).
    """
    kind = KINDS.get(name)
    if kind is None:
        raise UnknownBackend(f"unknown backend {name!r}: use {' or '.join(PUBLIC)}")
    return kind
