"""What ``clusterflow start`` asked for: the jobs, the commands and the manager's limits."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from clusterflow.cluster import JOB_ORDER, TaskId
from clusterflow.errors import ConfigError
from clusterflow.manager.limits import check_task_count

KNOWN_JOBS = frozenset(JOB_ORDER)
BUILTIN_PS_COMMAND = (sys.executable, "-m", "clusterflow.ps")
FILE_KEYS = frozenset(
    {
        "chief",
        "ps",
        "workers",
        "evaluator",
        "replicas_per_host",
        "command",
        "ps_command",
        "untracked",
        "env",
        "max_restarts",
        "checkpoint_dir",
        "stall_timeout_s",
        "evaluator_grace_s",
        "backend",
        "address",
        "resources",
        "labels",
        "job_dir",
        "memory",
        "placement_timeout_s",
        "cache",
    }
)
"""What a cluster file (``clusterflow start -c``) may set: the run's shape, commands,
recovery and placement; not the manager's own limits (host, heartbeats, timeouts)."""
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
    evaluator_grace_s: float = 60.0
    """How long the run waits for the evaluator once every other tracked task exited 0,
    before it stops it: time for the last evaluation of the final checkpoint, while a
    slow or hung evaluator can never keep a finished run from ending."""
    backend: str = "local"
    """Where tasks run: ``local`` processes, or actors on a ``ray`` cluster."""
    address: str | None = None
    """The Ray cluster's ``HOST:PORT`` (``ray`` backend); None: ``RAY_ADDRESS`` or a local one."""
    resources: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Per job, what each of its tasks needs on Ray: ``CPU``, ``GPU``, ``memory`` (bytes),
    custom resources. A job left out asks for one CPU."""
    labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Per job, the node labels its tasks' nodes must carry (Ray label selectors)."""
    job_dir: str | None = None
    """A folder or .zip shipped to every node (Ray's runtime environment); jobs run in it."""
    memory: str | None = None
    """Memory each task asks for on Ray, where ``resources`` names none: ``auto`` (sized
    from the measured peak of earlier runs of the same command and job) or a size such
    as ``4G``; None is ``auto`` on Ray."""
    memory_key: str | None = None
    """What measured memory peaks are kept by, with the job (``manager/memory_sizing.py``);
    None: the command. ``clusterflow tune`` gives its study's command before ``{name}``
    is filled in, so every trial is sized by the earlier trials' peaks."""
    placement_timeout_s: float = 60.0
    """How long a Ray cluster may take to place the whole cluster before the start fails."""
    cache: str | None = None
    """An in-memory cache (``clusterflow cache``) the workers read: they are placed on its
    partitions' nodes and ``cache://`` names it (``cli/cache.py`` ``cache_placement``)."""

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
        check_task_count(self.ps, self.workers, n)
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
        check_placement(self)
        for name in (
            "grace_s",
            "register_timeout_s",
            "heartbeat_s",
            "heartbeat_timeout_s",
            "placement_timeout_s",
            "evaluator_grace_s",
        ):
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

    def gpu_hosts(self) -> list[tuple[TaskId, int]]:
        """The tasks that stand for a host of devices (``--replicas-per-host N``, N >= 2),
        each with N: on the local backend each gets N GPUs of its own
        (``LocalBackend.split_gpus``); a lone-process task sees every GPU, as before."""
        return [(t, self.replicas_of(t)) for t in self.tasks() if self.replicas_of(t) > 1]

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
        data["resources"] = {job: dict(r) for job, r in self.resources.items()}
        data["labels"] = {job: dict(r) for job, r in self.labels.items()}
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

    @classmethod
    def merge(cls, *layers: Mapping[str, Any]) -> RunConfig:
        """One config from layers of settings, each later one winning where it sets a key.

        ``clusterflow start`` passes, in order: the settings of a resumed cluster, a
        cluster file, the command line's flags (only those given). Values may be in a
        file's form: a command as a string or a list, ``untracked`` as a comma-separated
        string or a list, ``env`` as any mapping (its values made strings), ``memory``
        in ``resources`` as a size such as ``4G``.

        Raises:
            ConfigError: a value of the wrong form, an unknown key, or a config that
                does not validate; the message names the setting.
        """
        settings: dict[str, Any] = {}
        for layer in layers:
            settings.update(_file_form(layer))
        settings.setdefault("command", ())  # so the config says what is missing, and how
        try:
            return cls(**settings)
        except TypeError as exc:
            raise ConfigError(f"invalid cluster configuration: {exc}") from exc


def _file_form(layer: Mapping[str, Any]) -> dict[str, Any]:
    """A layer's settings with the forms a file allows turned into ``RunConfig``'s."""
    settings = dict(layer)
    for name in ("command", "ps_command"):
        if settings.get(name) is not None:
            settings[name] = _as_command(settings[name], name)
    untracked = settings.get("untracked")
    if isinstance(untracked, str):
        untracked = untracked.split(",")
    if untracked is not None:
        if not isinstance(untracked, list | tuple | set | frozenset):
            raise ConfigError(
                f"untracked must be a list or a comma-separated string, got {untracked!r}"
            )
        settings["untracked"] = frozenset(str(j).strip() for j in untracked if str(j).strip())
    if "env" in settings:
        if not isinstance(settings["env"], Mapping):
            raise ConfigError(f"env must be a mapping, got {settings['env']!r}")
        settings["env"] = {str(k): str(v) for k, v in settings["env"].items()}
    if "resources" in settings:
        settings["resources"] = resources_from_file(settings["resources"])
    return settings


def _as_command(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{what} must be a string or a list of strings, got {value!r}")


BACKENDS = ("local", "ray", "hosts")
"""``hosts``: local tasks, each inside an emulated host (``clusterflow.testing``, tests)."""
RAY_ONLY = {
    "address": "--address",
    "resources": "--resources",
    "labels": "--label",
    "job_dir": "--job-dir",
    "memory": "--memory",
}
"""Settings that mean something only where tasks are placed on many machines."""


def check_placement(config: RunConfig) -> None:
    """Validates the backend and the per-job placement settings (resources, labels)."""
    if config.backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {config.backend!r}")
    if config.backend != "ray":
        for name, flag in RAY_ONLY.items():
            if getattr(config, name):
                raise ConfigError(f"{flag} needs --backend ray (local tasks share this machine)")
    for what in ("resources", "labels"):
        per_job = getattr(config, what)
        if not isinstance(per_job, Mapping):
            raise ConfigError(f"{what} must map job names to settings, got {per_job!r}")
        for job, values in per_job.items():
            if job not in KNOWN_JOBS:
                raise ConfigError(
                    f"{RAY_ONLY[what]} names unknown job {job!r}; jobs are {', '.join(JOB_ORDER)}"
                )
            if not isinstance(values, Mapping) or not values:
                raise ConfigError(f"{what} of job {job} must be NAME=VALUE pairs, got {values!r}")
            for key, value in values.items():
                if not isinstance(key, str) or not key:
                    raise ConfigError(f"{what} of job {job}: bad name {key!r}")
                if what == "labels" and not isinstance(value, str):
                    raise ConfigError(f"label {key} of job {job} must be a string, got {value!r}")
                if what == "resources" and (
                    isinstance(value, bool) or not isinstance(value, int | float) or value < 0
                ):
                    raise ConfigError(
                        f"resource {key} of job {job} must be a non-negative number, got {value!r}"
                    )
    if config.memory is not None and config.memory != "auto":
        if not isinstance(config.memory, str):
            raise ConfigError(f"--memory must be auto or a size such as 4G, got {config.memory!r}")
        parse_size(config.memory, "--memory")
    if config.job_dir is not None and (
        not isinstance(config.job_dir, str) or not config.job_dir.strip()
    ):
        raise ConfigError(f"--job-dir must be a folder or a .zip, got {config.job_dir!r}")


def _as_tuple(value: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise ConfigError(f"{name} must be a list, got {value!r}")
    return tuple(value)


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str, what: str) -> int:
    """``4G``, ``512M``, ``2GiB`` or plain bytes, as bytes (binary units, as Ray's)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in _SIZE_UNITS and raw[-1:].isalpha() else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{what}: {text!r} is not a size such as 4G, 512M or 1073741824")
    return int(value * _SIZE_UNITS[unit])


def parse_job_settings(items: Sequence[str], what: str) -> dict[str, dict[str, Any]]:
    """``["worker:GPU=1,CPU=8", "ps:CPU=2"]`` as ``{job: {name: value}}``.

    ``what`` is ``resources`` (numbers; ``memory`` may be a size such as ``4G``) or
    ``labels`` (strings).
    """
    out: dict[str, dict[str, Any]] = {}
    flag = RAY_ONLY[what]
    for item in items:
        job, sep, pairs = item.partition(":")
        if not sep or not job or not pairs:
            raise ConfigError(f"{flag} {item!r}: expected JOB:NAME=VALUE[,NAME=VALUE...]")
        settings = out.setdefault(job.strip(), {})
        for pair in _split_pairs(pairs):
            name, eq, value = (part.strip() for part in pair.partition("="))
            if not eq or not name or not value:
                raise ConfigError(f"{flag} {item!r}: {pair!r} is not NAME=VALUE")
            settings[name] = _resource_value(name, value, item) if what == "resources" else value
    return out


def _split_pairs(pairs: str) -> list[str]:
    """``a=1,b=in(x,y)`` as ``["a=1", "b=in(x,y)"]``: a comma inside parentheses (a label
    selector's ``in(...)``) does not end a pair."""
    out, depth, start = [], 0, 0
    for i, char in enumerate(pairs):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth <= 0:
            out.append(pairs[start:i])
            start = i + 1
    out.append(pairs[start:])
    return out


def _resource_value(name: str, value: str, item: str) -> float:
    if name == "memory":
        return float(parse_size(value, f"--resources {item!r}"))
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"--resources {item!r}: {name}={value!r} is not a number") from None


def resources_from_file(value: Any) -> dict[str, dict[str, Any]]:
    """A cluster file's ``resources`` (``{job: {name: value}}``), sizes such as ``4G``
    allowed for ``memory``; anything else is left for ``RunConfig`` to judge."""
    if not isinstance(value, Mapping):
        return value  # type: ignore[no-any-return]
    out: dict[str, dict[str, Any]] = {}
    for job, settings in value.items():
        if not isinstance(settings, Mapping):
            return dict(value)
        out[job] = {
            k: parse_size(v, f"resources of job {job}")
            if k == "memory" and isinstance(v, str)
            else v
            for k, v in settings.items()
        }
    return out
