"""What ``clusterflow start`` asked for: the jobs, the commands and the manager's limits."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from clusterflow.backends import kinds
from clusterflow.cluster import JOB_ORDER, TaskId
from clusterflow.errors import ConfigError
from clusterflow.manager.job_settings import RAY_ONLY, parse_size
from clusterflow.manager.limits import MAX_PROCESSES, task_processes

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
        "warm_restarts",
        "checkpoint_dir",
        "stall_timeout_s",
        "heartbeat_timeout_s",
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


class Setting(str):
    """A setting's name (a ``RunConfig`` field) inside a ``SettingError``'s message."""

    __slots__ = ()


class SettingError(ConfigError):
    """A bad value of a setting, its message naming the setting as its user wrote it.

    The message is made of parts, the ``Setting`` ones spelled by whoever knows where
    the value came from: ``RunConfig.merge`` spells each as its layer does (``--grace``
    on the command line, ``workers`` in a cluster file, naming the file); raised
    elsewhere, the message names the field (``grace_s``), as a caller of ``RunConfig``
    wrote it.
    """

    def __init__(self, *parts: str) -> None:
        self.parts = parts
        super().__init__(self.spelled(str))

    @property
    def settings(self) -> list[str]:
        return [str(p) for p in self.parts if isinstance(p, Setting)]

    def spelled(self, spell: Callable[[str], str]) -> str:
        return "".join(spell(str(p)) if isinstance(p, Setting) else p for p in self.parts)


@dataclass(frozen=True, slots=True)
class Spelling:
    """How one layer of ``RunConfig.merge`` names its settings to its user."""

    names: Mapping[str, str] = field(default_factory=dict)
    """A setting's name for this layer (``grace_s`` -> ``--grace``); others as they are."""
    where: str = ""
    """Where the layer's values were written (``cluster file 'c.yaml'``), if not obvious."""

    def __call__(self, setting: str) -> str:
        return self.names.get(setting, setting)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    command: tuple[str, ...]
    """The job command every chief, worker and evaluator task runs."""
    chief: bool = False
    """Add a ``chief`` task (else worker 0 is the chief)."""
    ps: int = 0
    """Number of parameter-server tasks."""
    workers: int = 1
    """Number of worker tasks; with ``workers_max``, the least (MIN), and the number a
    cluster starts with (the local backend starts MIN: every task shares this machine,
    so "what fits" is what the user asked for at least)."""
    workers_max: int | None = None
    """The most worker tasks ``clusterflow scale`` may grow the cluster to (MAX of
    ``--workers MIN:MAX``); None: a fixed size, ``workers``."""
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
    warm_restarts: bool = False
    """Keep a warm standby per task while restarts remain (from the spec's assembly on),
    and the next attempt's store up already, so a whole restart starts no Python and
    imports no torch: an idle process per task (torch imported) bought for a restart
    about as quick as a respawn (docs/benchmarks.md, "Recovery by phase"). Where Ray
    places the tasks it keeps none: Ray places each restart anew."""
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
                raise SettingError(
                    Setting(name), f" must be a list of strings, got {list(value)!r}"
                )
        if self.ps_command is not None and not self.ps_command:
            raise SettingError(
                Setting("ps_command"), " is empty: leave it out to run the built-in server"
            )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise SettingError(
                Setting("env"), f" must map names to strings, got {dict(self.env)!r}"
            )
        for name in ("chief", "evaluator"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(
                    Setting(name), f" must be true or false, got {getattr(self, name)!r}"
                )
        for name in ("ps", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SettingError(Setting(name), f" must be a non-negative integer, got {value!r}")
        n = self.replicas_per_host
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SettingError(
                Setting("replicas_per_host"), f" must be a positive integer, got {n!r}"
            )
        check_worker_range(self)
        processes = task_processes(self.ps, self.most_workers, n)
        if processes > MAX_PROCESSES:
            raise SettingError(
                Setting("ps"),
                f" {self.ps}, ",
                Setting("workers"),
                f" {self.most_workers} and ",
                Setting("replicas_per_host"),
                f" {n} ask for {processes} task processes; at most {MAX_PROCESSES} are allowed",
            )
        unknown = sorted(self.untracked - KNOWN_JOBS)
        if unknown:
            raise SettingError(
                Setting("untracked"),
                f" names unknown job {unknown[0]!r}; jobs are {', '.join(JOB_ORDER)}",
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
            raise SettingError(
                Setting("max_restarts"), f" must be a non-negative integer, got {r!r}"
            )
        if not isinstance(self.warm_restarts, bool):
            raise SettingError(
                Setting("warm_restarts"), f" must be true or false, got {self.warm_restarts!r}"
            )
        if self.checkpoint_dir is not None and (
            not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir.strip()
        ):
            raise SettingError(
                Setting("checkpoint_dir"), f" must be a path or URL, got {self.checkpoint_dir!r}"
            )
        stall = self.stall_timeout_s
        if stall is not None and (
            isinstance(stall, bool) or not isinstance(stall, int | float) or not stall > 0
        ):
            raise SettingError(
                Setting("stall_timeout_s"), f" must be a positive number, got {stall!r}"
            )
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
                raise SettingError(Setting(name), f" must be a positive number, got {value!r}")

    def tasks(self) -> list[TaskId]:
        """Every task in canonical order: chief, ps, worker, evaluator."""
        out = [TaskId("chief", 0)] if self.chief else []
        out += [TaskId("ps", i) for i in range(self.ps)]
        out += [TaskId("worker", i) for i in range(self.workers)]
        if self.evaluator:
            out.append(TaskId("evaluator", 0))
        return out

    @property
    def elastic(self) -> bool:
        """Whether the worker job may be resized while the cluster runs (``MIN:MAX``)."""
        return self.workers_max is not None

    @property
    def most_workers(self) -> int:
        """MAX of an elastic cluster; a fixed one's ``workers``."""
        return self.workers if self.workers_max is None else self.workers_max

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
    def merge(cls, *layers: Mapping[str, Any], spellings: Sequence[Spelling] = ()) -> RunConfig:
        """One config from layers of settings, each later one winning where it sets a key.

        ``clusterflow start`` passes, in order: the settings of a resumed cluster, a
        cluster file, the command line's flags (only those given). Values may be in a
        file's form: a command as a string or a list, ``untracked`` as a comma-separated
        string or a list, ``env`` as any mapping (its values made strings), ``memory``
        in ``resources`` as a size such as ``4G``.

        ``spellings`` says, layer by layer, how a message names a setting: as the user
        wrote it (``--grace`` on the command line, the key ``workers`` of a cluster file,
        and which file); a layer without one names the field (``grace_s``).

        Raises:
            ConfigError: a value of the wrong form, an unknown key, or a config that
                does not validate; the message names the setting as its layer does.
        """
        spells = [*spellings, *[Spelling()] * (len(layers) - len(spellings))]
        settings: dict[str, Any] = {}
        for layer, spelling in zip(layers, spells, strict=True):
            try:
                settings.update(_file_form(layer))
            except SettingError as exc:
                raise ConfigError(_spelled(exc, [layer], [spelling])) from exc
        settings.setdefault("command", ())  # so the config says what is missing, and how
        try:
            return cls(**settings)
        except SettingError as exc:
            raise ConfigError(_spelled(exc, layers, spells)) from exc
        except TypeError as exc:
            raise ConfigError(f"invalid cluster configuration: {exc}") from exc


def _spelled(
    exc: SettingError, layers: Sequence[Mapping[str, Any]], spellings: Sequence[Spelling]
) -> str:
    """``exc``'s message with each setting named as the last layer that set it names it
    (a setting no layer set: as the layer of the first one that was set), after where
    those layers were written."""

    def layer_of(setting: str) -> int | None:
        found = [i for i, layer in enumerate(layers) if setting in layer]
        return found[-1] if found else None

    chosen = {s: layer_of(s) for s in exc.settings}
    fallback = next((i for i in chosen.values() if i is not None), None)
    used = {s: i if i is not None else fallback for s, i in chosen.items()}

    def spell(setting: str) -> str:
        i = used.get(setting)
        return spellings[i](setting) if i is not None else setting

    wheres = [spellings[i].where for i in sorted({i for i in used.values() if i is not None})]
    prefix = "; ".join(w for w in dict.fromkeys(wheres) if w)
    message = exc.spelled(spell)
    return f"{prefix}: {message}" if prefix else message


def _file_form(layer: Mapping[str, Any]) -> dict[str, Any]:
    """A layer's settings with the forms a file allows turned into ``RunConfig``'s."""
    settings = dict(layer)
    for name in ("command", "ps_command"):
        if settings.get(name) is not None:
            settings[name] = _as_command(settings[name], name)
    if "workers" in settings:
        low, high = parse_workers(settings["workers"])
        settings["workers"] = low
        if high is not None or "workers_max" not in settings:
            # a later layer's fixed --workers N replaces an earlier layer's range
            settings["workers_max"] = high
    untracked = settings.get("untracked")
    if isinstance(untracked, str):
        untracked = untracked.split(",")
    if untracked is not None:
        if not isinstance(untracked, list | tuple | set | frozenset):
            raise SettingError(
                Setting("untracked"),
                f" must be a list or a comma-separated string, got {untracked!r}",
            )
        settings["untracked"] = frozenset(str(j).strip() for j in untracked if str(j).strip())
    if "env" in settings:
        if not isinstance(settings["env"], Mapping):
            raise SettingError(Setting("env"), f" must be a mapping, got {settings['env']!r}")
        settings["env"] = {str(k): str(v) for k, v in settings["env"].items()}
    if "resources" in settings:
        settings["resources"] = resources_from_file(settings["resources"])
    return settings


def parse_workers(value: Any) -> tuple[Any, Any]:
    """``workers`` as (MIN, MAX): ``N`` is ``(N, None)`` (a fixed size), ``"MIN:MAX"`` and
    a file's ``{min: MIN, max: MAX}`` a range. What is not one of these forms is left
    for ``RunConfig`` to judge (``two`` is not a non-negative integer); the range's
    numbers are checked there too (``check_worker_range``)."""
    if isinstance(value, str) and ":" in value:
        low, _, high = (part.strip() for part in value.partition(":"))
        try:
            return int(low), int(high)
        except ValueError:
            raise SettingError(
                Setting("workers"), f" must be N or MIN:MAX with whole numbers, got {value!r}"
            ) from None
    if isinstance(value, Mapping):
        if set(value) != {"min", "max"}:
            raise SettingError(
                Setting("workers"),
                f" as a range must be {{min: MIN, max: MAX}}, got {dict(value)!r}",
            )
        return value["min"], value["max"]
    return value, None


def check_worker_range(config: RunConfig) -> None:
    """An elastic worker job: 1 <= MIN <= MAX, on a backend that resizes (``kinds``;
    ``workers`` itself was checked as a non-negative integer before)."""
    low, high = config.workers, config.workers_max
    if high is None:
        return
    setting = Setting("workers")
    if isinstance(high, bool) or not isinstance(high, int):
        raise SettingError(setting, f" MAX must be a whole number, got {high!r}")
    if low < 1:
        raise SettingError(setting, f" {low}:{high}: MIN must be at least 1")
    if high < low:
        raise SettingError(setting, f" {low}:{high}: MAX must be at least MIN")
    kind = kinds.find(config.backend)
    if kind is None or not kind.resizable:
        raise SettingError(
            setting,
            f" {low}:{high}: a range needs ",
            Setting("backend"),
            f" {' or '.join(n for n, k in kinds.KINDS.items() if k.public and k.resizable)}",
        )


def _as_command(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SettingError(Setting(what), f" must be a string or a list of strings, got {value!r}")


def check_placement(config: RunConfig) -> None:
    """Validates the backend (one of ``backends/kinds.py``'s; messages offer the public
    ones) and the per-job placement settings (resources, labels)."""
    backend = Setting("backend")
    kind = kinds.find(config.backend)
    if kind is None:
        raise SettingError(backend, f" must be {' or '.join(kinds.PUBLIC)}, got {config.backend!r}")
    if not kind.placed_by_ray:
        for name in RAY_ONLY:
            if getattr(config, name):
                raise SettingError(
                    Setting(name), " needs ", backend, " ray (local tasks share this machine)"
                )
    for what in ("resources", "labels"):
        per_job = getattr(config, what)
        setting = Setting(what)
        if not isinstance(per_job, Mapping):
            raise SettingError(setting, f" must map job names to settings, got {per_job!r}")
        for job, values in per_job.items():
            if job not in KNOWN_JOBS:
                raise SettingError(
                    setting, f" names unknown job {job!r}; jobs are {', '.join(JOB_ORDER)}"
                )
            if not isinstance(values, Mapping) or not values:
                raise SettingError(
                    setting, f" of job {job} must be NAME=VALUE pairs, got {values!r}"
                )
            for key, value in values.items():
                if not isinstance(key, str) or not key:
                    raise SettingError(setting, f" of job {job}: bad name {key!r}")
                if what == "labels" and not isinstance(value, str):
                    raise SettingError(
                        setting, f" of job {job}: label {key} must be a string, got {value!r}"
                    )
                if what == "resources" and (
                    isinstance(value, bool) or not isinstance(value, int | float) or value < 0
                ):
                    raise SettingError(
                        setting,
                        f" of job {job}: {key} must be a non-negative number, got {value!r}",
                    )
    memory = config.memory
    if memory is not None and memory != "auto":
        try:
            sized = isinstance(memory, str) and parse_size(memory, "memory") >= 0
        except ConfigError:
            sized = False
        if not sized:
            raise SettingError(
                Setting("memory"), f" must be auto or a size such as 4G, got {memory!r}"
            )
    if config.job_dir is not None and (
        not isinstance(config.job_dir, str) or not config.job_dir.strip()
    ):
        raise SettingError(
            Setting("job_dir"), f" must be a folder or a .zip, got {config.job_dir!r}"
        )


def _as_tuple(value: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise ConfigError(f"{name} must be a list, got {value!r}")
    return tuple(value)


def resources_from_file(value: Any) -> dict[str, dict[str, Any]]:
    """A cluster file's ``resources`` (``{job: {name: value}}``), sizes such as ``4G``
    allowed for ``memory``; anything else is left for ``RunConfig`` to judge."""
    if not isinstance(value, Mapping):
        return value  # type: ignore[no-any-return]
    out: dict[str, dict[str, Any]] = {}
    for job, settings in value.items():
        if not isinstance(settings, Mapping):
            return dict(value)
        try:
            out[job] = {
                k: parse_size(v, "memory") if k == "memory" and isinstance(v, str) else v
                for k, v in settings.items()
            }
        except ConfigError:
            raise SettingError(
                Setting("resources"),
                f" of job {job}: memory {settings['memory']!r} is not a size such as 4G",
            ) from None
    return out
