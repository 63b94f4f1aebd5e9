"""A checkpoint on a full disk (docs/failure-semantics.md, "Full disks").

A real, small filesystem (a 4 MiB tmpfs, mounted for the test and unmounted by the
fixture's finalizer) fills up in the middle of a part and in the middle of the
manifest. Either way nothing is committed: no manifest, torn or whole, is left behind;
the previous checkpoint stays the newest intact one and loads; the save raises one
``CheckpointWriteError`` line naming the checkpoint's folder (an ``OSError`` of errno
ENOSPC too); the torn part's space is given back; and once space is freed the next
checkpoint commits.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from clusterflow.checkpoint import MANIFEST_FILE, CheckpointStorage, CheckpointWriteError
from clusterflow.train.cut import Checkpointer, load_module

pytestmark = pytest.mark.integration

DISK = "4m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A fresh 4 MiB tmpfs; needs root (the suite's machines run as root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "hostile-full-disk", str(mount)],
        check=True,
        capture_output=True,
    )
    try:
        yield mount
    finally:
        # Lazy: a file a failed test left open must not keep the mount alive.
        subprocess.run(["umount", "-l", str(mount)], check=True, capture_output=True)


def _fill(disk: Path, leave: int) -> Path:
    """Takes all of the disk's free space but ``leave`` bytes."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(256, 256)  # a 257 KiB part


def test_a_part_that_does_not_fit_commits_nothing(small_disk: Path) -> None:
    directory = small_disk / "ckpt"
    model = _model()
    checkpointer = Checkpointer(model=model, directory=str(directory))
    checkpointer.save(1)
    first = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    filler = _fill(small_disk, leave=64 * 1024)

    with pytest.raises(CheckpointWriteError) as info:
        checkpointer.save(2)
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message, message
    assert str(directory / "ckpt-000000000002") in message, message
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC

    folder = directory / "ckpt-000000000002"
    assert not (folder / MANIFEST_FILE).exists()
    assert not [p for p in folder.iterdir() if p.name.startswith("model.")], list(folder.iterdir())
    storage = CheckpointStorage(str(directory))
    latest = storage.latest()
    assert latest is not None and latest.step == 1
    loaded = load_module(str(directory), _model)
    assert loaded is not None and loaded[1] == 1
    assert torch.equal(loaded[0].weight, first)

    # Space back: the run goes on, and the next checkpoint commits.
    filler.unlink()
    checkpointer.save(3)
    latest = storage.latest()
    assert latest is not None and latest.step == 3


def test_a_manifest_that_does_not_fit_is_never_torn(small_disk: Path) -> None:
    directory = small_disk / "ckpt"
    model = _model()
    Checkpointer(model=model, directory=str(directory)).save(1)
    storage = CheckpointStorage(str(directory))
    writer = storage.writer(2)
    part = writer.write_tensors("model", {"w": torch.ones(64, 64)})
    filler = _fill(small_disk, leave=0)

    with pytest.raises(CheckpointWriteError, match="cannot write the manifest of checkpoint"):
        writer.commit([part])
    folder = directory / "ckpt-000000000002"
    assert sorted(p.name for p in folder.iterdir() if "MANIFEST" in p.name) == []
    latest = storage.latest()
    assert latest is not None and latest.step == 1

    filler.unlink()
    writer.commit([part])
    latest = storage.latest()
    assert latest is not None and latest.step == 2
