"""``FenceBook`` (rpc/fencing.py): who may still be served, and when a raised fence holds.

A fence raised at a relaunch must hold for what is already inside: ``raise_to`` with a
wait returns only once no request of an older incarnation is being served, so nothing
of the old launch applies after the manager's ``ps.fence`` answered.
"""

from __future__ import annotations

import threading

import pytest

from clusterflow.rpc import ProtocolError, Request
from clusterflow.rpc.fencing import FenceBook, TaskFenced


def _request(fence: object) -> Request:
    return Request("ps.push", {"fence": fence, "x": 1}, {}, b"peer", False)


def test_a_raised_fence_waits_for_the_old_incarnations_request_being_served() -> None:
    book = FenceBook()
    inside, release = threading.Event(), threading.Event()
    seen: list[object] = []

    def apply(request: Request) -> str:
        seen.append(request.body)
        inside.set()
        release.wait(30)
        return "applied"

    guarded = book.guard(apply)
    old = threading.Thread(target=lambda: guarded(_request(["worker:0", 0])), daemon=True)
    old.start()
    assert inside.wait(30)
    assert seen == [{"x": 1}]  # the handler never sees the fence

    assert book.raise_to("worker:0", 1, wait_s=0.05) == 1  # still applying
    with pytest.raises(TaskFenced, match="worker:0 incarnation 0 is fenced"):
        guarded(_request(["worker:0", 0]))  # but nothing new of it gets in
    release.set()
    assert book.raise_to("worker:0", 1, wait_s=30) == 0
    old.join(30)
    assert book.counts("worker:0") == {"admitted": {0: 1}, "refused": {0: 1}}
    assert guarded(_request(["worker:0", 1])) == "applied"
    assert book.highest("worker:0") == 1


def test_other_tasks_and_newer_incarnations_are_not_waited_for() -> None:
    book = FenceBook()
    inside, release = threading.Event(), threading.Event()

    def hold(request: Request) -> None:
        inside.set()
        release.wait(30)

    guarded = book.guard(hold)
    other = threading.Thread(target=lambda: guarded(_request(["worker:1", 0])), daemon=True)
    other.start()
    assert inside.wait(30)
    try:
        assert book.raise_to("worker:0", 1, wait_s=0) == 0
    finally:
        release.set()
        other.join(30)


@pytest.mark.parametrize("fence", [["worker:0"], ["worker:0", "1"], [0, 1], ["worker:0", True]])
def test_a_malformed_fence_is_refused_before_the_handler(fence: object) -> None:
    book = FenceBook()
    guarded = book.guard(lambda request: pytest.fail("the handler ran"))
    with pytest.raises(ProtocolError, match="malformed fence"):
        guarded(_request(fence))
