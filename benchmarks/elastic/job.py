"""clusterflow's job in the elastic benchmark: ``python job.py MODE OUT``, run under
``clusterflow start``.

``allreduce``: ``MultiWorkerMirroredStrategy`` through ``clusterflow.fit``, fed by the
data service (a resize is live only with it): the MLP and global batch of
``shared.py`` (``GLOBAL_BATCH`` rows over however many replicas there are, the default
batch policy), epochs without end. Each step appends ``TASK STEP WORLD WALL_TIME`` to
``OUT/steps.log``, WORLD being the replicas that took the step, and each task marks in
``OUT/marks.log`` when its process was created, when it had imported torch and
clusterflow, and when its strategy was built (a newcomer's: admitted to the group).

``records``: an asynchronous ``ParameterServerStrategy`` through ``fit`` on ``Counter``
(``counts[i]`` is how often record ``i``'s update was applied: SGD at lr 1 on a
gradient of -1 at each trained id), ``RECORDS`` records for ``EPOCHS`` epochs. Each step
appends a line to ``OUT/steps.log``; while ``OUT/allow`` holds a number, a task that
finished a step waits until the log holds fewer lines (``hold``), so the benchmark
resizes and kills while the run is under way, never after its data ran out. The chief
writes every record's count to ``OUT/final.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared import GLOBAL_BATCH, batch, log_step, mark, model

RECORDS_ALLREDUCE, ENDLESS = 1_000_000, 1_000_000
"""The all-reduce job's records (an epoch is 15 625 steps: no trial reaches its end) and
epochs (the benchmark stops the job long before)."""
RECORDS, EPOCHS = 2000, 2
"""The records run's data: small enough that two epochs end soon after its last change."""


class Counter(nn.Module):
    """``counts[i]`` is how often record ``i``'s update was applied."""

    def __init__(self, records: int) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(records))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.counts[ids]


def lines(out: Path) -> int:
    log = out / "steps.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def hold(out: Path) -> None:
    """Waits while ``OUT/allow`` exists and the run made as many steps as it allows."""
    allow = out / "allow"
    while True:
        try:
            limit = int(allow.read_text() or "0")
        except (FileNotFoundError, ValueError):
            return
        if lines(out) < limit:
            return
        # A file written by another process: nothing to wait on but the file itself.
        time.sleep(0.02)


def allreduce(out: Path) -> None:
    import psutil

    import clusterflow
    from clusterflow.data import distributed_dataset
    from clusterflow.strategies import CommunicationOptions, MultiWorkerMirroredStrategy
    from clusterflow.train import Hook

    task = _task()
    mark(out, task, "created", psutil.Process().create_time())
    mark(out, task, "imported")
    # A newcomer's constructor says it is ready and waits until rank 0 admits it.
    strategy = MultiWorkerMirroredStrategy(CommunicationOptions(timeout_seconds=60))
    mark(out, task, "joined")
    with strategy.scope():
        net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = distributed_dataset(
        {"id": torch.arange(RECORDS_ALLREDUCE)},
        batch_size=GLOBAL_BATCH // strategy.num_replicas_in_sync,
        split_size=256,
        epochs=None,
        collate_fn=lambda cols: batch(torch.as_tensor(cols["id"])),
    )

    class Log(Hook):
        def after_step(self, session: Any, info: Any) -> None:
            log_step(out, task, info.step, strategy.num_replicas_in_sync)

    # Epochs without end: a grow that meets the end of the data fails its newcomers
    # (they join with no batch to take part in their peers' last steps with).
    clusterflow.fit(
        net, F.cross_entropy, opt, data, strategy=strategy, epochs=ENDLESS, hooks=[Log()]
    )


def records(out: Path) -> None:
    import clusterflow
    from clusterflow.data import distributed_dataset
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    from clusterflow.train import Hook

    strategy = ParameterServerStrategy(mode="async")
    with strategy.scope():
        counter = Counter(RECORDS)
    opt = torch.optim.SGD(counter.parameters(), lr=1.0)
    data = distributed_dataset(
        {"id": torch.arange(RECORDS)},
        batch_size=10,
        split_size=10,
        seed=7,
        epochs=EPOCHS,
        wait_for_all_acks=True,
        collate_fn=lambda cols: (torch.as_tensor(cols["id"]), torch.as_tensor(cols["id"])),
    )
    task = _task()

    class Paced(Hook):
        def after_step(self, session: Any, info: Any) -> None:
            log_step(out, task, info.step, 0)
            hold(out)

    def loss_fn(outputs: torch.Tensor, _ids: torch.Tensor) -> torch.Tensor:
        return -outputs.sum()

    clusterflow.fit(counter, loss_fn, opt, data, strategy=strategy, epochs=EPOCHS, hooks=[Paced()])
    data.close()
    if strategy.is_chief:
        counts = counter.counts.detach().tolist()
        (out / "final.json").write_text(json.dumps({"counts": counts, "epochs": EPOCHS}))
    strategy.close()


def _task() -> str:
    return os.environ["CLUSTERFLOW_TASK"]


def main() -> None:
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"allreduce": allreduce, "records": records}[mode](out)


if __name__ == "__main__":
    main()
