"""``state.json``: what the manager tells the CLI about a cluster, as one typed value.

The manager writes a ``ClusterState`` (atomically, at every change and at least every
two seconds) and answers ``manager.status`` with the same; ``clusterflow ps``,
``describe``, ``attach`` and ``stop`` read it back, whether or not the manager still
runs. ``describe --json`` prints its dictionary, the file's own JSON.

Reading is lenient about what it does not know (a newer manager may write more) and
strict about the types of what it does: a field of the wrong type reads as absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from clusterflow.errors import ConfigError

Status = Literal["created", "starting", "running", "restarting", "succeeded", "failed", "stopped"]
TERMINAL = frozenset({"succeeded", "failed", "stopped"})
"""Statuses after which nothing runs; every other status needs a live manager."""
FIGURES = ("step", "loss", "samples_per_s")
"""The live figures a task's job reports (``task.report``)."""
PLACEMENT = ("node_id", "node_ip", "resources", "memory_requested", "memory_peak")
"""Where the Ray backend placed a task (docs/ray.md)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskState:
    """One task as the manager last saw it."""

    task: str
    """``job:index``."""
    tracked: bool = True
    """Whether the run waits for it (chief and workers, unless ``--untracked``)."""
    status: str = "starting"
    """starting, registered, running, restarting, stopping, succeeded, failed, stopped."""
    address: str | None = None
    pid: int | None = None
    """Its supervisor's pid."""
    exit_code: int | None = None
    restarts: int = 0
    """Times it was relaunched, alone or with every task."""
    step: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    node_id: str | None = None
    """Ray backend: the node the task runs on (None for local tasks)."""
    node_ip: str | None = None
    resources: dict[str, float] | None = None
    """Ray backend: what Ray gave the task (CPU, GPU, memory, custom)."""
    memory_requested: float | None = None
    """Ray backend: the memory its placement asked for (bytes; manager/memory_sizing.py)."""
    memory_peak: float | None = None
    """Ray backend: the peak resident memory of its process tree so far (bytes)."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "task": self.task,
            "tracked": self.tracked,
            "status": self.status,
            "address": self.address,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "restarts": self.restarts,
        }
        for name in (*FIGURES, *PLACEMENT):  # only what its job reported, where placed
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TaskState:
        return cls(
            task=_typed(data, "task", str, "?"),
            tracked=_typed(data, "tracked", bool, True),
            status=_typed(data, "status", str, "?"),
            address=_typed(data, "address", str, None),
            pid=_typed(data, "pid", int, None),
            exit_code=_typed(data, "exit_code", int, None),
            restarts=_typed(data, "restarts", int, 0),
            step=_typed(data, "step", int, None),
            loss=_number(data.get("loss")),
            samples_per_s=_number(data.get("samples_per_s")),
            node_id=_typed(data, "node_id", str, None),
            node_ip=_typed(data, "node_ip", str, None),
            resources=_numbers(data.get("resources")),
            memory_requested=_number(data.get("memory_requested")),
            memory_peak=_number(data.get("memory_peak")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ManagerProcess:
    """Which process manages the cluster: a status is live only while it runs."""

    pid: int | None = None
    create_time: float | None = None
    """Tells the manager from a later process that reuses its pid."""
    address: str | None = None
    """Its RPC server (``manager.stop``, ``manager.status``)."""
    actor: str | None = None
    """Ray backend: the detached actor hosting the manager; its mirror here is refreshed
    from it, so its pid says nothing on this machine."""
    node_id: str | None = None
    folder: str | None = None
    """Ray backend: the cluster's folder on the manager's node."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "pid": self.pid,
            "create_time": self.create_time,
            "address": self.address,
        }
        for name in ("actor", "node_id", "folder"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ManagerProcess:
        return cls(
            pid=_typed(data, "pid", int, None),
            create_time=_number(data.get("create_time")),
            address=_typed(data, "address", str, None),
            actor=_typed(data, "actor", str, None),
            node_id=_typed(data, "node_id", str, None),
            folder=_typed(data, "folder", str, None),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StandbyState:
    pid: int
    ready: bool
    """Waiting at the manager: it takes a task at once."""
    kept: int = 1
    """Standbys kept (this one the oldest): one per task under ``--warm-restarts``."""
    ready_count: int = 0
    """Of those, how many wait at the manager (warm)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipChange:
    """A task that joined or left the running cluster (an elastic cluster, issue 32)."""

    time: float
    """When (seconds since the epoch)."""
    task: str
    """``job:index``."""
    change: str
    """``joined`` (``clusterflow scale`` grew the cluster), ``left`` (it shrank it) or
    ``lost`` (it died above MIN with nothing to replace it: the run went on without it)."""
    spec_version: int
    """The first spec version that holds the change."""
    step: int | None = None
    """The furthest training step any task had reported then."""
    workers: int = 0
    """The cluster's worker tasks after the change."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "task": self.task,
            "change": self.change,
            "spec_version": self.spec_version,
            "step": self.step,
            "workers": self.workers,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MembershipChange:
        return cls(
            time=_number(data.get("time")) or 0.0,
            task=_typed(data, "task", str, "?"),
            change=_typed(data, "change", str, "?"),
            spec_version=_typed(data, "spec_version", int, 0),
            step=_typed(data, "step", int, None),
            workers=_typed(data, "workers", int, 0),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterState:
    """Everything ``state.json`` holds about one cluster."""

    id: str
    status: str = "created"
    """One of ``Status``; a reader may see one it does not know (a newer manager)."""
    created: float | None = None
    """When the manager started (seconds since the epoch)."""
    ended: float | None = None
    backend: str | None = None
    command: tuple[str, ...] = ()
    manager: ManagerProcess | None = None
    spec: dict[str, Any] | None = None
    """The cluster spec as ``ClusterSpec.as_dict`` writes it, once assembled."""
    spec_version: int = 0
    restarts: int = 0
    max_restarts: int = 0
    memory_restarts: int = 0
    """Restarts with more memory after a kill for memory (not in ``restarts``)."""
    standby: StandbyState | None = None
    checkpoint_dir: str | None = None
    tasks: tuple[TaskState, ...] = ()
    workers_range: tuple[int, int] | None = None
    """MIN and MAX of an elastic worker job (``--workers MIN:MAX``); None: a fixed size."""
    membership: tuple[MembershipChange, ...] = ()
    """Who joined and who left while the cluster ran, oldest first."""
    exit_code: int | None = None
    """Set with a final status: what ``clusterflow start`` exits with."""
    summary: str | None = None
    """Set with a final status: why, in one line."""

    def finished(self, *, exit_code: int, summary: str, ended: float) -> ClusterState:
        return replace(self, exit_code=exit_code, summary=summary, ended=ended)

    def task(self, name: str) -> TaskState | None:
        return next((t for t in self.tasks if t.task == name), None)

    def workers(self) -> int:
        """The worker tasks now: the size ``describe`` and the dashboard show."""
        return sum(1 for t in self.tasks if t.task.startswith("worker:"))

    def figures(self) -> tuple[int | None, float | None]:
        """The cluster's live figures, as ``ps`` and the dashboard show them: the
        furthest step any task reported, and the summed samples/s of the tasks not
        exited; once every task exited, of the last rates every task reported, so an ended run
        shows the figures it ended on, not nothing."""
        steps = [t.step for t in self.tasks if t.step is not None]
        running = [t for t in self.tasks if t.exit_code is None]
        rates = [t.samples_per_s for t in running or self.tasks if t.samples_per_s is not None]
        return (max(steps) if steps else None, sum(rates) if rates else None)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "status": self.status,
            "created": self.created,
            "backend": self.backend,
            "command": list(self.command),
            "manager": self.manager.to_dict() if self.manager else None,
            "spec": self.spec,
            "spec_version": self.spec_version,
            "restarts": self.restarts,
            "max_restarts": self.max_restarts,
            "memory_restarts": self.memory_restarts,
            "standby": (
                {
                    "pid": self.standby.pid,
                    "ready": self.standby.ready,
                    "kept": self.standby.kept,
                    "ready_count": self.standby.ready_count,
                }
                if self.standby
                else None
            ),
            "checkpoint_dir": self.checkpoint_dir,
            "tasks": [t.to_dict() for t in self.tasks],
            "workers_range": list(self.workers_range) if self.workers_range else None,
            "membership": [m.to_dict() for m in self.membership],
        }
        for name in ("exit_code", "summary", "ended"):  # only once the run ended
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, cluster_id: str | None = None) -> ClusterState:
        """Reads a state back; ``cluster_id`` stands in for a missing ``id``.

        Raises:
            ConfigError: ``data`` is not a mapping.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a cluster state must be a JSON object, not {type(data).__name__}")
        manager = data.get("manager")
        standby = data.get("standby")
        tasks = data.get("tasks")
        command = data.get("command")
        span = data.get("workers_range")
        membership = data.get("membership")
        return cls(
            id=_typed(data, "id", str, cluster_id or "?"),
            status=_typed(data, "status", str, "created"),
            created=_number(data.get("created")),
            ended=_number(data.get("ended")),
            backend=_typed(data, "backend", str, None),
            command=tuple(str(a) for a in command) if isinstance(command, list) else (),
            manager=ManagerProcess.from_dict(manager) if isinstance(manager, Mapping) else None,
            spec=dict(data["spec"]) if isinstance(data.get("spec"), Mapping) else None,
            spec_version=_typed(data, "spec_version", int, 0),
            restarts=_typed(data, "restarts", int, 0),
            max_restarts=_typed(data, "max_restarts", int, 0),
            memory_restarts=_typed(data, "memory_restarts", int, 0),
            standby=(
                StandbyState(
                    pid=_typed(standby, "pid", int, 0),
                    ready=_typed(standby, "ready", bool, False),
                    kept=_typed(standby, "kept", int, 1),
                    ready_count=_typed(standby, "ready_count", int, 0),
                )
                if isinstance(standby, Mapping)
                else None
            ),
            checkpoint_dir=_typed(data, "checkpoint_dir", str, None),
            tasks=tuple(TaskState.from_dict(t) for t in (tasks or []) if isinstance(t, Mapping))
            if isinstance(tasks, list)
            else (),
            workers_range=(
                (span[0], span[1])
                if isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)
                else None
            ),
            membership=tuple(
                MembershipChange.from_dict(m) for m in membership if isinstance(m, Mapping)
            )
            if isinstance(membership, list)
            else (),
            exit_code=_typed(data, "exit_code", int, None),
            summary=_typed(data, "summary", str, None),
        )


def _typed(data: Mapping[str, Any], key: str, kind: type[Any], default: Any) -> Any:
    value = data.get(key)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    return default


def _numbers(value: Any) -> dict[str, float] | None:
    if not isinstance(value, Mapping):
        return None
    return {str(k): v for k, v in value.items() if _number(v) is not None}


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    return None


__all__ = [
    "FIGURES",
    "PLACEMENT",
    "TERMINAL",
    "ClusterState",
    "ManagerProcess",
    "MembershipChange",
    "StandbyState",
    "Status",
    "TaskState",
]
