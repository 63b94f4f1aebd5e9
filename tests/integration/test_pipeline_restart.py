"""A killed pipeline stage restarts the whole cluster from the last checkpoint, under
``clusterflow start`` (the all-reduce row of docs/architecture.md section 6).

Two workers are the two stages of a 1F1B pipeline saving every 2 steps; in the first
attempt worker:1 SIGKILLs itself after step 5. The manager restarts both tasks from the
checkpoint at step 4, each stage loads its own part, and the run ends with the
parameters of an uninterrupted one-process run on the same global batches.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

from clusterflow import fit

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

JOB = """
import os, signal, sys
import torch
from torch import nn
import clusterflow as cf

class KillStage1(cf.Hook):
    def after_step(self, session, info):
        if (session.step == 5 and os.environ["CLUSTERFLOW_ATTEMPT"] == "0"
                and os.environ["RANK"] == "1"):
            os.kill(os.getpid(), signal.SIGKILL)

torch.set_num_threads(1)
gen = torch.Generator().manual_seed(7)
x, y = torch.randn(48, 6, generator=gen), torch.randint(0, 3, (48,), generator=gen)
strategy = cf.PipelineStrategy("1f1b", microbatches=2)
with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
print("attempt", os.environ["CLUSTERFLOW_ATTEMPT"], "restore",
      os.environ.get("CLUSTERFLOW_RESTORE"), flush=True)
cf.fit(model, nn.CrossEntropyLoss(), optimizer, (x, y), strategy=strategy, epochs=2,
       global_batch_size=8, seed=1, hooks=[cf.Checkpoint(every_steps=2), KillStage1()])
if strategy.is_chief:
    torch.save([p.detach() for p in model.parameters()], sys.argv[1])
"""


@pytest.mark.timeout(200)
def test_a_killed_stage_restarts_the_cluster_from_the_last_checkpoint(
    cf: Clusterflow, tmp_path: Path
) -> None:
    script = cf.script("job.py", JOB)
    out = tmp_path / "params.pt"
    done = cf.run(
        "start", "--workers", "2", "--max-restarts", "1", "--checkpoint-dir",
        str(tmp_path / "ckpt"), "--", sys.executable, str(script), str(out),
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    attempts = sorted(line for line in done.stdout.splitlines() if " attempt " in line)
    assert attempts == [
        "[worker:0] attempt 0 restore None",
        "[worker:0] attempt 1 restore 4",
        "[worker:1] attempt 0 restore None",
        "[worker:1] attempt 1 restore 4",
    ], done.stdout[-3000:]

    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(48, 6, generator=gen), torch.randint(0, 3, (48,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    fit(model, nn.CrossEntropyLoss(), optimizer, (x, y), epochs=2, global_batch_size=8, seed=1)
    got = torch.load(out)
    for a, b in zip(got, model.parameters(), strict=True):
        assert torch.allclose(a, b.detach(), atol=1e-5)
    assert os.path.isdir(tmp_path / "ckpt")
