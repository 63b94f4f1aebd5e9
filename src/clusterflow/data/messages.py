"""The ``data.*`` wire contract: each request and reply of the dispatcher typed once.

``DispatcherClient`` builds every request from these types and ``DispatcherService``
parses every one with them, so the two ends cannot read a field differently. A body that
breaks the contract is ``rpc``'s ``MalformedBody``, naming the field and the value; the
dispatcher then refuses it before it touches a lease.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from clusterflow.data.api import DataError, DatasetSpec, Lease
from clusterflow.rpc.errors import MalformedBody
from clusterflow.rpc.message import body_map

SERVICE = "data"
REGISTER, LEASE, ACK, RELEASE, STATUS, STATE_DICT, LOAD_STATE_DICT = (
    f"{SERVICE}.{m}"
    for m in ("register", "lease", "ack", "release", "status", "state_dict", "load_state_dict")
)

MAX_LEASES_PER_CALL = 256
"""The most splits one ``data.lease`` call may ask for (``count``)."""

LEASE_STATUSES = ("lease", "wait", "end")
"""What a ``data.lease`` reply's ``status`` may say (``leases.GrantStatus`` serves them)."""


def _name(method: str, body: Mapping[str, Any]) -> str:
    name = body.get("name")
    if not isinstance(name, str):
        raise MalformedBody(f"{method} needs a dataset name, got {name!r:.80}")
    return name


def _worker(body: Mapping[str, Any]) -> str:
    worker = body.get("worker")
    if not isinstance(worker, str) or not worker:
        raise MalformedBody(f"a worker name is required, got {worker!r:.80}")
    return worker


def _lease_ids(method: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise MalformedBody(f"{method} needs a list of integer lease ids, got {value!r:.80}")
    return tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterRequest:
    """A dataset to lend splits of (the first registration wins; the same spec again is
    a no-op) and, for a cached source, where each partition lives."""

    METHOD: ClassVar[str] = REGISTER
    spec: DatasetSpec
    locations: list[list[Any]] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"spec": self.spec.to_wire(), "locations": self.locations}

    @classmethod
    def from_wire(cls, body: Any) -> RegisterRequest:
        b = body_map(f"{cls.METHOD} body", body)
        locations = b.get("locations") or None
        if locations is not None and not isinstance(locations, list):
            raise MalformedBody(f"{cls.METHOD}: locations must be a list, got {locations!r:.80}")
        return cls(spec=DatasetSpec.from_wire(b.get("spec")), locations=locations)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRequest:
    """The next split of a dataset for a worker (up to ``count``), after acking ``acks``
    (the simple mode's acks ride on the next ask: one call per split, not two)."""

    METHOD: ClassVar[str] = LEASE
    name: str
    worker: str
    host: str | None = None
    """The worker's host: a cached source lends it the splits held there first."""
    incarnation: str | None = None
    """The asking process (``dispatcher_client.INCARNATION``): a restarted task reuses
    its name, never this."""
    acks: tuple[int, ...] = ()
    count: int | None = None
    """None: one split, the reply's ``lease``; else up to this many, its ``leases``."""

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": self.name,
            "worker": self.worker,
            "host": self.host,
            "incarnation": self.incarnation,
        }
        if self.acks:
            body["acks"] = list(self.acks)
        if self.count is not None:
            body["count"] = self.count
        return body

    @classmethod
    def from_wire(cls, body: Any) -> LeaseRequest:
        b = body_map(f"{cls.METHOD} body", body)
        count = b.get("count")
        if count is not None and (
            not isinstance(count, int)
            or isinstance(count, bool)
            or not 1 <= count <= MAX_LEASES_PER_CALL
        ):
            raise MalformedBody(
                f"lease count must be an integer from 1 to {MAX_LEASES_PER_CALL}, got {count!r}"
            )
        host, incarnation, acks = b.get("host"), b.get("incarnation"), b.get("acks")
        return cls(
            name=_name(cls.METHOD, b),
            worker=_worker(b),
            host=None if host is None else str(host),
            incarnation=str(incarnation) if incarnation else None,
            acks=_lease_ids(cls.METHOD, acks) if acks else (),
            count=count,
        )


@dataclass(frozen=True, slots=True)
class LeaseReply:
    """A ``data.lease`` reply: the splits lent, or word to wait or stop.

    ``status`` is ``lease`` (``leases`` holds one lease or more, each acked on its own),
    ``wait`` (nothing pending at the end of the data; ask again after ``retry_s``) or
    ``end`` (every epoch is complete).
    """

    status: str
    leases: tuple[Lease, ...] = ()
    retry_s: float = 0.0
    last: bool = False
    """With ``lease``: nothing is left to lend after these splits (``Grant.last``), so
    a worker that stops once nothing is left need not ask again. Sent only when true;
    a dispatcher that never sends it costs such a worker one more ask."""

    def to_wire(self) -> dict[str, Any]:
        """The first lease as ``lease`` too, for a reader of one split per call."""
        body: dict[str, Any] = {"status": self.status}
        if self.leases:
            body["lease"] = self.leases[0].to_wire()
            body["leases"] = [lease.to_wire() for lease in self.leases]
        if self.status == "wait":
            body["retry_s"] = self.retry_s
        if self.last:
            body["last"] = True
        return body

    @classmethod
    def from_wire(cls, body: Any) -> LeaseReply:
        """Parses a reply, one lease (``lease``) or many (``leases``).

        Raises:
            DataError: the reply is not a lease reply (names what came).
        """
        status = body.get("status") if isinstance(body, Mapping) else None
        if status not in LEASE_STATUSES:
            raise DataError(f"not a data.lease reply: {body!r}")
        items = body.get("leases") or ([body["lease"]] if body.get("lease") else [])
        if status == "lease" and not items:
            raise DataError(f"data.lease reply lends nothing: {body!r}")
        last = body.get("last", False)
        if not isinstance(last, bool):
            raise DataError(f"data.lease reply's 'last' must be true or false, got {last!r:.80}")
        return cls(
            status,
            tuple(Lease.from_wire(item) for item in items),
            float(body.get("retry_s", 0.0)),
            last,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AckRequest:
    """Leases whose update was applied: their splits are done for the epoch."""

    METHOD: ClassVar[str] = ACK
    name: str
    leases: tuple[int, ...]
    worker: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "leases": list(self.leases), "worker": self.worker}

    @classmethod
    def from_wire(cls, body: Any) -> AckRequest:
        b = body_map(f"{cls.METHOD} body", body)
        worker = b.get("worker")
        return cls(
            name=_name(cls.METHOD, b),
            leases=_lease_ids(cls.METHOD, b.get("leases")),
            worker=str(worker) if worker else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseRequest:
    """A worker hands back leases unread (``leases``), or all it holds (None): of one
    dataset, or of every one (``name`` None)."""

    METHOD: ClassVar[str] = RELEASE
    worker: str
    name: str | None = None
    leases: tuple[int, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "worker": self.worker}
        if self.leases is not None:
            body["leases"] = list(self.leases)
        return body

    @classmethod
    def from_wire(cls, body: Any) -> ReleaseRequest:
        b = body_map(f"{cls.METHOD} body", body)
        name, leases = b.get("name"), b.get("leases")
        if leases is not None and name is None:
            raise MalformedBody(f"{cls.METHOD} of lease ids needs the dataset's name")
        return cls(
            worker=_worker(b),
            name=None if name is None else str(name),
            leases=None if leases is None else _lease_ids(cls.METHOD, leases),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusRequest:
    """One dataset's progress: the epoch, and splits pending, lent and acked."""

    METHOD: ClassVar[str] = STATUS
    name: str

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_wire(cls, body: Any) -> StatusRequest:
        return cls(name=_name(cls.METHOD, body_map(f"{cls.METHOD} body", body)))
