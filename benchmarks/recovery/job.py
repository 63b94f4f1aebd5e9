"""The job the recovery benchmark kills: ``python benchmarks/recovery/job.py MODE OUT``.

``async``: a worker of an asynchronous parameter-server run (respawned alone when it
dies). ``allreduce``: a replica of MultiWorkerMirroredStrategy, checkpointing every 10
steps (the whole cluster restarts from the last checkpoint when one dies). Each applied
step appends ``task pid attempt wall_time`` to ``OUT/steps.log``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 100_000  # the benchmark stops the cluster long before


def log_step(out: Path) -> None:
    line = (
        f"{os.environ['CLUSTERFLOW_TASK']} {os.getpid()} "
        f"{os.environ.get('CLUSTERFLOW_ATTEMPT', '0')} {time.time():.6f}\n"
    )
    fd = os.open(out / "steps.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def main() -> None:
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    if mode == "async":
        from clusterflow.strategies.parameter_server import ParameterServerStrategy

        # No overlap: run() returns once the push is applied, so each line is an update.
        strategy = ParameterServerStrategy(mode="async", overlap_push=False)
    else:
        from clusterflow.strategies import MultiWorkerMirroredStrategy

        strategy = MultiWorkerMirroredStrategy()  # type: ignore[assignment]
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    ckpt = None
    if mode == "allreduce":
        from clusterflow.train.cut import Checkpointer

        ckpt = Checkpointer(strategy, model=model, optimizer=opt, every_steps=10)
        step = ckpt.restore()

    def train() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    while step < STEPS:
        strategy.run(train)
        step += 1
        log_step(out)
        if ckpt is not None:
            ckpt.maybe_save(step)


if __name__ == "__main__":
    main()
