"""The ``worker.*`` wire contract: what one end writes, the other reads; the rest is refused."""

from __future__ import annotations

import msgpack
import pytest

from clusterflow.strategies.coordinator.protocol import (
    CallReply,
    CallState,
    ErrorReport,
    MalformedMessage,
    ResultRequest,
    RunRequest,
    WorkerInfo,
    digest_of,
)


def through_the_wire(body: object) -> object:
    """As the RPC layer carries a body: msgpack, bytes kept as bytes."""
    return msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False)


@pytest.mark.parametrize("payload", [None, b"fn-bytes"])
def test_a_run_request_reads_back_as_written(payload: bytes | None) -> None:
    run = RunRequest(
        call="c.1.1.0",
        fn=digest_of(b"fn-bytes"),
        args=b"args",
        inputs=[b"i0", b"i1"],
        wait=1.0,
        payload=payload,
    )
    wire = run.to_wire()
    assert ("payload" in wire) == (payload is not None)  # the function travels only once
    assert RunRequest.from_wire(through_the_wire(wire)) == run
    poll = ResultRequest(call="c.1.1.0", wait=0.5)
    assert ResultRequest.from_wire(through_the_wire(poll.to_wire())) == poll


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (None, "must be a map"),
        ({"fn": "d", "args": b"a", "inputs": []}, "'call'"),
        ({"call": "c", "fn": "d", "args": "not bytes", "inputs": []}, "'args'"),
        ({"call": "c", "fn": "d", "args": b"a", "inputs": ["x"]}, "inputs as bytes"),
        ({"call": "c", "fn": "d", "args": b"a", "payload": 3}, "function as bytes"),
    ],
)
def test_a_run_request_off_the_contract_is_refused(body: object, match: str) -> None:
    with pytest.raises(MalformedMessage, match=match):
        RunRequest.from_wire(body)


def test_replies_read_back_as_written() -> None:
    error = ErrorReport(type="ValueError", message="bad", traceback="tb", exception=b"exc")
    for reply in (
        CallReply(state=CallState.RUNNING),
        CallReply(state=CallState.DONE, value=b"result"),
        CallReply(state=CallState.FAILED, error=error),
        CallReply(state=CallState.NEED_FUNCTION),
        CallReply(state=CallState.UNKNOWN),
    ):
        assert CallReply.from_wire(through_the_wire(reply.to_wire())) == reply
    info = WorkerInfo(incarnation="abc", task="worker:1", pid=42, executed=7)
    assert WorkerInfo.from_wire(through_the_wire(info.to_wire())) == info


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"state": "exploded"}, "unknown state"),
        ({"state": "done"}, "'value'"),
        ({"state": "failed", "error": "text"}, "'error'"),
    ],
)
def test_a_finished_call_without_its_result_is_refused(body: object, match: str) -> None:
    with pytest.raises(MalformedMessage, match=match):
        CallReply.from_wire(body)
