"""A restart uses the newest intact checkpoint, end to end under ``clusterflow start``.

The newest checkpoint is damaged before the restart (a part cut short, a byte flipped,
the manifest removed): the manager must hand every task the one before it
(``CLUSTERFLOW_RESTORE``), never the damaged one, including when it had verified and
remembered the newest at an earlier restart and the bytes changed afterwards. And the
data service's cursor comes back from that checkpoint with it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

PY = sys.executable

JOB = """
import os, sys
from clusterflow.checkpoint import MANIFEST_FILE, CheckpointStorage

how = sys.argv[1]
storage = CheckpointStorage(os.environ["CLUSTERFLOW_CHECKPOINT_DIR"])
attempt = int(os.environ["CLUSTERFLOW_ATTEMPT"])
print(f"attempt {attempt} restore {os.environ.get('CLUSTERFLOW_RESTORE')}", flush=True)


def damage(step, how):
    folder = storage.directory(step)
    if how == "manifest":
        os.remove(os.path.join(folder, MANIFEST_FILE))
        return
    path = os.path.join(folder, storage.at(step).parts["state"].file)
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[:-1]
    else:  # flip one byte; the size stays, only the sha256 can tell
        data[len(data) // 2] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)


if attempt == 0:
    for step in (1, 2):
        writer = storage.writer(step)
        writer.commit([writer.write_json("state", {"step": step, "pad": "x" * 256})])
    if how != "after-verified":
        damage(2, how)
    sys.exit(1)  # a failure: the manager restarts every task from a checkpoint
if attempt == 1 and how == "after-verified":
    # The manager verified checkpoint 2 for this restart; now its bytes change.
    damage(2, "flip")
    sys.exit(1)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["truncate", "flip", "manifest", "after-verified"])
def test_a_restart_uses_the_newest_intact_checkpoint(
    cf: Clusterflow, how: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    script = cf.script("job.py", JOB)
    ckpt = tmp_path_factory.mktemp("ckpt")
    done = cf.run(
        "start", "--workers", "1", "--max-restarts", "2", "--checkpoint-dir", str(ckpt),
        "--", PY, str(script), how,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    attempts = [line for line in done.stdout.splitlines() if " attempt " in line]
    if how == "after-verified":
        expected = ["attempt 0 restore None", "attempt 1 restore 2", "attempt 2 restore 1"]
    else:
        expected = ["attempt 0 restore None", "attempt 1 restore 1"]
    assert attempts == [f"[worker:0] {line}" for line in expected], done.stdout[-3000:]


CURSOR_JOB = """
import os, sys
import torch
from clusterflow.checkpoint import CheckpointStorage
from clusterflow.data import distributed_dataset

out = sys.argv[1]
attempt = int(os.environ["CLUSTERFLOW_ATTEMPT"])
data = distributed_dataset(
    {"id": torch.arange(100)}, batch_size=10, split_size=10, seed=5, epochs=1,
    auto_ack=False, prefetch=2,
)
batches = iter(data)


def take(n):
    ids = []
    for _ in range(n):
        batch = next(batches)
        data.ack_through(batch)  # its update is applied
        ids += [int(i) for i in batch.data["id"]]
    return ids


if attempt == 0:
    learnt = take(3)
    storage = CheckpointStorage(os.environ["CLUSTERFLOW_CHECKPOINT_DIR"])
    writer = storage.writer(1)  # the chief's cut: the cursor with what the model learnt
    writer.commit([writer.write_json("data", data.state_dict())])
    take(2)  # learnt after the cut: lost with the restart, so to be read again
    with open(os.path.join(out, "cut"), "w") as f:
        f.write(" ".join(map(str, learnt)))
    os._exit(1)  # dies: the manager restarts every task from checkpoint 1
ids = []
for batch in batches:
    data.ack_through(batch)
    ids += [int(i) for i in batch.data["id"]]
with open(os.path.join(out, "after"), "w") as f:
    f.write(" ".join(map(str, ids)))
data.close()
"""


@pytest.mark.timeout(150)
def test_a_whole_restart_reads_the_data_cursor_back_from_the_checkpoint(
    cf: Clusterflow, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Pins ``Recovery._choose_checkpoint``'s ``self.data.reset(point.cursor)`` (with
    ``RestorePoints.newest`` reading the cursor, ``RestorePoint.cursor``): after a whole
    restart the data service hands out exactly the records the checkpoint's cursor had
    not acked, so the checkpoint's 30 records and the restarted run's together are every
    record once. The 20 acked after the cut are read again (their updates died with the
    attempt). Resetting the dispatcher to nothing hands out all 100 again; not resetting
    it keeps the dead attempt's acks and loses those 20: either fails here."""
    script = cf.script("job.py", CURSOR_JOB)
    ckpt = tmp_path_factory.mktemp("ckpt")
    out = tmp_path_factory.mktemp("out")
    done = cf.run(
        "start", "--workers", "1", "--max-restarts", "1", "--checkpoint-dir", str(ckpt),
        "--", PY, str(script), str(out),
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cut = [int(i) for i in (out / "cut").read_text().split()]
    after = [int(i) for i in (out / "after").read_text().split()]
    assert len(cut) == 30
    assert sorted(cut + after) == list(range(100)), (sorted(cut), sorted(after))
