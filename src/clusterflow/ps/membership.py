"""Who a sync step waits for: the ``ps.leave`` and ``ps.members`` requests.

Two requests change the replicas a synchronous step aggregates (``engine.py``):

* ``ps.leave``: a replica will push no more. It takes effect at once, in the step being
  collected too, so no step waits for it. The replica sends it when its data runs out;
  in an elastic cluster the manager sends it for a worker that ``clusterflow scale``
  removed, once its process is gone (``manager/ps_membership.py``).
* ``ps.members``: from step ``version`` on, a step takes these replicas. It takes effect
  at a step boundary, never inside the step being collected: a replica added here
  counts from the next step, and its push to an earlier step is refused, not counted.

The types live apart from ``protocol.py`` and import nothing of torch: the manager
builds them, and the control plane starts without torch (docs/architecture.md
section 2). Both ends parse them from this one definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from clusterflow.ps.api import MalformedRequest
from clusterflow.ps.wire import Tensors, Wire, in_bounds
from clusterflow.ps.wire import request_body as _body


def _worker_name(method: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise MalformedRequest(
            f"ps.{method} request: {key!r} must be a task name, got {value!r:.80}"
        )
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaveRequest:
    """A replica will push no more: sync steps stop waiting for it."""

    METHOD: ClassVar[str] = "leave"
    worker: str

    def to_wire(self) -> Wire:
        return {"worker": self.worker}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> LeaveRequest:
        return cls(worker=_worker_name(cls.METHOD, "worker", _body(cls.METHOD, body).get("worker")))


@dataclass(frozen=True, slots=True, kw_only=True)
class MembersRequest:
    """From step ``version`` on (None: the next step), a sync step takes ``workers``.

    A ps that is past ``version`` takes the membership from its next step: the step
    being collected keeps the replicas it began with. Names the membership drops stop
    counting at that boundary (``LeaveRequest`` stops them at once).
    """

    METHOD: ClassVar[str] = "members"
    workers: tuple[str, ...]
    """Every replica a step takes from then on (the chief and the workers), by task name."""
    version: int | None = None
    """The first step they form; None: the ps's next step."""
    previous: tuple[str, ...] = ()
    """The replicas before the change. A ps told no membership yet counted its steps by
    number (``PSConfig.num_replicas``), not by name: it takes these for the step being
    collected, so a newcomer's early push is refused there too, not counted in the
    place of a replica that is still due."""

    def __post_init__(self) -> None:
        if not self.workers:
            raise MalformedRequest("ps.members request: 'workers' names no replica")
        if len(set(self.workers)) != len(self.workers):
            raise MalformedRequest(f"ps.members request: 'workers' repeats a name: {self.workers}")

    def to_wire(self) -> Wire:
        body = {"workers": list(self.workers), "version": self.version}
        return {**body, "previous": list(self.previous)}, {}

    @classmethod
    def from_wire(cls, body: Any, tensors: Tensors) -> MembersRequest:
        b = _body(cls.METHOD, body)
        workers = b.get("workers")
        if not isinstance(workers, list | tuple):
            raise MalformedRequest(
                f"ps.members request: 'workers' must list task names, got {workers!r:.80}"
            )
        previous = b.get("previous") or []
        if not isinstance(previous, list | tuple):
            raise MalformedRequest(
                f"ps.members request: 'previous' must list task names, got {previous!r:.80}"
            )
        version = b.get("version")
        if version is not None:
            if not isinstance(version, int) or isinstance(version, bool):
                raise MalformedRequest(
                    f"ps.members request: 'version' must be int, got {version!r:.80}"
                )
            in_bounds(cls.METHOD, "version", version)
        return cls(
            workers=tuple(_worker_name(cls.METHOD, "workers", w) for w in workers),
            version=version,
            previous=tuple(_worker_name(cls.METHOD, "previous", w) for w in previous),
        )
