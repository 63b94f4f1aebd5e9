"""The lease ledger, driven by hand: exactly-once, returns, deadlines, cursors, locality."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from clusterflow.data.api import DatasetSpec, Lease, UnknownLeaseError
from clusterflow.data.leases import GrantStatus, LeaseBook
from clusterflow.data.splits import location_runs
from clusterflow.errors import ConfigError


def book(n: int = 20, split: int = 2, epochs: int | None = 1, timeout: float = 10.0) -> LeaseBook:
    spec = DatasetSpec(name="d", source="s", num_records=n, split_size=split, epochs=epochs)
    return LeaseBook(spec, lease_timeout_s=timeout)


def take(b: LeaseBook, worker: str = "w", now: float = 0.0, host: str | None = None) -> Lease:
    grant = b.grant(worker, host, now)
    assert grant.status == GrantStatus.LEASE, grant
    assert grant.lease is not None
    return grant.lease


def drain(b: LeaseBook, worker: str = "w", now: float = 0.0) -> list[Lease]:
    leases = []
    while (grant := b.grant(worker, None, now)).lease is not None:
        leases.append(grant.lease)
        b.ack([grant.lease.lease_id], now)
    return leases


def records(leases: list[Lease]) -> Counter[int]:
    return Counter(r for lease in leases for r in range(lease.start, lease.stop))


def test_every_record_once_then_end() -> None:
    b = book(n=21, split=4)
    leases = drain(b)
    assert records(leases) == Counter(range(21))
    assert b.grant("w", None, 0).status == GrantStatus.END
    assert b.finished


def test_wait_while_splits_are_out_then_end() -> None:
    b = book(n=4, split=2)
    first, second = take(b, "a"), take(b, "b")
    assert b.grant("c", None, 0).status == GrantStatus.WAIT
    b.ack([first.lease_id, second.lease_id], 0)
    assert b.grant("c", None, 0).status == GrantStatus.END


def test_next_epoch_opens_while_the_last_splits_are_out() -> None:
    b = book(n=4, split=2, epochs=3)
    e0 = [take(b), take(b)]
    e1 = take(b)
    assert [lease.epoch for lease in e0] == [0, 0] and e1.epoch == 1
    take(b)  # the rest of epoch 1
    assert take(b).epoch == 2  # never a wait before the end of the data
    b.release_worker("w")  # returned splits go first, oldest epoch first
    assert [take(b, "v").epoch for _ in range(6)] == [0, 0, 1, 1, 2, 2]
    assert b.grant("v", None, 0).status == GrantStatus.WAIT  # the end: all lent


def test_released_worker_leases_return_first_and_ack_once() -> None:
    b = book(n=10, split=2)
    lost = [take(b, "dead"), take(b, "dead")]
    assert b.release_worker("dead") == 2
    again = [take(b, "alive"), take(b, "alive")]
    assert [(x.start, x.stop) for x in again] == [(y.start, y.stop) for y in lost]
    assert {x.lease_id for x in again}.isdisjoint(y.lease_id for y in lost)
    for lease in again:
        b.ack([lease.lease_id], 0)
    rest = drain(b, "alive")
    assert records([*again, *rest]) == Counter(range(10))


def test_silent_worker_loses_leases_at_the_deadline() -> None:
    b = book(n=6, split=2, timeout=5.0)
    held = take(b, "slow", now=0.0)
    take(b, "busy", now=1.0)
    assert b.expire(4.0) == 0
    b.ack([], 4.5, worker="slow")  # any call is a sign of life
    assert b.expire(9.0) == 1  # busy: silent since 1.0
    assert b.expire(10.0) == 1  # slow: silent since 4.5
    assert [lease.start for lease in drain(b, "other", 10.0)] != []
    assert b.finished
    assert held.lease_id not in b.outstanding()


def test_expiry_scans_in_call_order_and_keeps_every_worker_heard_from_in_time() -> None:
    """The scan stops at the first worker heard from in time (oldest first): a worker
    heard from late after an early one, and an idle silent one, change nothing."""
    b = book(n=200, split=1, timeout=5.0)
    for i in range(50):
        take(b, f"w{i}", now=float(i) / 10)
    b.ack([], 1.0, worker="idle")  # silent later, with nothing to take back
    take(b, "w0", now=6.0)  # the oldest speaks again (and its grant expires w1..w9)
    assert b.expire(6.0) == 0
    assert b.expire(9.95) == 40  # w10..w49 (last heard 1.0-4.9) are silent past 5 s
    assert b.expire(10.9) == 0  # w0, heard at 6.0, still in time
    assert b.expire(11.1) == 2  # now w0 too: both its leases


def test_acked_split_is_never_lent_again_and_acks_are_idempotent() -> None:
    b = book(n=4, split=2)
    lease = take(b)
    assert b.ack([lease.lease_id], 0).acked == 1
    assert b.ack([lease.lease_id], 0).duplicates == 1
    assert b.release_worker("w") == 0
    other = take(b)
    assert other.start != lease.start


def test_unknown_lease_ack_names_the_lease_and_keeps_the_others() -> None:
    b = book(n=4, split=2)
    lease = take(b)
    with pytest.raises(UnknownLeaseError, match=r"lease 999 was never issued.*other 1 were acked"):
        b.ack([lease.lease_id, 999], 0)
    assert lease.lease_id not in b.outstanding()


def test_late_ack_of_a_returned_lease() -> None:
    b = book(n=6, split=2)
    lease = take(b, "a")
    b.release_worker("a")
    assert b.ack([lease.lease_id], 0).acked == 1  # split still queued: accepted, not lent again
    assert lease.start not in [x.start for x in drain(b, "b")]
    b2 = book(n=6, split=2)
    lease = take(b2, "a")
    b2.release_worker("a")
    take(b2, "b")  # the split is lent again
    with pytest.raises(UnknownLeaseError, match="taken back from a and its split lent again"):
        b2.ack([lease.lease_id], 0)


def test_locality_first_without_starving() -> None:
    b = book(n=8, split=2)
    b.set_locations(location_runs(["a", "a", "b", "b"]))
    assert {take(b, "wa", host="a").start, take(b, "wa", host="a").start} == {0, 2}
    assert take(b, "wc", host="c").start in (4, 6)  # no local split: still served
    assert take(b, "wa", host="a").start in (4, 6)


def test_cursor_restores_exactly_the_records_not_acked() -> None:
    b = book(n=40, split=3, epochs=2)
    acked = [take(b) for _ in range(5)]
    b.ack([lease.lease_id for lease in acked], 0)
    outstanding = [take(b), take(b)]
    state = json.loads(json.dumps(b.state_dict()))  # a checkpoint stores it as JSON
    assert state["epoch"] == 0 and state["seed"] == 0
    assert sorted(state["epochs"][0]["outstanding"]) == sorted(x.start // 3 for x in outstanding)
    restored, requeued = LeaseBook.from_state(state, lease_timeout_s=10.0)
    assert requeued == 2
    rest = [lease for lease in drain(restored) if lease.epoch == 0]
    assert records(rest) == Counter(range(40)) - records(acked)
    with pytest.raises(ConfigError, match="data cursor"):
        LeaseBook.from_state({"version": 99}, lease_timeout_s=1.0)


def test_cursor_in_the_epoch_overlap() -> None:
    b = book(n=4, split=2, epochs=2)
    e0 = [take(b), take(b)]
    e1 = take(b)
    b.ack([e1.lease_id, e0[0].lease_id], 0)
    restored, _ = LeaseBook.from_state(b.state_dict(), lease_timeout_s=1.0)
    rest = drain(restored)
    assert [(x.epoch, x.start) for x in rest] == [(0, e0[1].start), (1, 2 - e1.start)]
    assert restored.finished


def test_balance_is_judged_per_epoch() -> None:
    b = book(n=30, split=1)
    for i in range(30):
        lease = take(b, f"w{i % 3}")
        b.ack([lease.lease_id], 0)
    assert b.granted_per_worker == {"w0": {0: 10}, "w1": {0: 10}, "w2": {0: 10}}


def test_restarted_worker_hands_back_its_predecessors_leases() -> None:
    b = book(n=10, split=2)
    old = b.grant("worker:1", None, 0.0, incarnation="pid-1").lease
    assert old is not None
    again = b.grant("worker:1", None, 1.0, incarnation="pid-2").lease
    assert again is not None and again.start == old.start  # back first, lent to the new one
    assert old.lease_id not in b.outstanding()
    assert b.grant("worker:1", None, 2.0, incarnation="pid-2").lease is not None
    assert len(b.outstanding()) == 2


def test_a_grant_of_several_lends_each_split_under_its_own_lease() -> None:
    """``count`` lends several splits at once, each acked or taken back on its own:
    every record still once, across workers, epochs and a dead worker's return."""
    b = book(n=20, split=2, epochs=2)  # 10 splits an epoch
    first = b.grant("a", None, 0, count=4)
    assert first.status == GrantStatus.LEASE and len(first.leases) == 4
    assert first.lease is first.leases[0]
    assert len({lease.lease_id for lease in first.leases}) == 4
    b.ack([first.leases[0].lease_id, first.leases[2].lease_id], 0)
    assert b.release_worker("a") == 2  # the two unacked go back, the acked stay acked
    seen = [first.leases[0], first.leases[2]]
    while (grant := b.grant("b", None, 0, count=3)).status == GrantStatus.LEASE:
        assert 1 <= len(grant.leases) <= 3
        seen.extend(grant.leases)
        b.ack([lease.lease_id for lease in grant.leases], 0)
    assert grant.status == GrantStatus.END
    for epoch in (0, 1):
        assert records([x for x in seen if x.epoch == epoch]) == Counter(range(20))


def test_a_grant_of_several_gives_what_is_pending_then_waits() -> None:
    b = book(n=6, split=2)  # 3 splits, one epoch
    two = b.grant("a", None, 0, count=2)
    last = b.grant("b", None, 0, count=5)
    assert len(two.leases) == 2 and len(last.leases) == 1
    assert b.grant("c", None, 0, count=5).status == GrantStatus.WAIT
    b.ack([lease.lease_id for lease in (*two.leases, *last.leases)], 0)
    assert b.grant("c", None, 0, count=5).status == GrantStatus.END


def test_a_grant_says_when_nothing_is_left_to_lend_after_it() -> None:
    """``last``: no split pending and no epoch left to open once this grant is made; a
    split that comes back later (a release) is pending again, and endless data never
    has a last grant."""
    b = book(n=10, split=2, epochs=2)  # 5 splits an epoch
    assert not b.grant("a", None, 0, count=4).last
    assert not b.grant("a", None, 0, count=4).last  # epoch 1 still to open
    final = b.grant("b", None, 0, count=4)
    assert final.last and len(final.leases) == 2
    assert b.release_worker("b") == 2
    one = b.grant("c", None, 0)
    assert not one.last  # one of the two returned splits is still pending
    assert b.grant("c", None, 0).last
    endless = book(n=4, split=2, epochs=None)
    assert not any(endless.grant("a", None, 0, count=2).last for _ in range(3))
