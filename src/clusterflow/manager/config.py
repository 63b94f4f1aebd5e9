"""What ``clusterflow start`` asked for: the jobs, the commands and the manager's limits."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from clusterflow.cluster import JOB_ORDER, TaskId
from clusterflow.errors import ConfigError

KNOWN_JOBS = frozenset(JOB_ORDER)
BUILTIN_PS_COMMAND = (sys.executable, "-m", "clusterflow.ps")
REPLICA_JOBS = frozenset({"chief", "worker"})
"""Jobs whose tasks train (ranks of the collective); ``--replicas-per-host`` multiplies them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    command: tuple[str, ...]
    """The job command every chief, worker and evaluator task runs."""
    chief: bool = False
    """Add a ``chief`` task (else worker 0 is the chief)."""
    ps: int = 0
    """Number of parameter-server tasks."""
    workers: int = 1
    """Number of worker tasks."""
    evaluator: bool = False
    """Add an ``evaluator`` task."""
    replicas_per_host: int = 1
    """Processes each chief and worker task runs (one per device of its host)."""
    ps_command: tuple[str, ...] | None = None
    """What ps tasks run; None runs clusterflow's built-in server."""
    untracked: frozenset[str] = frozenset({"ps"})
    """Jobs the run does not wait for; they are stopped once the tracked ones exit 0."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every task."""
    host: str = "127.0.0.1"
    """Interface tasks bind; local clusters stay on loopback."""
    grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL when stopping tasks."""
    register_timeout_s: float = 120.0
    """Every task must register within this many seconds of the start."""
    heartbeat_s: float = 1.0
    """Interval of supervisor heartbeats."""
    heartbeat_timeout_s: float = 30.0
    """A running task silent for this long is treated as dead."""
    max_restarts: int = 0
    """Recoveries (a worker respawned, or every task restarted) before the run fails."""
    checkpoint_dir: str | None = None
    """Where consistent checkpoints go (a path or fsspec URL); None: the cluster's folder."""
    stall_timeout_s: float | None = None
    """A task whose reported step stops advancing this long is dead (hung); None: never."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("no job command given: put it after `--`, e.g. -- python train.py")
        for name in ("command", "ps_command"):
            value = getattr(self, name)
            if value is not None and not all(isinstance(arg, str) for arg in value):
                raise ConfigError(f"{name} must be a list of strings, got {list(value)!r}")
        if self.ps_command is not None and not self.ps_command:
            raise ConfigError("ps_command is empty: leave it out to run the built-in server")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ConfigError(f"env must map names to strings, got {dict(self.env)!r}")
        for name in ("chief", "evaluator"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("ps", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"--{name} must be a non-negative integer, got {value!r}")
        n = self.replicas_per_host
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"--replicas-per-host must be a positive integer, got {n!r}")
        unknown = sorted(self.untracked - KNOWN_JOBS)
        if unknown:
            raise ConfigError(
                f"--untracked names unknown job {unknown[0]!r}; jobs are {', '.join(JOB_ORDER)}"
            )
        if not self.tasks():
            raise ConfigError("the cluster has no task: give --workers N or --chief")
        if not any(t.job not in self.untracked for t in self.tasks()):
            raise ConfigError(
                f"every job is untracked ({', '.join(sorted(self.untracked))}): "
                "the run would have nothing to wait for"
            )
        r = self.max_restarts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"--max-restarts must be a non-negative integer, got {r!r}")
        if self.checkpoint_dir is not None and (
            not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir.strip()
        ):
            raise ConfigError(
                f"--checkpoint-dir must be a path or URL, got {self.checkpoint_dir!r}"
            )
        stall = self.stall_timeout_s
        if stall is not None and (
            isinstance(stall, bool) or not isinstance(stall, int | float) or not stall > 0
        ):
            raise ConfigError(f"--stall-timeout must be a positive number, got {stall!r}")
        for name in ("grace_s", "register_timeout_s", "heartbeat_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")

    def tasks(self) -> list[TaskId]:
        """Every task in canonical order: chief, ps, worker, evaluator."""
        out = [TaskId("chief", 0)] if self.chief else []
        out += [TaskId("ps", i) for i in range(self.ps)]
        out += [TaskId("worker", i) for i in range(self.workers)]
        if self.evaluator:
            out.append(TaskId("evaluator", 0))
        return out

    def replicas_of(self, task: TaskId) -> int:
        """Processes ``task`` runs: ``replicas_per_host`` for chief and workers, else 1."""
        return self.replicas_per_host if task.job in REPLICA_JOBS else 1

    def command_for(self, task: TaskId) -> tuple[str, ...]:
        if task.job == "ps":
            return self.ps_command or BUILTIN_PS_COMMAND
        return self.command

    def is_tracked(self, task: TaskId) -> bool:
        return task.job not in self.untracked

    def describe_command(self) -> str:
        return shlex.join(self.command)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["command"] = list(self.command)
        data["ps_command"] = list(self.ps_command) if self.ps_command else None
        data["untracked"] = sorted(self.untracked)
        data["env"] = dict(self.env)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        values = dict(data)
        values["command"] = _as_tuple(values.get("command") or (), "command")
        if values.get("ps_command") is not None:
            values["ps_command"] = _as_tuple(values["ps_command"], "ps_command")
        if "untracked" in values:
            values["untracked"] = frozenset(_as_tuple(values["untracked"], "untracked"))
        if "env" in values and not isinstance(values["env"], Mapping):
            raise ConfigError(f"env must be a mapping, got {values['env']!r}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"invalid cluster configuration: {exc}") from exc


def _as_tuple(value: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise ConfigError(f"{name} must be a list, got {value!r}")
    return tuple(value)
