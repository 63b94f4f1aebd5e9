"""The ``cache.*`` contract (``data/cache_wire.py``): one type per message, both ends.

The server parsed ``cache.read`` and ``cache.load`` by hand and the reader built its
dict by hand (issue 29); a type now carries each, and a body that breaks it is refused
by name as ``MalformedBody`` before a server touches its partitions.
"""

from __future__ import annotations

from typing import Any

import pytest

from clusterflow.data.cache_wire import LoadReply, LoadRequest, ReadReply, ReadRequest
from clusterflow.rpc.errors import MalformedBody


def test_each_message_comes_back_as_it_went() -> None:
    read = ReadRequest(name="digits", partition=2, start=5, stop=9)
    assert ReadRequest.from_wire(read.to_wire()) == read
    assert ReadReply.from_wire(ReadReply(ipc=b"\x00\x01").to_wire()) == ReadReply(ipc=b"\x00\x01")
    load = LoadRequest(source="file:///d", parts=((0, 0, 10), (3, 10, 20)), limit=1 << 20)
    assert LoadRequest.from_wire(load.to_wire()) == load
    assert LoadRequest.from_wire({"source": "s", "parts": []}).limit is None
    reply = LoadReply(sizes={0: 640, 3: 128}, files={"node": "n0"})
    assert LoadReply.from_wire(reply.to_wire()) == reply


@pytest.mark.parametrize(
    ("parse", "body", "words"),
    [
        (ReadRequest.from_wire, {"name": 3, "partition": 0, "start": 0, "stop": 1}, "name must be"),
        (
            ReadRequest.from_wire,
            {"name": "c", "partition": -1, "start": 0, "stop": 1},
            "partition must be",
        ),
        (
            ReadRequest.from_wire,
            {"name": "c", "partition": 0, "start": True, "stop": 1},
            "start must be",
        ),
        (
            ReadRequest.from_wire,
            {"name": "c", "partition": 0, "start": 5, "stop": 1},
            "stop 1 is before start 5",
        ),
        (LoadRequest.from_wire, {"source": "", "parts": []}, "source must be"),
        (LoadRequest.from_wire, {"source": "s", "parts": [[0, 1]]}, "triples"),
        (LoadRequest.from_wire, {"source": "s", "parts": [[0, 1, "2"]]}, "triples"),
        (LoadRequest.from_wire, {"source": "s", "parts": [], "limit": 0.5}, "limit must be"),
        (ReadReply.from_wire, {"ipc": "text"}, "ipc must be bytes"),
    ],
)
def test_a_body_breaking_the_contract_is_refused_by_name(parse: Any, body: Any, words: str) -> None:
    with pytest.raises(MalformedBody, match=words):
        parse(body)
