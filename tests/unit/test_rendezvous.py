"""The registration barrier and spec versions (manager/rendezvous.py), with a fake clock."""

from __future__ import annotations

import threading

import pytest

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.manager.rendezvous import Arrival, RegistrationError, Rendezvous

pytestmark = pytest.mark.timeout(30)

PS, W0, W1 = TaskId("ps", 0), TaskId("worker", 0), TaskId("worker", 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _never() -> bool:
    return False


def test_the_barrier_holds_until_every_task_registered() -> None:
    rendezvous = Rendezvous([PS, W0, W1], timeout_s=30)
    got: list[tuple[ClusterSpec, int]] = []
    waiter = threading.Thread(target=lambda: got.append(rendezvous.wait(_never)), daemon=True)
    assert rendezvous.register(W1, "127.0.0.1:3", respawned=False) == Arrival.WAITING
    waiter.start()
    assert rendezvous.register(PS, "127.0.0.1:1", respawned=False) == Arrival.WAITING
    assert rendezvous.spec is None and not got
    assert rendezvous.register(W0, "127.0.0.1:2", respawned=False) == Arrival.ASSEMBLED
    waiter.join(10)
    spec, version = got[0]
    assert version == 1 == rendezvous.version
    assert spec == ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})


def test_a_respawned_task_on_a_new_address_makes_a_new_version() -> None:
    rendezvous = Rendezvous([W0, W1], timeout_s=30)
    rendezvous.register(W0, "127.0.0.1:2", respawned=False)
    rendezvous.register(W1, "127.0.0.1:3", respawned=False)
    assert rendezvous.register(W1, "127.0.0.1:3", respawned=True) == Arrival.REJOINED
    assert rendezvous.version == 1
    assert rendezvous.register(W1, "127.0.0.1:9", respawned=True) == Arrival.MOVED
    spec, version = rendezvous.current()
    assert version == 2 and spec is not None
    assert spec.task_address("worker", 1) == "127.0.0.1:9"
    assert spec.task_address("worker", 0) == "127.0.0.1:2"
    assert rendezvous.wait(_never) == (spec, 2)


def test_a_whole_restart_opens_a_new_barrier_and_counts_on() -> None:
    clock = Clock()
    rendezvous = Rendezvous([W0], timeout_s=5, clock=clock)
    rendezvous.register(W0, "127.0.0.1:2", respawned=False)
    clock.now += 60
    rendezvous.reopen()
    assert rendezvous.spec is None and not rendezvous.overdue()  # the timeout counts afresh
    assert rendezvous.register(W0, "127.0.0.1:4", respawned=False) == Arrival.ASSEMBLED
    assert rendezvous.version == 2


def test_a_barrier_past_its_timeout_is_overdue_and_refuses_waiters() -> None:
    clock = Clock()
    rendezvous = Rendezvous([W0, W1], timeout_s=5, clock=clock)
    rendezvous.register(W0, "127.0.0.1:2", respawned=False)
    assert not rendezvous.overdue()
    clock.now += 6
    assert rendezvous.overdue()
    with pytest.raises(RegistrationError, match="in time"):
        rendezvous.wait(_never)


def test_closing_releases_waiters_and_refuses_registrations() -> None:
    rendezvous = Rendezvous([W0, W1], timeout_s=30)
    rendezvous.register(W0, "127.0.0.1:2", respawned=False)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            rendezvous.wait(_never)
        except RegistrationError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    rendezvous.close()
    waiter.join(10)
    assert not waiter.is_alive() and "stopping" in str(errors[0])
    with pytest.raises(RegistrationError, match="stopping"):
        rendezvous.register(W1, "127.0.0.1:3", respawned=False)


def test_a_stop_request_ends_the_wait() -> None:
    rendezvous = Rendezvous([W0, W1], timeout_s=30)
    with pytest.raises(RegistrationError, match="stopping"):
        rendezvous.wait(lambda: True)


def test_a_task_outside_the_cluster_is_refused() -> None:
    with pytest.raises(RegistrationError, match="worker:1 is not part"):
        Rendezvous([W0], timeout_s=30).register(W1, "127.0.0.1:3", respawned=False)
