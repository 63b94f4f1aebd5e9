"""``python -m clusterflow.ps`` answers no one before its methods are registered and its
shard restored (ps/__main__.py): a worker forked warm calls within milliseconds."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from clusterflow.ps import __main__ as ps_main
from clusterflow.rpc import Credentials, RpcClient
from clusterflow.rpc.errors import DeadlineExceeded


@pytest.mark.timeout(60)
def test_the_ps_serves_only_once_registered_and_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as probe:  # a free port for the ps's address
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    credentials = Credentials.generate()
    secret = tmp_path / "secret"
    credentials.to_file(secret)
    cluster = {"ps": [f"127.0.0.1:{port}"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})
    )
    monkeypatch.setenv("CLUSTERFLOW_SECRET_FILE", str(secret))
    monkeypatch.delenv("CLUSTERFLOW_LISTEN_FD", raising=False)
    client = RpcClient(f"tcp://127.0.0.1:{port}", credentials)
    seen: dict[str, Any] = {}

    def restoring(*args: Any, **kwargs: Any) -> None:
        # A worker's first call, while the ps still restores: it must wait, not be
        # answered (no method yet, or values not yet restored).
        try:
            seen["during"] = client.call("ps.stats", deadline=1.0).body
        except DeadlineExceeded:
            seen["during"] = "waited"

    def serving(server: Any, banner: str) -> int:
        # The call queued during the restore is answered now; so is the next.
        seen["after"] = client.call("ps.stats", deadline=30.0).body
        server.stop()
        return 0

    monkeypatch.setattr(ps_main, "restore_shard", restoring)
    monkeypatch.setattr(ps_main, "serve_until_signalled", serving)
    try:
        assert ps_main.main() == 0
    finally:
        client.close()
    assert seen["during"] == "waited", seen
    assert seen["after"] == {"version": 0}, seen  # a fresh ps: nothing pushed yet
