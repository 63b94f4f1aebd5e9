"""The job of the live all-reduce resize test: ``python elastic_allreduce_job.py OUT RECORDS
EPOCHS [SPLIT_SIZE]`` under ``clusterflow start --chief --workers MIN:MAX``.

``clusterflow.fit`` with ``MultiWorkerMirroredStrategy`` and the data service (each
replica's batch is ``BATCH`` records at the start; the global batch stays
``BATCH * replicas`` across resizes). The model is a float64 linear regression on
features of each record's id, trained by SGD with momentum, so a newcomer that did not
receive the optimizer's state, or a step whose replicas' losses were not weighted by
their rows, ends away from the reference. Each step appends ``TASK step N ids I,J,..``
to ``OUT/steps.log`` (the ids this replica trained on), from which the test rebuilds
every global batch and replays them in one process (:func:`reference`). The test paces
the run with ``OUT/allow`` (``elastic_job.hold``); each replica touches
``OUT/started-TASK`` once its imports are done. The chief writes the final parameters
to ``OUT/final.json``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

BATCH = 4  # per replica, at the start
LR, MOMENTUM = 0.05, 0.9


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 1).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(features(ids)).squeeze(1)


def features(ids: torch.Tensor) -> torch.Tensor:
    x = ids.double()
    return torch.stack([torch.sin(x), torch.cos(0.7 * x), (x % 7) / 7], dim=1)


def target(ids: torch.Tensor) -> torch.Tensor:
    return (ids.double() % 5) / 5


def loss_of(outputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return ((outputs - target(ids)) ** 2).mean()


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def flat(model: nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


def reference(global_batches: Iterable[Sequence[int]]) -> list[float]:
    """One process fed the same global batches: the mean loss over each whole batch."""
    model = Regression()
    opt = optimizer_for(model)
    for ids in global_batches:
        batch = torch.tensor(list(ids), dtype=torch.int64)
        opt.zero_grad()
        loss_of(model(batch), batch).backward()
        opt.step()
    return flat(model)


def main() -> None:
    from chaos_job import progress
    from elastic_job import hold

    import clusterflow
    from clusterflow.data import distributed_dataset
    from clusterflow.strategies import CommunicationOptions, MultiWorkerMirroredStrategy
    from clusterflow.train import Hook

    torch.set_num_threads(1)
    out, _records, epochs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    split_size = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    # Its imports are done: a newcomer joins at its peers' next boundary from here. The
    # tests hold the peers until then, or a cold start under load could outlast the
    # steps left, and the newcomer would only sit in at the end.
    (out / f"started-{os.environ.get('CLUSTERFLOW_TASK')}").touch()
    strategy = MultiWorkerMirroredStrategy(CommunicationOptions(timeout_seconds=60))
    with strategy.scope():
        model = Regression()
    opt = optimizer_for(model)
    data = distributed_dataset(
        str(out / "records.parquet"),
        batch_size=BATCH,
        split_size=split_size,
        seed=11,
        epochs=epochs,
        wait_for_all_acks=True,
        collate_fn=lambda cols: (torch.as_tensor(cols["id"]), torch.as_tensor(cols["id"])),
    )
    trained: list[int] = []

    def loss_fn(outputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        trained[:] = [int(i) for i in ids]
        return loss_of(outputs, ids)

    class Paced(Hook):
        def after_step(self, session: Any, info: Any) -> None:
            # samples 0: a step taken with no batch of its own (its peers still had one)
            ids = ",".join(map(str, trained)) if info.samples else "-"
            progress(out, f"step {info.step} ids {ids}")
            hold(out)

    clusterflow.fit(model, loss_fn, opt, data, strategy=strategy, epochs=epochs, hooks=[Paced()])
    data.close()
    if strategy.is_chief:
        (out / "final.json").write_text(json.dumps({"params": flat(model)}))
    strategy.shutdown()


if __name__ == "__main__":
    main()
