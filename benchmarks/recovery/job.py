"""The job the recovery benchmark kills: ``python benchmarks/recovery/job.py MODE OUT``.

``async``: a worker of an asynchronous parameter-server run (respawned alone when it
dies). ``allreduce``: a replica of MultiWorkerMirroredStrategy, checkpointing every 10
steps (the whole cluster restarts from the last checkpoint when one dies). Each applied
step appends ``task pid attempt wall_time`` to ``OUT/steps.log``; the job's start, its
imports done, its strategy built and its checkpoint restored each append ``task attempt
NAME wall_time`` to ``OUT/phases.log`` (the benchmark's ``--verbose`` profile).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STARTED = time.time()  # before torch: a cold job's import shows in the `imports` phase

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

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


def mark(out: Path, name: str, at: float | None = None) -> None:
    """Appends ``task attempt NAME wall_time`` to ``OUT/phases.log`` (``--verbose``)."""
    line = (
        f"{os.environ['CLUSTERFLOW_TASK']} {os.environ.get('CLUSTERFLOW_ATTEMPT', '0')} "
        f"{name} {time.time() if at is None else at:.6f}\n"
    )
    with (out / "phases.log").open("a") as f:
        f.write(line)


def main() -> None:
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    mark(out, "started", STARTED)
    mark(out, "imported")
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
    mark(out, "strategy")
    step = 0
    ckpt = None
    if mode == "allreduce":
        from clusterflow.train.cut import Checkpointer

        ckpt = Checkpointer(strategy, model=model, optimizer=opt, every_steps=10)
        step = ckpt.restore()
    mark(out, "restored")

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
