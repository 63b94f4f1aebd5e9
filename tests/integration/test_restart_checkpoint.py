"""A restart uses the newest intact checkpoint, end to end under ``clusterflow start``.

The newest checkpoint is damaged before the restart (a part cut short, a byte flipped,
the manifest removed): the manager must hand every task the one before it
(``CLUSTERFLOW_RESTORE``), never the damaged one, including when it had verified and
remembered the newest at an earlier restart and the bytes changed afterwards.
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
