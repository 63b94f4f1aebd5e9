"""The dashboard's access rules (``ui/access.py``) and what its pages read (``ui/views.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterflow.checkpoint import CheckpointStorage
from clusterflow.errors import ConfigError
from clusterflow.manager import registry
from clusterflow.manager.state import ClusterState, TaskState
from clusterflow.ui import views
from clusterflow.ui.access import COOKIE, Access, is_loopback

TOKEN = "t" * 32


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("example.com", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_on_loopback_reading_is_free_and_acting_needs_the_token() -> None:
    access = Access("127.0.0.1", TOKEN)
    assert access.may_read(None)
    assert not access.may_act(None)
    assert not access.may_act("t" * 31 + "x")
    assert access.may_act(TOKEN)


def test_off_loopback_reading_needs_the_token() -> None:
    access = Access("0.0.0.0", TOKEN)
    assert not access.may_read(None)
    assert not access.may_read("wrong")
    assert access.may_read(TOKEN)


def test_the_token_is_found_in_a_header_the_query_or_the_cookie() -> None:
    access = Access("0.0.0.0", TOKEN)
    assert access.presented({"authorization": f"Bearer {TOKEN}"}, {}) == TOKEN
    assert access.presented({}, {"token": TOKEN}) == TOKEN
    assert access.presented({"cookie": f"a=b; {COOKIE}={TOKEN}"}, {}) == TOKEN
    assert access.presented({"cookie": "a=b"}, {}) is None


@pytest.mark.parametrize(
    ("header", "allowed"),
    [
        ("127.0.0.1:8265", True),
        ("localhost:8265", True),
        ("[::1]:8265", True),
        ("localhost", True),
        ("evil.example:8265", False),
        ("127.0.0.1.evil.example", False),
        (None, False),
    ],
)
def test_on_loopback_only_loopback_host_names_are_answered(
    header: str | None, allowed: bool
) -> None:
    assert Access("127.0.0.1", TOKEN).host_allowed(header) is allowed
    assert Access("0.0.0.0", TOKEN).host_allowed(header)  # the token guards it there


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="16 characters"):
        Access("127.0.0.1", "short")


@pytest.mark.parametrize("bad", ["nope", "", ".", "..", "a/b", "x" * 400])
def test_an_unknown_or_impossible_id_is_unknown(home: Path, bad: str) -> None:
    registry.create("abcdef0123")
    with pytest.raises(views.UnknownCluster):
        views.find(bad)
    with pytest.raises(views.UnknownCluster):
        views.find("abcd")  # a prefix is enough for the CLI, never for a URL


def test_the_detail_reads_state_events_checkpoints_and_tensorboard(
    home: Path, tmp_path: Path
) -> None:
    cluster = registry.create("abcdef0123")
    ckpt = tmp_path / "ckpt"
    cluster.write_state(
        ClusterState(
            id=cluster.id,
            status="succeeded",
            created=100.0,
            ended=160.0,
            checkpoint_dir=str(ckpt),
            tasks=(
                TaskState(task="worker:0", status="succeeded", exit_code=0, step=7, loss=0.5),
                TaskState(task="worker:1", status="succeeded", exit_code=0, restarts=2),
            ),
        )
    )
    cluster.append_event("starting", tasks=["worker:0", "worker:1"])
    writer = CheckpointStorage(str(ckpt)).writer(7)
    writer.commit([writer.write_json("data", {"cursor": 1})])
    (cluster.path / "tensorboard").write_text("/runs/tb\n")
    cluster.task_log("worker:1").write_text("x" * 20000 + "\nlast line\n")

    detail = views.cluster_detail(views.find(cluster.id))
    assert detail["status"] == "succeeded" and detail["age_s"] == 60.0
    assert [t["task"] for t in detail["tasks"]] == ["worker:0", "worker:1"]
    assert detail["tasks"][0]["step"] == 7 and detail["tasks"][1]["restarts"] == 2
    assert [e["event"] for e in detail["events"]] == ["starting"]
    assert [c["step"] for c in detail["checkpoints"]] == [7]
    assert detail["tensorboard_dir"] == "/runs/tb"
    tails = views.log_tails(cluster, ["worker:0", "worker:1"])
    assert tails["worker:0"] == ""
    assert tails["worker:1"].endswith("last line\n")
    assert len(tails["worker:1"]) <= views.LOG_TAIL_BYTES
