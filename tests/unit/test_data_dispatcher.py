"""The dispatcher's ``data.lease`` with a count, through its registered handlers and a
hand-driven clock: several splits per call, the cap, bad counts, exactly-once over
acks riding along, a worker's death and the deadline."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from clusterflow.data.api import DataError, DatasetSpec, Lease, UnknownLeaseError
from clusterflow.data.dispatcher import DispatcherConfig, DispatcherService
from clusterflow.data.leases import GrantStatus, LeaseBook
from clusterflow.data.messages import LEASE_STATUSES, MAX_LEASES_PER_CALL, LeaseReply
from clusterflow.rpc import MalformedBody, Request

SPEC = DatasetSpec(name="d", source="s", num_records=40, split_size=4)  # 10 splits


class Served:
    """A dispatcher's handlers as ``register_on`` wires them, called without sockets."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.now = 0.0
        self.service = DispatcherService(
            DispatcherConfig(lease_timeout_s=timeout_s), clock=lambda: self.now
        )
        self.handlers: dict[str, Callable[[Request], Any]] = {}
        self.service.register_on(self)
        self.call("data.register", {"spec": SPEC.to_wire(), "locations": []})

    def register(
        self, method: str, handler: Callable[[Request], Any], *, blocking: bool = False
    ) -> None:
        self.handlers[method] = handler

    def call(self, method: str, body: Any) -> Any:
        return self.handlers[method](Request(method, body, {}, b""))

    def lease(self, worker: str, count: int, acks: list[int] | None = None) -> LeaseReply:
        body = {"name": "d", "worker": worker, "host": None, "count": count}
        if acks:
            body["acks"] = acks
        return LeaseReply.from_wire(self.call("data.lease", body))


def records(leases: list[Lease]) -> Counter[int]:
    return Counter(r for lease in leases for r in range(lease.start, lease.stop))


def test_one_call_lends_count_splits_each_under_its_own_lease() -> None:
    served = Served()
    reply = served.lease("a", 3)
    assert reply.status == "lease" and len(reply.leases) == 3
    assert len({lease.lease_id for lease in reply.leases}) == 3
    assert served.service.status("d")["workers"] == {"a": 3}
    seen = list(reply.leases)
    acks = [lease.lease_id for lease in reply.leases]
    while (reply := served.lease("a", 3, acks)).status == "lease":  # acks ride along
        seen.extend(reply.leases)
        acks = [lease.lease_id for lease in reply.leases]
    assert reply.status == "end"  # the call that acked the last ones
    assert records(seen) == Counter(range(40))
    assert served.service.status("d")["finished"]


def test_the_count_is_capped_and_a_bad_one_is_refused_in_one_line() -> None:
    served = Served()
    whole = served.lease("a", MAX_LEASES_PER_CALL)  # the cap itself is allowed
    assert len(whole.leases) == SPEC.num_splits  # all there is
    for bad in (0, -1, MAX_LEASES_PER_CALL + 1, True, "3", 1.5, [2]):
        body = {"name": "d", "worker": "b", "host": None, "count": bad}
        with pytest.raises(MalformedBody) as info:  # the one error for a malformed body
            served.call("data.lease", {**body, "acks": [whole.leases[0].lease_id]})
        message = str(info.value)
        assert "\n" not in message and f"got {bad!r}" in message
        assert message.startswith(f"lease count must be an integer from 1 to {MAX_LEASES_PER_CALL}")
    status = served.service.status("d")
    assert status["outstanding"] == SPEC.num_splits  # a refused call acked and lent nothing
    assert status["workers"] == {"a": SPEC.num_splits}


def test_a_dead_workers_splits_leased_ahead_all_go_back_and_each_record_is_acked_once() -> None:
    served = Served()
    first = served.lease("victim", 4)
    served.call("data.ack", {"name": "d", "leases": [first.leases[0].lease_id]})
    assert served.service.release_worker("victim") == 3  # its three unread ones
    done = [first.leases[0]]
    acks: list[int] = []
    while (reply := served.lease("survivor", 4, acks)).status == "lease":
        done.extend(reply.leases)
        acks = [lease.lease_id for lease in reply.leases]
    assert reply.status == "end"  # every split acked, the victim's three by the survivor
    assert records(done) == Counter(range(40))


def test_a_silent_workers_splits_leased_ahead_come_back_at_the_deadline() -> None:
    served = Served(timeout_s=5.0)
    taken = served.lease("silent", 4)
    done: list[Lease] = []
    acks: list[int] = []
    waited = 0
    while (reply := served.lease("other", 2, acks)).status != "end" and served.now < 30:
        done.extend(reply.leases)
        acks = [lease.lease_id for lease in reply.leases]
        waited += reply.status == "wait"  # its own done, the silent one's four still out
        served.now += 1.0  # "other" calls every second; "silent" never again
    assert reply.status == "end" and waited  # the four came back at the deadline
    assert records(done) == Counter(range(40))
    assert {x.start for x in taken.leases} <= {x.start for x in done}
    with pytest.raises(UnknownLeaseError, match="no longer active"):  # its late ack
        served.call("data.ack", {"name": "d", "leases": [taken.leases[0].lease_id]})


def test_a_grant_of_several_takes_no_more_than_the_workers_share_of_what_is_left() -> None:
    """The server-side cap that keeps the last splits spread: with two workers heard
    from and 10 splits, one asking for 8 gets its share of 5, then one at a time."""
    spec = DatasetSpec(name="d", source="s", num_records=20, split_size=2)
    book = LeaseBook(spec, lease_timeout_s=10.0)
    assert len(book.grant("b", None, 0, count=1).leases) == 1
    assert len(book.grant("a", None, 0, count=8).leases) == 5  # ceil(10 / 2)
    assert len(book.grant("a", None, 0, count=8).leases) == 1  # at its share: one
    assert len(book.grant("b", None, 0, count=8).leases) == 3  # 3 left for it
    assert book.grant("b", None, 0, count=8).status == GrantStatus.WAIT


def test_the_reply_statuses_are_the_ledgers() -> None:
    assert set(LEASE_STATUSES) == {status.value for status in GrantStatus}
    with pytest.raises(DataError, match=r"not a data\.lease reply: \{'status': 'maybe'\}"):
        LeaseReply.from_wire({"status": "maybe"})


def test_an_ack_from_before_a_whole_restart_never_settles_a_lease_of_the_restored_run() -> None:
    """A whole restart restores the cursor of the last checkpoint. Leases lent after it
    (trained by the old tasks, their acks possibly still on the way from a killed one)
    must not share ids with the restored run's: such an ack would settle a new lease of
    a split nobody trained since the restore, and its records would be lost (the chaos
    suite's allreduce run lost two splits so, 2026-11-28)."""
    served = Served()
    before = served.lease("w", 2)
    served.call("data.ack", {"name": "d", "leases": [x.lease_id for x in before.leases]})
    cursor = served.service.state_dict()  # the checkpoint: 2 splits done
    after = served.lease("w", 2)  # lent after it; their update dies with the old run
    served.service.reset(cursor)
    served.call("data.register", {"spec": SPEC.to_wire(), "locations": []})

    restored = served.lease("w", 2)
    stale = [x.lease_id for x in after.leases]
    with pytest.raises(UnknownLeaseError, match="a restart from a checkpoint took it back"):
        served.call("data.ack", {"name": "d", "leases": stale})
    assert served.service.status("d")["outstanding"] == 2  # the new leases stand
    done = list(restored.leases)
    acks = [x.lease_id for x in restored.leases]
    while (reply := served.lease("w", 2, acks)).status == "lease":
        done.extend(reply.leases)
        acks = [x.lease_id for x in reply.leases]
    assert reply.status == "end"
    assert records(list(before.leases) + done) == Counter(range(40))  # each record once
