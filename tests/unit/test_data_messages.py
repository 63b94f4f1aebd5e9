"""The ``data.*`` contract (``data/messages.py``): one type per message, both ends.

``DispatcherClient`` built its bodies by hand and ``DispatcherService`` read them by hand
(issue 29); each request now goes out and comes in through its type, and a body that
breaks the contract is ``MalformedBody`` by name before the dispatcher touches a lease.
"""

from __future__ import annotations

from typing import Any

import pytest

from clusterflow.data.api import DataError, DatasetSpec, Lease
from clusterflow.data.messages import (
    AckRequest,
    LeaseReply,
    LeaseRequest,
    RegisterRequest,
    ReleaseRequest,
    StatusRequest,
)
from clusterflow.rpc.errors import MalformedBody

SPEC = DatasetSpec(name="d", source="range://8", num_records=8, split_size=2)


@pytest.mark.parametrize(
    "request_",
    [
        RegisterRequest(spec=SPEC, locations=[[0, "n0"]]),
        LeaseRequest(name="d", worker="w", host="h", incarnation="1-ab", acks=(3, 4), count=2),
        LeaseRequest(name="d", worker="w"),
        AckRequest(name="d", leases=(1, 2), worker="w"),
        ReleaseRequest(worker="w", name="d", leases=(5,)),
        ReleaseRequest(worker="w"),
        StatusRequest(name="d"),
    ],
    ids=lambda r: type(r).__name__,
)
def test_each_request_comes_back_as_it_went(request_: Any) -> None:
    assert type(request_).from_wire(request_.to_wire()) == request_


def test_a_lease_reply_comes_back_as_it_went_and_a_one_lease_reader_sees_the_first() -> None:
    reply = LeaseReply("lease", (Lease(1, 0, 0, 2), Lease(2, 0, 2, 4)))
    body = reply.to_wire()
    assert LeaseReply.from_wire(body) == reply
    assert body["lease"] == [1, 0, 0, 2]
    assert LeaseReply.from_wire(LeaseReply("wait", retry_s=0.5).to_wire()).retry_s == 0.5
    assert "last" not in body  # sent only when true
    last = LeaseReply("lease", (Lease(3, 0, 4, 6),), last=True)
    assert LeaseReply.from_wire(last.to_wire()) == last


def test_a_lease_reply_whose_last_is_not_a_bool_is_refused() -> None:
    with pytest.raises(DataError, match="'last' must be true or false, got 'yes'"):
        LeaseReply.from_wire({"status": "lease", "lease": [1, 0, 0, 2], "last": "yes"})


@pytest.mark.parametrize(
    ("parse", "body", "words"),
    [
        (LeaseRequest.from_wire, [1, 2], "data.lease body must be a map"),
        (LeaseRequest.from_wire, {"name": "d", "worker": ""}, "a worker name is required"),
        (LeaseRequest.from_wire, {"name": 3, "worker": "w"}, "needs a dataset name"),
        (LeaseRequest.from_wire, {"name": "d", "worker": "w", "acks": [1.5]}, "integer lease ids"),
        (AckRequest.from_wire, {"name": "d", "leases": "1"}, "integer lease ids"),
        (ReleaseRequest.from_wire, {"worker": "w", "leases": [1]}, "needs the dataset's name"),
        (ReleaseRequest.from_wire, {"worker": "w", "name": "d", "leases": 1}, "integer lease ids"),
        (StatusRequest.from_wire, {}, "needs a dataset name"),
        (RegisterRequest.from_wire, {"spec": SPEC.to_wire(), "locations": 3}, "locations must"),
    ],
)
def test_a_body_breaking_the_contract_is_refused_by_name(parse: Any, body: Any, words: str) -> None:
    with pytest.raises(MalformedBody, match=words):
        parse(body)
