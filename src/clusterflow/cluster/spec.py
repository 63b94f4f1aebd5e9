"""The cluster spec: which tasks exist, grouped into jobs, and where each one listens.

This is TensorFlow's ``tf.train.ClusterSpec`` as a pure value. A spec is built once
(from a ``TF_CONFIG``, a spec file, or the manager's registry) and then only read, so it
validates everything when built: a bad address fails here, at the edge, rather than as a
connection timeout on another machine minutes later.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from clusterflow.cluster.errors import ClusterSpecError

__all__ = [
    "JOB_NAME_RE",
    "JOB_ORDER",
    "ClusterSpec",
    "ClusterSpecLike",
    "TaskId",
    "format_address",
    "parse_address",
]

JOB_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A job name: what TensorFlow accepts in ``/job:<name>`` device strings."""

JOB_ORDER: Final = ("chief", "ps", "worker", "evaluator")
"""Canonical order of the well-known jobs; any other job follows them alphabetically.

The coordinator comes first, then the tasks others depend on (ps hold the variables),
then the workers, then the evaluator that never blocks training. Launch order, listings
and ``TaskId`` sorting all follow it, so every view of a cluster reads the same way.
"""

# TensorFlow requires exactly one chief, and its evaluator is a single side task.
_SINGLE_TASK_JOBS: Final = ("chief", "evaluator")

_TASK_ID_RE: Final = re.compile(
    r"(?:/job:(?P<djob>[^/:]*)(?:/replica:[0-9]+)?/task:(?P<dindex>[^/:]*))"
    r"|(?:(?P<job>[^/:]*):(?P<index>[^/:]*))"
)
# Bounded lengths: int() of a longer digit string is refused by Python itself (or costs
# quadratic time below its limit), and no port or task index needs more digits.
_DIGITS_RE: Final = re.compile(r"[0-9]{1,10}")
_CANONICAL_INT_RE: Final = re.compile(r"0|[1-9][0-9]{0,9}")
MAX_TASK_INDEX: Final = 2**31 - 1
"""TensorFlow's ClusterDef keys task indices as int32; a larger one is a mistake."""
MAX_TASKS: Final = 10_000
"""More tasks than any cluster spec describes; a hostile file is refused before it costs."""
_HOST_RE: Final = re.compile(r"[A-Za-z0-9._-]+")
_MAX_PORT: Final = 65535

JobTasks: TypeAlias = "Sequence[str] | Mapping[int, str] | Mapping[str, str]"
ClusterSpecLike: TypeAlias = "ClusterSpec | Mapping[str, JobTasks]"
"""What :class:`ClusterSpec` is built from: a spec, or ``{job: [address, ...]}`` /
``{job: {index: address}}`` (string indices such as ``"1"`` are read as integers, since
a sparse job that went through JSON has string keys)."""


def _check_job_name(job: object) -> str:
    if not isinstance(job, str) or not JOB_NAME_RE.fullmatch(job):
        raise ClusterSpecError(
            f"invalid job name {job!r}: a job name must match {JOB_NAME_RE.pattern}"
        )
    return job


def _check_index(index: object, job: str) -> int:
    # bool is an int subclass; True as a task index is always a mistake.
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_TASK_INDEX:
        raise ClusterSpecError(
            f"invalid task index {index!r:.40} in job {job!r}: "
            f"an index is an integer in 0..{MAX_TASK_INDEX}"
        )
    return index


def _job_rank(job: str) -> tuple[int, str]:
    if job in JOB_ORDER:
        return (JOB_ORDER.index(job), "")
    return (len(JOB_ORDER), job)


@functools.total_ordering
@dataclass(frozen=True, slots=True)
class TaskId:
    """One task of a cluster: task ``index`` of job ``job``.

    Sorting follows :data:`JOB_ORDER` (chief, ps, worker, evaluator, then other jobs
    alphabetically), then the index, so ``sorted(tasks)`` matches ``ClusterSpec.tasks()``.
    """

    job: str
    """The job's name, e.g. ``"worker"``."""
    index: int
    """The task's index within its job, from 0."""

    def __post_init__(self) -> None:
        _check_job_name(self.job)
        _check_index(self.index, self.job)

    def __str__(self) -> str:
        return f"{self.job}:{self.index}"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, TaskId):
            return NotImplemented
        return (_job_rank(self.job), self.index) < (_job_rank(other.job), other.index)

    @classmethod
    def parse(cls, text: str) -> TaskId:
        """Reads ``"worker:1"`` or TensorFlow's ``"/job:worker/task:1"``.

        The TensorFlow form may carry ``/replica:N`` (TF1 device names do); it is ignored,
        since a task is named by its job and index alone.

        Raises:
            ClusterSpecError: ``text`` is neither form, or names a bad job or index.
        """
        match = _TASK_ID_RE.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ClusterSpecError(
                f"invalid task id {text!r}: expected 'job:index' or '/job:<job>/task:<index>'"
            )
        job = match["djob"] if match["djob"] is not None else match["job"]
        index = match["dindex"] if match["dindex"] is not None else match["index"]
        if not _DIGITS_RE.fullmatch(index):
            raise ClusterSpecError(f"invalid task id {text!r}: index {index!r} is not an integer")
        try:
            return cls(job, int(index))
        except ClusterSpecError as err:
            raise ClusterSpecError(f"invalid task id {text!r}: {err}") from None


def parse_address(address: str) -> tuple[str, int]:
    """Splits ``"host:port"`` (or ``"[ipv6]:port"``) into host and port.

    The host comes back without brackets, ready for ``socket.connect``. Port 0 is
    refused: a spec holds addresses that peers dial, and nobody can dial port 0.

    Raises:
        ClusterSpecError: the address is not ``host:port`` with a port in 1..65535.
    """
    if not isinstance(address, str):
        raise ClusterSpecError(f"address {address!r} is not a string of the form host:port")
    if address.startswith("["):
        host, bracket, port_text = address[1:].partition("]:")
        if not bracket:
            raise ClusterSpecError(f"invalid address {address!r}: expected '[ipv6]:port'")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ClusterSpecError(
                f"invalid address {address!r}: {host!r} in brackets is not an IPv6 address"
            ) from None
    else:
        host, colon, port_text = address.rpartition(":")
        if not colon:
            raise ClusterSpecError(f"invalid address {address!r}: expected 'host:port'")
        if ":" in host:
            raise ClusterSpecError(
                f"invalid address {address!r}: write an IPv6 host in brackets, '[{host}]:port'"
            )
        if not _HOST_RE.fullmatch(host):
            raise ClusterSpecError(
                f"invalid address {address!r}: host {host!r} is empty or has characters "
                "outside letters, digits, '.', '-' and '_'"
            )
    if not _DIGITS_RE.fullmatch(port_text) or not 1 <= int(port_text) <= _MAX_PORT:
        raise ClusterSpecError(
            f"invalid address {address!r:.80}: port {port_text!r:.20} is not an integer "
            f"in 1..{_MAX_PORT}"
        )
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    """Joins a host and port into an address that :func:`parse_address` reads back.

    An IPv6 host gets the brackets it needs; one already in brackets is kept as is.

    Raises:
        ClusterSpecError: the result would not be a valid address.
    """
    if isinstance(port, bool) or not isinstance(port, int):
        raise ClusterSpecError(f"port {port!r} for host {host!r} is not an integer")
    if isinstance(host, str) and ":" in host and not host.startswith("["):
        host = f"[{host}]"
    address = f"{host}:{port}"
    parse_address(address)
    return address


def _address_key(address: str) -> tuple[str, int]:
    # Two spellings of one endpoint ("[::1]" and "[0::1]", "Host" and "host") would
    # still collide on bind, so compare normalised forms.
    host, port = parse_address(address)
    if address.startswith("["):
        host = ipaddress.IPv6Address(host).compressed
    return host.lower(), port


def _coerce_index(key: object, job: str) -> int:
    # JSON object keys are strings, so a sparse job read from TF_CONFIG arrives as
    # {"1": addr}; TensorFlow converts with int(), we accept only the canonical spelling.
    if isinstance(key, str) and _CANONICAL_INT_RE.fullmatch(key):
        return int(key)
    return _check_index(key, job)


def _normalise_job(job: str, tasks: object) -> dict[int, str]:
    if isinstance(tasks, Mapping):
        items = [(_coerce_index(key, job), address) for key, address in tasks.items()]
    elif isinstance(tasks, Sequence) and not isinstance(tasks, str | bytes):
        items = list(enumerate(tasks))
    else:
        raise ClusterSpecError(
            f"job {job!r} must map to a list of addresses or a dict of index to address, "
            f"got {tasks!r}"
        )
    result: dict[int, str] = {}
    for index, address in sorted(items, key=lambda item: item[0]):
        if index in result:
            raise ClusterSpecError(f"job {job!r} lists task index {index} twice")
        try:
            parse_address(address)
        except ClusterSpecError as err:
            raise ClusterSpecError(f"task {job}:{index}: {err}") from None
        result[index] = address
    # A job with no tasks is kept, as TensorFlow keeps it: a launcher may write every
    # job it knows into TF_CONFIG, e.g. {"worker": []} before any worker exists.
    if job in _SINGLE_TASK_JOBS and result and list(result) != [0]:
        raise ClusterSpecError(
            f"job {job!r} must have exactly one task, with index 0; got {result!r}"
        )
    return result


def _check_task_count(cluster: Mapping[Any, Any]) -> None:
    count = sum(len(tasks) for tasks in cluster.values() if isinstance(tasks, Sized))
    if count > MAX_TASKS:
        raise ClusterSpecError(f"a cluster spec of {count} tasks; at most {MAX_TASKS} are allowed")


def _check_unique_addresses(jobs: Mapping[str, Mapping[int, str]]) -> None:
    seen: dict[tuple[str, int], TaskId] = {}
    for job, tasks in jobs.items():
        for index, address in tasks.items():
            task = TaskId(job, index)
            other = seen.setdefault(_address_key(address), task)
            if other is not task:
                raise ClusterSpecError(
                    f"address {address!r} of task {task} is also used by task {other}"
                )


class ClusterSpec:
    """An immutable map of jobs to task addresses, with ``tf.train.ClusterSpec``'s methods.

    Jobs may be dense (``{"worker": ["h:1", "h:2"]}``) or sparse
    (``{"worker": {1: "h:2"}}``), as in TensorFlow; a sparse job is one whose indices are
    not exactly ``0..n-1``. Unknown jobs and indices raise :class:`ClusterSpecError`,
    a ``ValueError`` like TensorFlow's.

    Raises:
        ClusterSpecError: on construction, for a bad job name, index or address, more
            than one chief or evaluator, or one address used twice. A job with no tasks
            is accepted, as TensorFlow accepts it.
    """

    __slots__ = ("_jobs", "_key")

    _jobs: dict[str, dict[int, str]]
    _key: tuple[tuple[str, tuple[tuple[int, str], ...]], ...]

    def __init__(self, cluster: ClusterSpecLike) -> None:
        if isinstance(cluster, ClusterSpec):
            jobs = {job: dict(tasks) for job, tasks in cluster._jobs.items()}
        elif isinstance(cluster, Mapping):
            jobs = {}
            _check_task_count(cluster)
            for job, tasks in cluster.items():
                jobs[_check_job_name(job)] = _normalise_job(job, tasks)
            _check_unique_addresses(jobs)
        else:
            raise ClusterSpecError(
                f"a cluster spec is built from a mapping of job name to addresses, got {cluster!r}"
            )
        self._jobs = dict(sorted(jobs.items()))
        self._key = tuple((job, tuple(tasks.items())) for job, tasks in self._jobs.items())

    def _tasks_of(self, job: str) -> dict[int, str]:
        try:
            return self._jobs[job]
        except (KeyError, TypeError):
            have = ", ".join(self._jobs) or "(none)"
            raise ClusterSpecError(f"unknown job {job!r}; the cluster has jobs: {have}") from None

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted alphabetically (the order of TensorFlow's ClusterDef)."""
        return list(self._jobs)

    def num_tasks(self, job: str) -> int:
        """The number of tasks in ``job`` (for a sparse job: the tasks it has)."""
        return len(self._tasks_of(job))

    def task_indices(self, job: str) -> list[int]:
        """The indices of ``job``'s tasks, ascending."""
        return list(self._tasks_of(job))

    def task_address(self, job: str, index: int) -> str:
        """The address of task ``index`` of ``job``."""
        tasks = self._tasks_of(job)
        if isinstance(index, bool) or index not in tasks:
            have = ", ".join(map(str, tasks))
            raise ClusterSpecError(f"no task {index!r} in job {job!r}; it has tasks: {have}")
        return tasks[index]

    def job_tasks(self, job: str) -> list[str | None]:
        """``job``'s addresses by index, with ``None`` in the holes of a sparse job.

        This is TensorFlow's ``job_tasks``: the list has ``max(index) + 1`` entries.
        """
        tasks = self._tasks_of(job)
        result: list[str | None] = [None] * (max(tasks, default=-1) + 1)
        for index, address in tasks.items():
            result[index] = address
        return result

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """The spec as TensorFlow's ``as_dict`` gives it: lists for dense jobs, dicts else.

        Feeding the result back to :class:`ClusterSpec` gives an equal spec.
        """
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            dense = max(tasks, default=-1) + 1 == len(tasks)
            result[job] = list(tasks.values()) if dense else dict(tasks)
        return result

    def tasks(self) -> Iterator[TaskId]:
        """Every task, in canonical order: by :data:`JOB_ORDER`, then by index."""
        for job in sorted(self._jobs, key=_job_rank):
            for index in self._jobs[job]:
                yield TaskId(job, index)

    @property
    def chief(self) -> TaskId | None:
        """The coordinating task: ``chief:0`` if there is a chief job, else ``worker:0``.

        ``None`` when neither exists (a ps-only spec, or a sparse worker job without 0),
        so callers must decide who coordinates rather than silently picking a task.
        """
        for task in (TaskId("chief", 0), TaskId("worker", 0)):
            if task in self:
                return task
        return None

    def is_chief(self, task: TaskId) -> bool:
        """Whether ``task`` is this cluster's :attr:`chief`."""
        return task == self.chief

    def with_address(self, task: TaskId, address: str) -> ClusterSpec:
        """A new spec in which ``task`` listens at ``address``; this one is unchanged.

        Used when a replacement task comes back on a new port.

        Raises:
            ClusterSpecError: ``task`` is not in the spec, or ``address`` is invalid or
                already used by another task.
        """
        self.task_address(task.job, task.index)
        jobs = {job: dict(tasks) for job, tasks in self._jobs.items()}
        jobs[task.job][task.index] = address
        return ClusterSpec(jobs)

    def with_task(self, task: TaskId, address: str) -> ClusterSpec:
        """A new spec with ``task`` added at ``address``; this one is unchanged.

        Used when an elastic cluster grows (``clusterflow scale``).

        Raises:
            ClusterSpecError: ``task`` is in the spec already, or ``address`` is invalid
                or used by another task.
        """
        if task in self:
            raise ClusterSpecError(f"task {task} is already in the cluster spec")
        jobs = {job: dict(tasks) for job, tasks in self._jobs.items()}
        jobs.setdefault(task.job, {})[task.index] = address
        return ClusterSpec(jobs)

    def without(self, task: TaskId) -> ClusterSpec:
        """A new spec without ``task`` (its job sparse if ``task`` was not its last);
        this one is unchanged. Used when a task leaves an elastic cluster.

        Raises:
            ClusterSpecError: ``task`` is not in the spec.
        """
        self.task_address(task.job, task.index)
        jobs = {job: dict(tasks) for job, tasks in self._jobs.items()}
        del jobs[task.job][task.index]
        if not jobs[task.job]:
            del jobs[task.job]
        return ClusterSpec(jobs)

    def __contains__(self, task: object) -> bool:
        return isinstance(task, TaskId) and task.index in self._jobs.get(task.job, {})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"
