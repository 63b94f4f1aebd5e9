"""Which checkpoint the manager hands relaunched tasks (manager/restore.py).

The end-to-end proof is tests/integration/test_restart_checkpoint.py; these are the
same cases without processes, plus the respawn's cheap path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clusterflow.checkpoint import MANIFEST_FILE, CheckpointStorage
from clusterflow.manager.restore import RestorePoints


def _commit(storage: CheckpointStorage, step: int) -> None:
    writer = storage.writer(step)
    writer.commit([writer.write_json("state", {"step": step, "pad": "x" * 64})])


def _damage(storage: CheckpointStorage, step: int, how: str) -> None:
    folder = storage.directory(step)
    if how == "manifest":
        os.remove(os.path.join(folder, MANIFEST_FILE))
        return
    manifest = storage.at(step)
    assert manifest is not None
    path = Path(folder) / manifest.parts["state"].file
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[:-1]
    else:
        data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def storage(tmp_path: Path) -> CheckpointStorage:
    storage = CheckpointStorage(tmp_path / "ckpt")
    _commit(storage, 1)
    _commit(storage, 2)
    return storage


@pytest.mark.parametrize("how", ["truncate", "flip", "manifest"])
def test_a_damaged_newest_checkpoint_gives_the_one_before(
    storage: CheckpointStorage, how: str
) -> None:
    points = RestorePoints(storage.url)
    _damage(storage, 2, how)
    assert points.newest(with_cursor=True).step == "1"
    assert points.newest(with_cursor=False).step == "1"


def test_a_whole_restart_verifies_again_what_was_verified_before(
    storage: CheckpointStorage,
) -> None:
    points = RestorePoints(storage.url)
    assert points.newest(with_cursor=True).step == "2"  # verified, and remembered
    _damage(storage, 2, "flip")  # the size stays: only the sha256 can tell
    assert points.newest(with_cursor=True).step == "1"


def test_a_respawn_trusts_the_checkpoint_verified_before(storage: CheckpointStorage) -> None:
    # One task's respawn must stay cheap; the task itself checks each part as it reads.
    points = RestorePoints(storage.url)
    assert points.newest(with_cursor=False).step == "2"
    _damage(storage, 2, "flip")
    assert points.newest(with_cursor=False).step == "2"
    _damage(storage, 2, "truncate")  # a size that differs is seen without reading
    assert points.newest(with_cursor=False).step == "1"


def test_no_checkpoint_and_an_unreadable_storage(tmp_path: Path) -> None:
    assert RestorePoints(str(tmp_path / "none")).newest(with_cursor=True).step is None
    (tmp_path / "file").write_text("not a folder")
    point = RestorePoints(str(tmp_path / "file" / "ckpt")).newest(with_cursor=True)
    assert point.step is None
