"""The manager's wire contract: each request and reply of ``ManagerMethod`` typed once.

Every client of the manager (the supervisor, ``ManagerLink``, the trial reporter,
``clusterflow stop``) builds its body from these types, and the manager's handlers
(``manager/controller.py``, ``manager/trial_reports.py``) parse every one with them, so
the two ends cannot read a field differently. A body that breaks the contract (not a
map, a field missing or of another type) is ``rpc``'s ``MalformedBody`` naming the
method, the field and the value: the manager refuses it before it touches a task, and
the caller gets it typed by its wire code (``malformed``).

The module lives on the client's side of the layers, beside ``manager_link.py``: the
supervisor (``backends``) and the jobs (``train``, ``strategies``) import it, and it
imports nothing of the manager. The method names stay in ``cluster/contract.py``.
Values a handler may ignore (a non-positive grace period, an unknown task's heartbeat)
are the handler's decision, as they were; these types check only that the body is what
the contract says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from clusterflow.cluster.contract import ManagerMethod
from clusterflow.errors import ConfigError
from clusterflow.rpc.errors import MalformedBody
from clusterflow.rpc.message import body_map

MAX_FIGURES = 256
"""Most figures one ``trial.report`` may carry (a report is a handful; a flood is refused)."""
MAX_NAME = 200
"""Longest figure name a ``trial.report`` may carry."""


def _body(method: str, body: Any, *, none_is_empty: bool = False) -> Mapping[str, Any]:
    return body_map(f"{method} body", body, none_is_empty=none_is_empty)


def _task(method: str, b: Mapping[str, Any]) -> str:
    task = b.get("task")
    if not isinstance(task, str) or not task:
        raise MalformedBody(f"{method}: task must be a task name, got {task!r:.80}")
    return task


def _int(method: str, b: Mapping[str, Any], key: str, *, optional: bool = False) -> Any:
    value = b.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedBody(f"{method}: {key} must be a whole number, got {value!r:.80}")
    return value


def _number(method: str, b: Mapping[str, Any], key: str) -> float | int | None:
    """An optional number (absent or None: None); a bool is not one."""
    value = b.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedBody(f"{method}: {key} must be a number, got {value!r:.80}")
    return value


def _bool(method: str, b: Mapping[str, Any], key: str, *, optional: bool = False) -> bool | None:
    value = b.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise MalformedBody(f"{method}: {key} must be true or false, got {value!r:.80}")
    return value


def _text(method: str, b: Mapping[str, Any], key: str, *, optional: bool = False) -> str | None:
    value = b.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise MalformedBody(f"{method}: {key} must be a non-empty string, got {value!r:.80}")
    return value


def _spec(method: str, b: Mapping[str, Any], *, optional: bool = False) -> dict[str, Any] | None:
    """A cluster spec in its dict form (``ClusterSpec.as_dict``): job -> tasks."""
    spec = b.get("spec")
    if spec is None and optional:
        return None
    if not isinstance(spec, dict) or not all(isinstance(job, str) for job in spec):
        raise MalformedBody(f"{method}: spec must map job names to tasks, got {spec!r:.80}")
    return spec


def _strings(method: str, value: Any, key: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise MalformedBody(f"{method}: {key} must map names to strings, got {value!r:.80}")
    return value


# Requests of the supervisor -----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterRequest:
    """A supervisor joins the barrier with the address its task serves on."""

    METHOD: ClassVar[str] = ManagerMethod.REGISTER
    task: str
    address: str
    """``host:port`` of the port the supervisor reserved for its job."""
    pid: int | None = None
    """The supervisor's pid: the manager refuses a registration from one it replaced."""

    def to_wire(self) -> dict[str, Any]:
        return {"task": self.task, "address": self.address, "pid": self.pid}

    @classmethod
    def from_wire(cls, body: Any) -> RegisterRequest:
        b = _body(cls.METHOD, body)
        return cls(
            task=_task(cls.METHOD, b),
            address=str(_text(cls.METHOD, b, "address")),
            pid=_int(cls.METHOD, b, "pid", optional=True),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterReply:
    """What the task runs, answered once the barrier completed."""

    spec: dict[str, Any]
    """The cluster spec (``ClusterSpec.as_dict``) the job's ``TF_CONFIG`` holds."""
    spec_version: int
    env: dict[str, str]
    """The job command's environment, on top of the supervisor's."""
    command: tuple[str, ...]
    replicas: tuple[dict[str, str], ...] = ()
    """One set of variables per replica process; empty: one process."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "spec_version": self.spec_version,
            "env": self.env,
            "replicas": [dict(r) for r in self.replicas],
            "command": list(self.command),
        }

    @classmethod
    def from_wire(cls, body: Any) -> RegisterReply:
        what = f"{ManagerMethod.REGISTER} reply"
        b = body_map(what, body)
        command = b.get("command")
        if (
            not isinstance(command, list)
            or not command
            or not all(isinstance(a, str) for a in command)
        ):
            raise MalformedBody(f"{what}: command must be a list of strings, got {command!r:.80}")
        replicas = b.get("replicas") or []
        if not isinstance(replicas, list):
            raise MalformedBody(f"{what}: replicas must be a list, got {replicas!r:.80}")
        return cls(
            spec=_spec(what, b) or {},
            spec_version=_int(what, b, "spec_version"),
            env=_strings(what, b.get("env"), "env"),
            command=tuple(command),
            replicas=tuple(_strings(what, r, "replicas") for r in replicas),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatRequest:
    """A supervisor is alive (and its job's first process is ``pid``)."""

    METHOD: ClassVar[str] = ManagerMethod.HEARTBEAT
    task: str
    pid: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"task": self.task, "pid": self.pid}

    @classmethod
    def from_wire(cls, body: Any) -> HeartbeatRequest:
        b = _body(cls.METHOD, body)
        return cls(task=_task(cls.METHOD, b), pid=_int(cls.METHOD, b, "pid", optional=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class ExitedRequest:
    """A supervisor's job ended with ``code``, or could not run: why, in one line."""

    METHOD: ClassVar[str] = ManagerMethod.EXITED
    task: str
    code: int
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"task": self.task, "code": self.code}
        if self.error:
            body["error"] = self.error
        return body

    @classmethod
    def from_wire(cls, body: Any) -> ExitedRequest:
        b = _body(cls.METHOD, body)
        error = b.get("error")
        if error is not None and not isinstance(error, str):
            raise MalformedBody(f"{cls.METHOD}: error must be a string, got {error!r:.80}")
        return cls(task=_task(cls.METHOD, b), code=_int(cls.METHOD, b, "code"), error=error or None)


@dataclass(frozen=True, slots=True, kw_only=True)
class StandbyRequest:
    """A standby supervisor waits, one bounded round, for a task to take over."""

    METHOD: ClassVar[str] = ManagerMethod.STANDBY
    pid: int
    """The standby's pid: only the standby the manager keeps is given a task."""
    wait_s: float | None = None
    """The round's length; None: the manager's default."""

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "wait_s": self.wait_s}

    @classmethod
    def from_wire(cls, body: Any) -> StandbyRequest:
        b = _body(cls.METHOD, body)
        return cls(pid=_int(cls.METHOD, b, "pid"), wait_s=_number(cls.METHOD, b, "wait_s"))


@dataclass(frozen=True, slots=True, kw_only=True)
class StandbyReply:
    """The end of a standby's round: a task to run, nothing yet, or word to exit."""

    task: str | None = None
    """The task handed over; None with ``exit`` False: the round ended, ask again."""
    exit: bool = False
    """Not (or no longer) the standby kept, or the cluster stops."""

    def to_wire(self) -> dict[str, Any]:
        return {"exit": True} if self.exit else {"task": self.task}

    @classmethod
    def from_wire(cls, body: Any) -> StandbyReply:
        what = f"{ManagerMethod.STANDBY} reply"
        b = body_map(what, body)
        return cls(
            task=_text(what, b, "task", optional=True),
            exit=bool(_bool(what, b, "exit", optional=True)),
        )


# Requests of the job (ManagerLink) ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclareRequest:
    """A job says whether its task may be respawned alone, and resized around."""

    METHOD: ClassVar[str] = ManagerMethod.DECLARE
    task: str
    respawnable: bool
    resizable: bool | None = None
    """None: not said, so the cluster may not grow or shrink around it."""

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"task": self.task, "respawnable": self.respawnable}
        if self.resizable is not None:
            body["resizable"] = self.resizable
        return body

    @classmethod
    def from_wire(cls, body: Any) -> DeclareRequest:
        b = _body(cls.METHOD, body)
        return cls(
            task=_task(cls.METHOD, b),
            respawnable=bool(_bool(cls.METHOD, b, "respawnable")),
            resizable=_bool(cls.METHOD, b, "resizable", optional=True),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclareReply:
    """How the manager recovers the task that declared."""

    max_restarts: int
    elastic: bool
    """The cluster has a worker range: an all-reduce group watches for newcomers."""

    def to_wire(self) -> dict[str, Any]:
        return {"max_restarts": self.max_restarts, "elastic": self.elastic}

    @classmethod
    def from_wire(cls, body: Any) -> DeclareReply:
        what = f"{ManagerMethod.DECLARE} reply"
        b = body_map(what, body)
        return cls(
            max_restarts=_int(what, b, "max_restarts"), elastic=bool(_bool(what, b, "elastic"))
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointsRequest:
    """The chief's checkpoints live at ``url``: restarts restore from there."""

    METHOD: ClassVar[str] = ManagerMethod.CHECKPOINTS
    task: str
    url: str

    def to_wire(self) -> dict[str, Any]:
        return {"task": self.task, "url": self.url}

    @classmethod
    def from_wire(cls, body: Any) -> CheckpointsRequest:
        b = _body(cls.METHOD, body)
        return cls(task=_task(cls.METHOD, b), url=str(_text(cls.METHOD, b, "url")))


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointsReply:
    url: str
    """Where the manager restores from now."""

    def to_wire(self) -> dict[str, Any]:
        return {"url": self.url}

    @classmethod
    def from_wire(cls, body: Any) -> CheckpointsReply:
        what = f"{ManagerMethod.CHECKPOINTS} reply"
        return cls(url=str(_text(what, body_map(what, body), "url")))


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecRequest:
    """The newest cluster spec: no fields (an absent body is an empty one)."""

    METHOD: ClassVar[str] = ManagerMethod.SPEC

    def to_wire(self) -> dict[str, Any] | None:
        return None  # no body at all, as the method was always called

    @classmethod
    def from_wire(cls, body: Any) -> SpecRequest:
        _body(cls.METHOD, body, none_is_empty=True)
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecReply:
    """The newest cluster spec and its version (None before the barrier completed)."""

    spec: dict[str, Any] | None
    spec_version: int

    def to_wire(self) -> dict[str, Any]:
        return {"spec": self.spec, "spec_version": self.spec_version}

    @classmethod
    def from_wire(cls, body: Any) -> SpecReply:
        what = f"{ManagerMethod.SPEC} reply"
        b = body_map(what, body)
        return cls(spec=_spec(what, b, optional=True), spec_version=_int(what, b, "spec_version"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportRequest:
    """A job's live figures (``task.report``), for ``clusterflow ps`` and stall
    detection; a figure the job does not know is None."""

    METHOD: ClassVar[str] = ManagerMethod.REPORT
    task: str
    step: int
    loss: float | None = None
    samples_per_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "step": self.step,
            "loss": self.loss,
            "samples_per_s": self.samples_per_s,
        }

    def figures(self) -> dict[str, float | int]:
        """The figures the job knows, by name (``manager/state.py`` ``FIGURES``)."""
        named = {"step": self.step, "loss": self.loss, "samples_per_s": self.samples_per_s}
        return {k: v for k, v in named.items() if v is not None}

    @classmethod
    def from_wire(cls, body: Any) -> ReportRequest:
        b = _body(cls.METHOD, body)
        return cls(
            task=_task(cls.METHOD, b),
            step=_int(cls.METHOD, b, "step"),
            loss=_number(cls.METHOD, b, "loss"),
            samples_per_s=_number(cls.METHOD, b, "samples_per_s"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrialReportRequest:
    """A tuning trial's figures at ``step`` (``trial.report``); the manager appends them
    to its report file (``manager/trial_reports.py``)."""

    METHOD: ClassVar[str] = ManagerMethod.TRIAL_REPORT
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    """At most ``MAX_FIGURES`` names (each up to ``MAX_NAME`` characters) to numbers; a
    value that is not finite arrives as NaN (a diverged step)."""

    def to_wire(self) -> dict[str, Any]:
        return {"step": self.step, "metrics": dict(self.metrics)}

    @classmethod
    def from_wire(cls, body: Any) -> TrialReportRequest:
        b = _body(cls.METHOD, body)
        step, metrics = _int(cls.METHOD, b, "step"), b.get("metrics")
        if not isinstance(metrics, dict) or len(metrics) > MAX_FIGURES:
            raise MalformedBody(
                f"{cls.METHOD}: metrics must map at most {MAX_FIGURES} names to numbers"
            )
        figures: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name or len(name) > MAX_NAME:
                raise MalformedBody(f"{cls.METHOD}: bad figure name {str(name)[:MAX_NAME]!r}")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise MalformedBody(f"{cls.METHOD}: figure {name} is not a number: {value!r:.80}")
            figures[name] = float(value) if math.isfinite(value) else float("nan")
        return cls(step=step, metrics=figures)


# Requests of the CLI ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequest:
    """``clusterflow stop``: stop the cluster, SIGKILL ``grace_s`` after SIGTERM."""

    METHOD: ClassVar[str] = ManagerMethod.STOP
    grace_s: float | None = None
    """None (or not above 0): the cluster's own grace period."""

    def to_wire(self) -> dict[str, Any]:
        return {"grace_s": self.grace_s}

    @classmethod
    def from_wire(cls, body: Any) -> StopRequest:
        b = _body(cls.METHOD, body, none_is_empty=True)
        return cls(grace_s=_number(cls.METHOD, b, "grace_s"))


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusRequest:
    """The cluster's state: no fields. The reply is ``state.json``'s form
    (``manager/state.py`` ``ClusterState.to_dict``), typed there."""

    METHOD: ClassVar[str] = ManagerMethod.STATUS

    def to_wire(self) -> dict[str, Any] | None:
        return None  # no body at all, as the method was always called

    @classmethod
    def from_wire(cls, body: Any) -> StatusRequest:
        _body(cls.METHOD, body, none_is_empty=True)
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleRequest:
    """``clusterflow scale``: the worker tasks an elastic cluster should have.

    A body of another shape is ``MalformedBody`` (the sender's bug); a whole number
    below 1 is the user's input, refused as ``ConfigError`` in their words, at the CLI
    before anything is sent and again by the manager (``ScaleRefused``)."""

    METHOD: ClassVar[str] = ManagerMethod.SCALE
    workers: int
    automatic: bool = False
    """Asked by the manager's own growth watcher (Ray), not by a user: a user's ``scale``
    also sets the ceiling the watcher grows to, an automatic one does not."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int):
            raise ConfigError(f"--workers must be a whole number, got {self.workers!r}")
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")

    def to_wire(self) -> dict[str, Any]:
        return {"workers": self.workers, **({"automatic": True} if self.automatic else {})}

    @classmethod
    def from_wire(cls, body: Any) -> ScaleRequest:
        b = _body(cls.METHOD, body)
        if not {"workers"} <= set(b) <= {"workers", "automatic"}:
            raise MalformedBody(
                f"{cls.METHOD}: a body is {{'workers': N[, 'automatic': B]}}, got {body!r:.80}"
            )
        automatic = _bool(cls.METHOD, b, "automatic", optional=True)
        return cls(workers=_int(cls.METHOD, b, "workers"), automatic=bool(automatic))


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleReply:
    """What a ``manager.scale`` did, answered once it took effect: the worker count and
    spec version after it, the tasks added and removed, and whether every task was
    restarted at the new size (a job whose workers declared nothing)."""

    workers: int
    spec_version: int
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    restarted: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "spec_version": self.spec_version,
            "joined": list(self.joined),
            "left": list(self.left),
            "restarted": self.restarted,
        }

    @classmethod
    def from_wire(cls, body: Any) -> ScaleReply:
        what = f"{ManagerMethod.SCALE} reply"
        b = body_map(what, body)
        return cls(
            workers=_int(what, b, "workers"),
            spec_version=_int(what, b, "spec_version"),
            joined=_names(what, b, "joined"),
            left=_names(what, b, "left"),
            restarted=bool(_bool(what, b, "restarted")),
        )


def _names(what: str, b: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = b.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise MalformedBody(f"{what}: {key} must be a list of task names, got {value!r:.80}")
    return tuple(value)


REQUESTS: Mapping[str, Any] = {
    t.METHOD: t
    for t in (
        RegisterRequest,
        HeartbeatRequest,
        ExitedRequest,
        StandbyRequest,
        DeclareRequest,
        CheckpointsRequest,
        SpecRequest,
        ReportRequest,
        TrialReportRequest,
        StopRequest,
        StatusRequest,
        ScaleRequest,
    )
}
"""Each manager method's request type."""
