"""In-graph model parallelism under ``clusterflow start --chief --workers 1``.

The chief builds part of its model under ``cf.device("/job:worker/task:0")``; that part
runs on worker:0 (which only serves, ``serve_worker()``), its activations sent there and
its gradients back over clusterflow's RPC. It must train exactly as the same model in
one process, run in the worker's process, and the run must end when the chief's does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]

JOB = """
import os
import torch
from torch import nn
import clusterflow as cf
from clusterflow.strategies.pipeline import PipelineError

torch.set_num_threads(1)
if cf.TFConfig.from_env().task.job == "worker":
    print("serving pid", os.getpid(), flush=True)
    cf.strategies.serve_worker()
    raise SystemExit(0)


class WhereAmI(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x[:, :1] * 0 + self.w + float(os.getpid())


def build(place):
    torch.manual_seed(0)
    def body():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    if place:
        with cf.device("/job:worker/task:0"):
            first = body()
    else:
        first = body()
    return nn.Sequential(first, nn.Linear(16, 3))


with cf.device("/job:worker/task:0"):
    probe = WhereAmI()
print("probe ran in pid", int(probe(torch.zeros(2, 3))[0, 0].item()), flush=True)
placed, local = build(True), build(False)
assert type(placed[0]).__name__ == "PlacedSequential", type(placed[0])
optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (placed, local)]
gen = torch.Generator().manual_seed(1)
for _ in range(4):
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    for model, optimizer in zip((placed, local), optimizers):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
diff = max((a - b).abs().max().item() for a, b in zip(placed.parameters(), local.parameters()))
grads = max((a.grad - b.grad).abs().max().item()
            for a, b in zip(placed.parameters(), local.parameters()))
with torch.no_grad():
    x = torch.randn(5, 8, generator=gen)
    evaluated = (placed(x) - local(x)).abs().max().item()
print(f"differences params {diff} grads {grads} eval {evaluated}", flush=True)
try:
    placed[0](x, x)
except PipelineError as exc:
    print("error:", exc, flush=True)
"""


def test_a_placed_module_runs_on_its_task_and_trains_as_it_would_here(
    cf: Clusterflow, tmp_path: Path
) -> None:
    script = cf.script("job.py", JOB)
    done = cf.run(
        "start", "--chief", "--workers", "1", "--", sys.executable, str(script), timeout=150
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    serving = re.search(r"\[worker:0\] serving pid (\d+)", out)
    ran = re.search(r"\[chief:0\] probe ran in pid (\d+)", out)
    assert serving and ran, out[-3000:]
    assert ran.group(1) == serving.group(1)  # the module ran in worker:0's process
    found = re.search(r"differences params (\S+) grads (\S+) eval (\S+)", out)
    assert found, out[-3000:]
    assert all(float(v) < 1e-6 for v in found.groups()), found.group(0)
    assert "error: a placed Sequential takes one tensor argument; got 2" in out
