"""A checkpoint on a full disk (docs/failure-semantics.md, "Full disks").

A real, small filesystem (a 4 MiB tmpfs, mounted for the test and unmounted by the
fixture's finalizer) fills up in the middle of a part and in the middle of the
manifest. Either way nothing is committed: no manifest, torn or whole, is left behind;
the previous checkpoint stays the newest intact one and loads; the save raises one
``CheckpointWriteError`` line naming the checkpoint's folder (an ``OSError`` of errno
ENOSPC too); the torn part's space is given back; and once space is freed the next
checkpoint commits.

End to end, under ``clusterflow start``: a job whose checkpoint directory is a tmpfs
with room for one checkpoint commits step 1, and its save of step 2 runs out of space.
The task fails with that one line, the manager restarts it from step 1 (the newest
intact checkpoint), the restarted task fails the same way, and with no restart left the
run fails naming the task. Nothing of step 2 is left on the disk.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from clusterflow.checkpoint import MANIFEST_FILE, CheckpointStorage, CheckpointWriteError
from clusterflow.train.cut import Checkpointer, load_module

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

DISK = "4m"
ONE_CHECKPOINT_DISK = "400k"
"""100 pages: one checkpoint of ``JOB`` (72 pages: a 257 KiB model, RNG state, sidecars
and manifest) fits, a second does not."""


def _mount(mount: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` at ``mount``; needs root (the suite's machines run as root)."""
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "hostile-full-disk", str(mount)],
        check=True,
        capture_output=True,
    )
    try:
        yield mount
    finally:
        # Lazy: a file a failed test left open must not keep the mount alive.
        subprocess.run(["umount", "-l", str(mount)], check=True, capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs."""
    yield from _mount(tmp_path / "disk", DISK)


@pytest.fixture
def one_checkpoint_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with room for one checkpoint of ``JOB``."""
    yield from _mount(tmp_path / "tiny", ONE_CHECKPOINT_DISK)


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


JOB = """
import os
import torch
from clusterflow.train.cut import Checkpointer

torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
checkpointer = Checkpointer(model=model, optimizer=opt)  # CLUSTERFLOW_CHECKPOINT_DIR
start = checkpointer.restore() or 0
print(f"attempt {os.environ['CLUSTERFLOW_ATTEMPT']} restored {start}", flush=True)
x = torch.ones(4, 256)
for step in range(start + 1, 4):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    checkpointer.save(step)
    print(f"committed {step}", flush=True)
"""


def _after_one_step() -> torch.nn.Linear:
    """The job's model after step 1 (what checkpoint 1 must hold)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    model(torch.ones(4, 256)).sum().backward()
    with torch.no_grad():
        for param in model.parameters():
            assert param.grad is not None
            param.sub_(0.1 * param.grad)
    return model


@pytest.mark.timeout(180)
def test_a_run_whose_checkpoint_disk_fills_restarts_then_fails_naming_the_folder(
    cf: Clusterflow, one_checkpoint_disk: Path
) -> None:
    directory = one_checkpoint_disk / "ckpt"
    script = cf.script("job.py", JOB)
    done = cf.run(
        "start", "--workers", "1", "--max-restarts", "1", "--checkpoint-dir", str(directory),
        "--", sys.executable, str(script),
        timeout=150,
    )  # fmt: skip
    out = done.stdout.splitlines()
    detail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 1, detail

    # The task: one line naming the folder, at each of its two attempts.
    folder = directory / "ckpt-000000000002"
    error = (
        "[worker:0] clusterflow.checkpoint.manifest.CheckpointWriteError: cannot write part "
        f"'model' of checkpoint {folder}: No space left on device"
    )
    assert out.count(error) == 2, detail
    # The manager: a restart from the newest intact checkpoint, then the run fails.
    progress = [
        line for line in out if line.startswith(("[worker:0] attempt", "[worker:0] committed"))
    ]
    assert progress == [
        "[worker:0] attempt 0 restored 0",
        "[worker:0] committed 1",
        "[worker:0] attempt 1 restored 1",
    ], detail
    assert "clusterflow: task worker:0 exited with code 1; restarting every task" in out
    assert "failed: task worker:0 exited with code 1 (after 1 restart)" in done.stderr, detail
    events = [json.loads(line) for line in (cf.path(cf.only_id()) / "events.jsonl").open()]
    restarts = [e for e in events if e["event"] == "cluster_restarted"]
    assert [e["checkpoint"] for e in restarts] == ["1"], events

    # The disk: no manifest, torn or whole, and nothing else of step 2 either; step 1 is
    # the newest intact checkpoint and holds the model after one step.
    assert sorted(p.name for p in folder.iterdir()) == [], list(folder.iterdir())
    latest = CheckpointStorage(str(directory)).latest()
    assert latest is not None and latest.step == 1
    loaded = load_module(str(directory), lambda: torch.nn.Linear(256, 256))
    assert loaded is not None and loaded[1] == 1
    expected = _after_one_step()
    assert torch.equal(loaded[0].weight, expected.weight)
