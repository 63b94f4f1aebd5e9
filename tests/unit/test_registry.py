"""The on-disk registry: finding clusters by id prefix, state files, stale managers."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from clusterflow.errors import ConfigError
from clusterflow.manager import registry
from clusterflow.manager.registry import ClusterDir
from clusterflow.manager.state import ClusterState

pytestmark = pytest.mark.usefixtures("home")


def _me() -> dict[str, Any]:
    me = psutil.Process()
    return {"pid": me.pid, "create_time": me.create_time(), "address": "127.0.0.1:1"}


def test_home_is_created_owner_only(home: Path) -> None:
    assert registry.home() == home
    assert (home / "clusters").is_dir()
    assert stat.S_IMODE((home / "clusters").stat().st_mode) & 0o077 == 0


def test_create_makes_a_private_folder_with_its_files(home: Path) -> None:
    cluster = registry.create("abc123")
    assert cluster.path == home / "clusters" / "abc123"
    assert cluster.id == "abc123"
    assert stat.S_IMODE(cluster.path.stat().st_mode) == 0o700
    assert cluster.logs_dir.is_dir()
    assert cluster.task_log("worker:1") == cluster.logs_dir / "worker-1.log"
    assert cluster.state_file.name == "state.json"
    with pytest.raises(FileExistsError):
        registry.create("abc123")


def test_new_ids_are_distinct() -> None:
    ids = {registry.create().id for _ in range(20)}
    assert len(ids) == 20


def test_find_by_id_and_by_unique_prefix() -> None:
    a = registry.create("a1b2c3d4e5")
    b = registry.create("a1ffff0000")
    assert registry.find("a1b2c3d4e5") == a
    assert registry.find("a1b") == a
    assert registry.find("a1f") == b


def test_an_exact_id_wins_over_a_longer_one_it_prefixes() -> None:
    short = registry.create("abc")
    registry.create("abcdef")
    assert registry.find("abc") == short


def test_an_ambiguous_prefix_names_every_match() -> None:
    registry.create("a1b2c3d4e5")
    registry.create("a1ffff0000")
    with pytest.raises(ConfigError, match="ambiguous: a1b2c3d4e5, a1ffff0000"):
        registry.find("a1")


@pytest.mark.parametrize("bad", ["", "a/b", "../x", ".hidden", "x" * 300, "\u20ac" * 100])
def test_invalid_ids_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid cluster id"):
        registry.find(bad)


def test_an_unknown_id_is_a_config_error() -> None:
    registry.create("a1b2c3d4e5")
    with pytest.raises(ConfigError, match="no cluster 'ff'"):
        registry.find("ff")


def test_all_clusters_newest_first_by_creation_not_by_last_write() -> None:
    old, new = registry.create("old0000000"), registry.create("new0000000")
    for cluster, when in ((old, 1_000_000), (new, 2_000_000)):
        cluster.config_file.write_text("{}")
        os.utime(cluster.config_file, (when, when))
    old.write_state(ClusterState(id=old.id, status="running"))  # must not reorder them
    assert [c.id for c in registry.all_clusters()] == ["new0000000", "old0000000"]


def test_read_state_of_a_new_cluster_reads_created() -> None:
    cluster = registry.create("abc")
    assert cluster.read_state() == ClusterState(id="abc", status="created", tasks=())


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_an_unreadable_state_is_a_config_error(content: str) -> None:
    cluster = registry.create("abc")
    cluster.state_file.write_text(content)
    with pytest.raises(ConfigError, match="cluster abc"):
        cluster.read_state()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "folder"
    path.mkdir()
    return path


def test_write_json_atomic_replaces_and_leaves_no_temporary(folder: Path) -> None:
    path = folder / "state.json"
    registry.write_json_atomic(path, {"a": 1})
    registry.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in folder.iterdir()] == ["state.json"]


def test_write_json_atomic_failure_keeps_the_old_file(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = folder / "state.json"
    registry.write_json_atomic(path, {"a": 1})

    def broken_replace(src: object, dst: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        registry.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in folder.iterdir()] == ["state.json"]
    with pytest.raises(TypeError):
        registry.write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}


def test_write_json_atomic_syncs_the_new_bytes_before_the_rename(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the rename must find the new bytes, not an empty file: the temporary
    file, whole, is fsynced before ``os.replace`` puts it in place."""
    path = folder / "state.json"
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        assert json.loads(Path(src).read_text()) == {"a": 1}
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    registry.write_json_atomic(path, {"a": 1})
    assert [e[0] for e in events] == ["fsync", "replace"]
    assert events[0][1] == events[1][1]  # the file synced is the file renamed


def test_readers_never_see_a_torn_state_while_writers_race(folder: Path) -> None:
    path = folder / "state.json"
    big = {"tasks": [{"task": f"worker:{i}", "log": "x" * 200} for i in range(200)]}
    registry.write_json_atomic(path, {**big, "n": -1})
    stop = threading.Event()
    writing = threading.Event()
    errors: list[BaseException] = []
    progress = threading.Condition()
    reads: list[int] = []  # what each read saw, for the reads made while writers ran

    def write(offset: int) -> None:
        try:
            assert writing.wait(10)
            for n in range(50):
                registry.write_json_atomic(path, {**big, "n": offset + n})
                # Paced by the reader: every write is followed by a read that overlaps
                # the other writers' writes, however the threads are scheduled.
                with progress:
                    seen = len(reads)
                    progress.wait_for(lambda seen=seen: len(reads) > seen or errors, 10)  # type: ignore[misc]
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        while not stop.is_set():
            try:
                state = json.loads(path.read_text())
                assert len(state["tasks"]) == 200
            except BaseException as exc:
                with progress:
                    errors.append(exc)
                    progress.notify_all()
                return
            if writing.is_set():
                with progress:
                    reads.append(state["n"])
                    progress.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    writers = [threading.Thread(target=write, args=(k * 1000,), daemon=True) for k in range(3)]
    for w in writers:
        w.start()
    writing.set()
    for w in writers:
        w.join(60)
    stop.set()
    reader.join(10)
    assert not errors
    assert not reader.is_alive() and not any(w.is_alive() for w in writers)
    # The reads raced the writes: one at least after each write, and they saw the
    # writers' values change under them (not one file read over and over).
    assert len(reads) >= 3 * 50, len(reads)
    assert len({n for n in reads if n >= 0}) >= 50, sorted(set(reads))
    assert [p.name for p in folder.iterdir()] == ["state.json"]


def test_events_round_trip_and_skip_torn_lines() -> None:
    cluster = registry.create("abc")
    cluster.append_event("starting", tasks=["worker:0"])
    with cluster.events_file.open("a") as f:
        f.write('{"torn": \n')
    cluster.append_event("succeeded", exit_code=0)
    events = cluster.read_events()
    assert [e["event"] for e in events] == ["starting", "succeeded"]
    assert events[0]["tasks"] == ["worker:0"] and events[1]["exit_code"] == 0


def test_read_config_of_a_missing_file_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unreadable config"):
        registry.create("abc").read_config()


# effective_status: a live status needs a live manager -----------------------------------


@pytest.mark.parametrize("final", ["succeeded", "failed", "stopped"])
def test_final_statuses_need_no_manager(final: str) -> None:
    assert registry.effective_status({"status": final, "manager": {"pid": 0}}) == final


def test_created_is_created() -> None:
    assert registry.effective_status({}) == "created"
    assert registry.effective_status({"status": "created"}) == "created"


def test_a_live_manager_keeps_its_status() -> None:
    assert registry.effective_status({"status": "running", "manager": _me()}) == "running"
    assert registry.effective_status({"status": "starting", "manager": _me()}) == "starting"


def test_a_dead_manager_reads_stale() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(child.pid).create_time()
    child.wait()
    state = {"status": "running", "manager": {"pid": child.pid, "create_time": created}}
    assert registry.effective_status(state) == "stale"


def test_a_zombie_manager_reads_stale() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        proc = psutil.Process(child.pid)
        created = proc.create_time()
        # Exited but not reaped (nobody waits for it yet): only look at its status.
        deadline = time.monotonic() + 30
        while proc.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        state = {"status": "running", "manager": {"pid": child.pid, "create_time": created}}
        assert registry.effective_status(state) == "stale"
    finally:
        child.wait()


def test_a_reused_pid_reads_stale() -> None:
    me = _me()
    state = {"status": "running", "manager": {**me, "create_time": me["create_time"] - 3600}}
    assert registry.effective_status(state) == "stale"


def test_no_manager_recorded_reads_stale() -> None:
    assert registry.effective_status({"status": "running"}) == "stale"
    assert registry.effective_status({"status": "running", "manager": {"pid": None}}) == "stale"


def test_process_alive() -> None:
    assert registry.process_alive(os.getpid(), None)
    assert registry.process_alive(os.getpid(), psutil.Process().create_time())
    assert not registry.process_alive(None, None)
    assert not registry.process_alive(0, None)


def test_clusterdir_is_a_value() -> None:
    assert ClusterDir(Path("/x/abc")) == ClusterDir(Path("/x/abc"))
    assert ClusterDir(Path("/x/abc")).id == "abc"
