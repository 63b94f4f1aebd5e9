"""The job of the Ray growth test: ``python ray_growth_job.py OUT`` under
``clusterflow start --backend ray --ps 1 --workers 2:4``.

Each worker trains a tiny linear model with an asynchronous
``ParameterServerStrategy`` (so the manager may add workers while it runs) at a fixed
pace of its own, ``PACE_S`` per step, the stand-in for a step's compute: the job's step
rate is then the number of workers over ``PACE_S``, and a grown cluster steps faster.
Each step appends ``TASK STEP TIME`` to ``OUT/steps.log`` (the job's own count, with
the time it was made). The workers stop once ``OUT/stop`` exists.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

PACE_S = 0.5
"""One step's stand-in compute: long beside a push and a pull on the bridge."""


def main() -> None:
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    strategy = ParameterServerStrategy(mode="async")
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.ones(8, 4), torch.zeros(8, 1)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    task = os.environ.get("CLUSTERFLOW_TASK")
    number = 0
    while not (out / "stop").exists():
        strategy.run(step)
        time.sleep(PACE_S)  # the step's compute (the pace), not a wait for anything
        number += 1
        fd = os.open(out / "steps.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{task} {number} {time.time():.3f}\n".encode())
        finally:
            os.close(fd)
    strategy.close()


if __name__ == "__main__":
    main()
