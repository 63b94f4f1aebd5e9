"""The job of ``benchmarks.dashboard``: training that counts its own samples.

Each worker trains the MLP 784-512-512-10 (the ps and all-reduce benchmarks' model) with
async ``ParameterServerStrategy`` (``ps``) or ``MultiWorkerMirroredStrategy``
(``allreduce``), reading synthetic records leased from the manager's data service (so a
watching dashboard's ``data.status`` calls land on a busy dispatcher), and appends
``time samples`` to ``PROGRESS_DIR/<task>`` every 10 steps: the benchmark reads
throughput from there, not from anything the dashboard shows.

    python benchmarks/dashboard/job.py DATA.parquet PROGRESS_DIR ps|allreduce
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from clusterflow.data import distributed_dataset, torch_collate
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.train import Hook, fit
from clusterflow.train.api import Session, StepInfo

BATCH = 128


class Count(Hook):
    def __init__(self, path: str) -> None:
        self.out = open(path, "a", buffering=1)  # noqa: SIM115  # one line per write
        self.samples = 0

    def after_step(self, session: Session, info: StepInfo) -> None:
        self.samples += info.samples or BATCH
        if info.step % 10 == 0:
            self.out.write(f"{time.time():.4f} {self.samples}\n")


def collate(columns: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch_collate(columns)
    return batch["x"], batch["y"]


def main() -> None:
    data_path, progress, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    strategy: Any
    if kind == "ps":
        strategy = ParameterServerStrategy(mode="async")
    else:
        from clusterflow.strategies import MultiWorkerMirroredStrategy

        strategy = MultiWorkerMirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    task = os.environ.get("CLUSTERFLOW_TASK", "worker:0").replace(":", "-")
    data = distributed_dataset(
        data_path, batch_size=BATCH, split_size=BATCH * 4, seed=0, epochs=None, collate_fn=collate
    )
    fit(
        model,
        nn.CrossEntropyLoss(),
        optimizer,
        data,
        strategy=strategy,
        epochs=1_000_000,  # one per data-service epoch; the benchmark stops the cluster
        hooks=[Count(os.path.join(progress, task))],
    )


if __name__ == "__main__":
    main()
