"""A request to a warm fork server keeps its deadline while it is sent
(``backends/forked.py``): a server that accepted the connection but never reads (busy,
or wedged in its imports) must not hold the caller, the manager's launch, forever."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest

from clusterflow.backends import forked


@pytest.fixture
def deaf_server() -> Iterator[str]:
    """A listening abstract socket whose connections are queued and never read."""
    name = f"clusterflow-test-deaf-{uuid.uuid4().hex[:12]}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(4)
    try:
        yield name
    finally:
        listener.close()


@pytest.mark.timeout(30)
def test_a_request_the_server_never_reads_fails_at_its_deadline(
    deaf_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forked, "CONNECT_S", 0.5)
    # An environment far larger than the socket's buffer: its send blocks on the reader.
    env = {f"VAR_{i}": "x" * 1000 for i in range(4000)}

    with pytest.raises(forked.Unavailable, match="timed out"):
        forked.fork_job(f"{deaf_server}:0", ["python", "-c", "pass"], env, "/")


@pytest.mark.timeout(30)
def test_a_server_whose_backlog_is_full_is_unavailable_not_waited_for(
    deaf_server: str,
) -> None:
    queued = []
    try:
        while True:  # fill the listener's backlog (4) with connections it never accepts
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            queued.append(sock)
            sock.connect("\0" + deaf_server)
    except BlockingIOError:
        pass
    finally:
        assert len(queued) > 1  # some were queued before the backlog was full
    try:
        # No pid to wait for (":0"), so no retry: at once, naming the server.
        with pytest.raises(forked.Unavailable, match=f"no warm process at {deaf_server}"):
            forked.fork_job(f"{deaf_server}:0", ["python", "-c", "pass"], {}, "/")
    finally:
        for sock in queued:
            sock.close()
